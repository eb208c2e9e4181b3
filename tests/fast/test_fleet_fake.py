"""An in-process HTTP server speaking the SGLang engine protocol, for fleet-client logic tests.

It stands in where a failure must be provoked on demand (a 503 that persists, a lying version, an
old server without /model_info, aborts); the real CPU engine is used in tests/e2e. It records every
request. Behaviour follows the protocol reference §1 (status codes, bodies, auth rules).
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx


@dataclass
class FakeEngine:
    """Knobs and the request log of one fake engine."""

    weight_version: str = "default"
    model_path: str = "/boot/model"
    health_status: int = 200
    old_api: bool = False  # no /model_info (SGLang 0.5.2): only /get_model_info
    load_delay_s: float = 0.0
    lie_version: str | None = None  # a successful load sets this version instead of the asked one
    lie_path: str | None = None  # ... and reports this model_path instead of the loaded one
    fail_loads: bool = False
    refuse_unknown_weights: bool = False  # like the bundled CPU engine: /health 503 after a failed load
    abort_first: int = 0  # abort this many /generate requests first
    unavailable_first: int = 0  # answer 503 (router: no healthy worker) to this many /generate requests first
    generate_version: str | None = None  # answer with this version instead of the live one
    spans: list[dict[str, Any]] | None = None
    generate_delay_s: float = 0.0
    api_key: str | None = None
    admin_api_key: str | None = None
    requests: list[tuple[str, str, Any, dict[str, str]]] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def calls(self, method: str, path: str) -> list[Any]:
        return [body for m, p, body, _ in self.requests if m == method and p == path]

    def authorized(self, path: str, headers: dict[str, str]) -> bool:
        """SGLang `decide_request_auth`: health open; admin endpoints take only the admin key if set."""
        if path.startswith(("/health", "/ready", "/metrics")):
            return True
        got = headers.get("authorization", "")
        admin = path in (
            "/update_weights_from_disk",
            "/update_weight_version",
            "/pause_generation",
            "/continue_generation",
            "/flush_cache",
        )
        if admin and self.admin_api_key:
            return got == f"Bearer {self.admin_api_key}"
        if self.api_key:
            return got == f"Bearer {self.api_key}"
        return True

    def handle(self, method: str, path: str, body: Any, headers: dict[str, str]) -> tuple[int, Any]:
        with self._lock:
            self.requests.append((method, path, body, headers))
        if not self.authorized(path, headers):
            return 401, {"error": "Unauthorized"}
        if method == "GET" and path == "/health":
            return self.health_status, None
        if method == "GET" and (path == "/get_model_info" or (path == "/model_info" and not self.old_api)):
            info = {
                "model_path": self.model_path,
                "served_model_name": "tiny",
                "tokenizer_path": self.model_path,
                "is_generation": True,
                "weight_version": self.weight_version,
                "load_format": "auto",
            }
            return 200, info
        if method == "POST" and path == "/update_weights_from_disk":
            return self._load(body)
        if method == "POST" and path == "/update_weight_version":
            self.weight_version = body["new_version"]
            return 200, {"success": True, "message": "ok", "new_version": self.weight_version}
        if method == "POST" and path in ("/pause_generation", "/continue_generation"):
            return 200, {"status": "ok"}
        if method == "POST" and path == "/generate":
            return self._generate(body)
        return 404, {"detail": "Not Found"}

    def _load(self, body: dict[str, Any]) -> tuple[int, Any]:
        time.sleep(self.load_delay_s)
        path = body["model_path"]
        self.model_path = path  # SGLang overwrites the path before it knows the load works (§1.7)
        if self.fail_loads or not os.path.isdir(path):
            if self.refuse_unknown_weights:
                self.health_status = 503
            return 400, {
                "success": False,
                "message": f"Failed to get weights iterator: {path}",
                "num_paused_requests": 0,
            }
        self.weight_version = self.lie_version or body.get("weight_version") or self.weight_version
        self.model_path = self.lie_path or path
        if self.refuse_unknown_weights:
            self.health_status = 200
        return 200, {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}

    def _generate(self, body: dict[str, Any]) -> tuple[int, Any]:
        if self.unavailable_first > 0:
            self.unavailable_first -= 1
            return 503, {"error": {"type": "Service Unavailable", "code": "no_available_workers"}}
        with self._lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            abort = self.abort_first > 0
            self.abort_first -= 1 if abort else 0
        try:
            time.sleep(self.generate_delay_s)
        finally:
            with self._lock:
                self.in_flight -= 1
        finish = (
            {"type": "abort", "message": "Abort all requests", "status_code": 200}
            if abort
            else {"type": "length", "length": 2}
        )
        meta: dict[str, Any] = {
            "id": body.get("rid") or "x",
            "finish_reason": finish,
            "prompt_tokens": 1,
            "completion_tokens": 2,
            "cached_tokens": 0,
            "weight_version": self.generate_version or self.weight_version,
        }
        if self.spans is not None:
            meta["weight_versions"] = self.spans
        return 200, {"text": " ok", "output_ids": [5, 6], "meta_info": meta}


class ServedFake:
    """A `FakeEngine` behind a real threaded HTTP server on 127.0.0.1 (port picked by the OS)."""

    def __init__(self, fake: FakeEngine | None = None, port: int = 0) -> None:
        self.fake = fake or FakeEngine()
        fake_ref = self.fake

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _do(self, method: str) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(n) if n else b""
                body = json.loads(raw) if raw else None
                headers = {k.lower(): v for k, v in self.headers.items()}
                status, payload = fake_ref.handle(method, self.path.split("?")[0], body, headers)
                data = b"" if payload is None else json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._do("GET")

            def do_POST(self) -> None:
                self._do("POST")

        ThreadingHTTPServer.allow_reuse_address = True
        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self.port = int(self.server.server_address[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self.server.serve_forever, args=(0.02,), daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=5)


def test_fake_follows_the_protocol_status_codes(tmp_path: Any) -> None:
    served = ServedFake(FakeEngine(api_key="k", admin_api_key="adm"))
    try:
        with httpx.Client() as http:
            assert http.get(f"{served.url}/health").status_code == 200  # always open
            assert http.get(f"{served.url}/model_info").status_code == 401
            good = {"Authorization": "Bearer k"}
            assert http.get(f"{served.url}/model_info", headers=good).json()["weight_version"] == "default"
            load = {"model_path": str(tmp_path), "weight_version": "7"}
            # with an admin key set, the normal key is not accepted on control endpoints (SGLang §1.1)
            assert http.post(f"{served.url}/update_weights_from_disk", json=load, headers=good).status_code == 401
            admin = {"Authorization": "Bearer adm"}
            assert http.post(f"{served.url}/update_weights_from_disk", json=load, headers=admin).status_code == 200
            bad = {"model_path": str(tmp_path / "missing"), "weight_version": "8"}
            resp = http.post(f"{served.url}/update_weights_from_disk", json=bad, headers=admin)
            assert resp.status_code == 400 and resp.json()["success"] is False
            assert http.get(f"{served.url}/model_info", headers=good).json()["weight_version"] == "7"
    finally:
        served.close()
