"""Event-loop side state of one engine: the runner, the weight-update lock, pause and health.

Contract (SGLang's tokenizer-manager semantics):
- Every /generate holds `lock.read()` for its whole life; `/update_weights_from_disk` takes
  `lock.write()` unless the engine is paused, so a load waits for in-flight requests and new
  requests queue behind a waiting load (writer preference).
- New /generate calls wait while paused (`wait_unpaused`) before taking the read lock.
- HTTP edge helpers: `Refused` (status + JSON body), `normal_auth`/`admin_auth` (SGLang's
  Bearer-key rules), `parse_body` (400 naming the bad field).
- `serving_state()` is None when the engine can serve, else why not (starting, loading, paused,
  weights unknown); /health, /health_generate and /ready answer 503 in those states.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Request
from pydantic import BaseModel, ValidationError

from engine.launch import EngineArgs
from engine.protocol import describe
from engine.runner import Runner


class RWLock:
    """A writer-preferring asyncio readers-writer lock."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0

    @property
    def readers(self) -> int:
        return self._readers

    @asynccontextmanager
    async def read(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._writer and self._writers_waiting == 0)
            self._readers += 1
        try:
            yield
        finally:
            async with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @asynccontextmanager
    async def write(self) -> AsyncIterator[None]:
        async with self._cond:
            self._writers_waiting += 1
            try:
                await self._cond.wait_for(lambda: not self._writer and self._readers == 0)
            finally:
                self._writers_waiting -= 1
            self._writer = True
        try:
            yield
        finally:
            async with self._cond:
                self._writer = False
                self._cond.notify_all()


class EngineState:
    """Everything the HTTP handlers share; created in the app's lifespan."""

    def __init__(self, args: EngineArgs, runner: Runner, tokenizer, script: Any = None) -> None:
        self.args = args
        self.script = script  # engine.scripted.Script when --scripted-completions is set
        self.runner = runner
        self.tokenizer = tokenizer  # the event loop's own copy (the runner thread has another)
        self.lock = RWLock()
        self.paused = False
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self.loading = 0
        self.startup_time = time.time()

    def serving_state(self) -> str | None:
        if self.loading:
            return "loading weights"
        if self.paused:
            return "paused"
        if not self.runner.weights_ok:
            return "weights unknown after a failed load"
        return None

    def set_paused(self, paused: bool) -> None:
        self.paused = paused
        if paused:
            self._unpaused.clear()
        else:
            self._unpaused.set()

    async def wait_unpaused(self) -> None:
        await self._unpaused.wait()

    @property
    def served_model_name(self) -> str:
        return self.args.served_model_name or self.args.model_path


# ---- HTTP edge helpers ---------------------------------------------------------------------------
class Refused(Exception):
    """Answer the request with `status` and JSON `body` (raised by edge checks)."""

    def __init__(self, status: int, body: dict) -> None:
        self.status, self.body = status, body


def engine_state(request: Request) -> EngineState:
    return request.app.state.engine


def _check_key(request: Request, expected: str | None) -> None:
    if expected is None:
        return
    header = request.headers.get("authorization", "")
    token = header[7:].strip() if header[:7].lower() == "bearer " else ""
    if not secrets.compare_digest(token.encode(), expected.encode()):
        raise Refused(401, {"error": "Unauthorized"})


def normal_auth(request: Request) -> None:
    _check_key(request, engine_state(request).args.api_key)


def admin_auth(request: Request) -> None:
    args = engine_state(request).args
    _check_key(request, args.admin_api_key if args.admin_api_key is not None else args.api_key)


async def parse_body(request: Request, model: type[BaseModel], failure: str = "error") -> Any:
    raw = await request.body()
    try:
        data = json.loads(raw) if raw.strip() else {}
        return model.model_validate(data)
    except json.JSONDecodeError as err:
        message = f"body: invalid JSON ({err})"
    except ValidationError as err:
        message = describe(err)
    body = {"success": False, "message": message} if failure == "message" else {"error": message}
    raise Refused(400, body)
