"""Network faults injected for real, all on 127.0.0.1 with OS-chosen ports.

- `FaultyHTTPProxy`: a pass-through HTTP/1.1 proxy to one upstream (moto's S3, an engine, the
  router). Rules pick requests by method and path and make them fail: `error` answers an S3-style
  5xx, `drop` closes the connection without an answer, `stall` holds the request until
  `release()`, then drops it (it is never forwarded); `delay` forwards it after `delay_s` (a slow
  upstream). Every request is recorded (method, path, what was done, the request body), so a test
  can count retries or read what was sent.
  An optional `rewrite` hook changes upstream answers (an engine that misreports).
- `ScriptedServer`: a misbehaving HTTP server answering canned responses per (method, path);
  it records what it was asked.
Threads are daemons; `close()` stops the listener.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Literal

import httpx

Action = Literal["error", "drop", "stall", "delay"]

S3_ERROR = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>InternalError</Code>'
    b"<Message>We encountered an internal error. Please try again.</Message></Error>"
)


@dataclass
class Rule:
    """Fail requests whose method is in `methods` and whose path contains `path_contains`."""

    action: Action
    methods: tuple[str, ...] = ("GET", "PUT", "POST", "DELETE", "HEAD")
    path_contains: str = ""
    body_contains: bytes = b""
    times: int | None = None  # None: every matching request; else the first `times` ones
    status: int = 500
    delay_s: float = 0.5  # for `delay`
    hits: int = 0

    def matches(self, method: str, path: str, body: bytes = b"") -> bool:
        if method not in self.methods or self.path_contains not in path or self.body_contains not in body:
            return False
        return self.times is None or self.hits < self.times


@dataclass
class Seen:
    method: str
    path: str
    action: str  # "pass" or the rule's action
    body: bytes = b""  # the request body as received


class _Server(ThreadingHTTPServer):
    daemon_threads = True


@dataclass
class FaultyHTTPProxy:
    upstream: str
    rules: list[Rule] = field(default_factory=list)
    requests: list[Seen] = field(default_factory=list)
    # rewrite(method, path, upstream body) -> body answered instead (a liar in front of an engine)
    rewrite: Callable[[str, str, bytes], bytes] | None = None

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._released = threading.Event()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive and `Expect: 100-continue`, as S3 clients use

            def log_message(self, *args: object) -> None:
                pass

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                action = proxy._decide(self.command, self.path, body)
                if action == "stall":  # held until release(), then dropped: a stalled request never passes
                    proxy._released.wait(120)
                if action == "delay":
                    time.sleep(next(r.delay_s for r in proxy.rules if r.action == "delay"))
                if action in ("drop", "stall"):
                    self.close_connection = True
                    return
                if action == "error":
                    rule_status = next(r.status for r in proxy.rules if r.action == "error")
                    self._reply(rule_status, {"Content-Type": "application/xml"}, S3_ERROR)
                    return
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "expect")}
                with httpx.Client(timeout=120) as http:
                    resp = http.request(self.command, f"{proxy.upstream}{self.path}", content=body, headers=headers)
                keep = {
                    k: v
                    for k, v in resp.headers.items()
                    if k.lower() not in ("content-length", "transfer-encoding", "connection", "content-encoding")
                }
                content = proxy.rewrite(self.command, self.path, resp.content) if proxy.rewrite else resp.content
                self._reply(resp.status_code, keep, content, head=self.command == "HEAD")

            def _reply(self, status: int, headers: dict[str, str], content: bytes, head: bool = False) -> None:
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(content)))
                self.end_headers()
                if not head:
                    self.wfile.write(content)

            do_GET = do_PUT = do_POST = do_PATCH = do_DELETE = do_HEAD = _handle

        self.server = _Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def _decide(self, method: str, path: str, body: bytes) -> str:
        with self._lock:
            for rule in self.rules:
                if rule.matches(method, path, body):
                    rule.hits += 1
                    self.requests.append(Seen(method, path, rule.action, body))
                    return rule.action
            self.requests.append(Seen(method, path, "pass", body))
            return "pass"

    def release(self) -> None:
        """Drop the stalled requests (connection closed, never forwarded); pass every later one."""
        with self._lock:
            self.rules.clear()
        self._released.set()

    def seen(self, action: str, path_contains: str = "") -> list[Seen]:
        with self._lock:
            return [s for s in self.requests if s.action == action and path_contains in s.path]

    def close(self) -> None:
        self._released.set()
        self.server.shutdown()
        self.server.server_close()


Responder = Callable[[bytes], tuple[int, dict[str, str], bytes]]


class ScriptedServer:
    """Answers `routes[(method, path)](body) -> (status, headers, body)`; 404 otherwise."""

    def __init__(self, routes: dict[tuple[str, str], Responder]) -> None:
        self.routes = routes
        self.requests: list[tuple[str, str]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                path = self.path.split("?", 1)[0]
                server.requests.append((self.command, path))
                responder = server.routes.get((self.command, path))
                status, headers, content = responder(body) if responder else (404, {}, b'{"detail":"Not Found"}')
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(content)))
                self.end_headers()
                self.wfile.write(content)

            do_GET = do_POST = do_PATCH = do_DELETE = _handle

        self.server = _Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
