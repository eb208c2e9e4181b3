"""Faults injected for real in tests: a proxy in front of a real engine that makes it misreport, and
a recording pass-through proxy (what an engine really received, after sglang-router)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx


class RelabelingProxy:
    """Pass-through HTTP proxy to one engine; after each successful weight load it relabels the engine."""

    def __init__(self, engine_url: str, label: str) -> None:
        self.loads = 0
        self.relabels = bool(label)
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _forward(self, method: str) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                proxy.record(method, self.path, body)
                canned = proxy.intercept(self.path)
                if canned is not None:
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(canned)))
                    self.end_headers()
                    self.wfile.write(canned)
                    return
                headers = {"Content-Type": "application/json"}
                if self.headers.get("Authorization"):  # the engine's bearer key passes through
                    headers["Authorization"] = self.headers["Authorization"]
                with httpx.Client(timeout=120) as http:
                    resp = http.request(method, f"{engine_url}{self.path}", content=body, headers=headers)
                    if proxy.relabels and self.path == "/update_weights_from_disk" and resp.status_code == 200:
                        proxy.loads += 1  # relabel with the load's own (admin) key
                        relabel = {"new_version": label, "abort_all_requests": False}
                        relabeled = http.post(f"{engine_url}/update_weight_version", json=relabel, headers=headers)
                        relabeled.raise_for_status()
                self.send_response(resp.status_code)
                self.send_header("Content-Type", resp.headers.get("content-type", "application/json"))
                self.send_header("Content-Length", str(len(resp.content)))
                self.end_headers()
                self.wfile.write(resp.content)

            def do_GET(self) -> None:
                self._forward("GET")

            def do_POST(self) -> None:
                self._forward("POST")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()

    def record(self, method: str, path: str, body: bytes) -> None:
        """Hook for subclasses: called with every request before it is forwarded."""

    def intercept(self, path: str) -> bytes | None:
        """Hook for subclasses: a JSON body to answer 200 with instead of forwarding, or None."""
        return None

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class RecordingProxy(RelabelingProxy):
    """Pass-through proxy to one engine (no relabelling) that keeps every request it forwarded:
    `requests` holds (method, path, JSON body or None) in arrival order."""

    def __init__(self, engine_url: str) -> None:
        self.requests: list[tuple[str, str, object]] = []
        self._lock = threading.Lock()
        super().__init__(engine_url, label="")

    def record(self, method: str, path: str, body: bytes) -> None:
        with self._lock:
            self.requests.append((method, path, json.loads(body) if body.strip() else None))

    def bodies(self, path: str) -> list[object]:
        with self._lock:
            return [b for _, p, b in self.requests if p == path]


class LoraLoadLiar(RecordingProxy):
    """An engine that answers `/load_lora_adapter` with success but never loads the adapter."""

    def intercept(self, path: str) -> bytes | None:
        if path == "/load_lora_adapter":
            return json.dumps({"success": True, "error_message": "", "loaded_adapters": {}}).encode()
        return None
