"""A scoring service (remote_rm) on 127.0.0.1 that requires `Authorization: Bearer <token>`.

It scores `float(response == label)`. Like a careless service, it echoes the header it got into
its 401 body (or, with `echo_ok`, into a 200 body that is not a reward), so a test can check that
no error text carries the secret on. `seen` records every Authorization header received.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class BearerJudge(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, token: str) -> None:
        self.token, self.echo_ok = token, False
        self.seen: list[str | None] = []
        judge = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:
                sample = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                auth = self.headers.get("Authorization")
                judge.seen.append(auth)
                if judge.echo_ok:
                    status, body = 200, json.dumps({"echo": auth}).encode()
                elif auth != f"Bearer {judge.token}":
                    status, body = 401, f"bad credentials: {auth!r}".encode()
                else:
                    status, body = 200, json.dumps(float(sample["response"] == sample["label"])).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, args=(0.05,), daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/score"

    def close(self) -> None:
        self.shutdown()
        self.server_close()
