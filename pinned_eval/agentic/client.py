"""The worker's side of the runner (`pinned_eval.agentic.runner`): `AgentRunner`.

Contract:
- `async with AgentRunner(init, python=None) as runner:` starts `pinned_eval.agentic.runner`
  (under `python`, else this interpreter; `pinned_eval.agentic.imports.runner_command`) with
  `pinned_eval.processes.pipe_child_options` (own process group, parent-death SIGKILL, an
  address-space limit of `memory_bytes`), sends `init` and waits for `ready` (`startup_s`);
  on exit the process group is stopped (SIGTERM, then SIGKILL), so nothing it started stays.
- `await runner.generate(request, timeout_s)` sends one sample request and returns its records
  (`list[dict]`, `runner.sample_record`). Every failure is an `AgentError` with `type` (the user
  exception's type name, `TimeoutError` past `timeout_s`, `RunnerDied` when the process ended,
  e.g. killed for memory, `OutputFlood` for an event over `MAX_EVENT_BYTES`) and `message`.
- what user code prints goes to the runner's stderr; only the last `STDERR_TAIL` bytes are kept
  (for messages), so an output flood costs no memory here.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
from types import TracebackType
from typing import Any

from pinned_eval.agentic.imports import runner_command
from pinned_eval.processes import pipe_child_options, stop_groups

__all__ = ["MAX_EVENT_BYTES", "STDERR_TAIL", "AgentError", "AgentRunner"]

MAX_EVENT_BYTES = 16 * 1024 * 1024
STDERR_TAIL = 4096


class AgentError(RuntimeError):
    """A sample the runner could not produce: `type` names the cause, `message` says what."""

    def __init__(self, type_: str, message: str) -> None:
        self.type, self.message = type_, message
        super().__init__(f"{type_}: {message}")


class AgentRunner:
    """One runner subprocess (see the module docstring)."""

    def __init__(
        self,
        init: dict[str, Any],
        *,
        memory_bytes: int | None = 4 * 1024**3,
        startup_s: float = 60.0,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        python: str | None = None,
    ) -> None:
        self._init = {"op": "init", **init}
        self._memory = memory_bytes
        self._startup_s = startup_s
        self._cwd = cwd
        self._env = env
        self._python = python
        self._ids = itertools.count()
        self._pending: dict[int, asyncio.Future[list[dict[str, Any]]]] = {}
        self._ready: asyncio.Future[dict[str, Any]] | None = None
        self._proc: asyncio.subprocess.Process | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stderr = b""
        self._dead: AgentError | None = None
        self.miles: str | None = None  # "compat" or "installed" once ready

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    async def __aenter__(self) -> AgentRunner:
        self._ready = asyncio.get_running_loop().create_future()
        argv, boot_env = runner_command(self._python)
        self._proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            limit=MAX_EVENT_BYTES, cwd=self._cwd, env={**os.environ, **boot_env, **(self._env or {})},
            **pipe_child_options(memory_bytes=self._memory),  # type: ignore[arg-type]
        )
        self._tasks = [asyncio.create_task(self._read_events()), asyncio.create_task(self._drain_stderr())]
        try:
            self._send(self._init)
            ready = await asyncio.wait_for(asyncio.shield(self._ready), self._startup_s)
        except BaseException:
            await self.close()
            raise
        self.miles = ready.get("miles")
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    def _send(self, req: dict[str, Any]) -> None:
        assert self._proc is not None and self._proc.stdin is not None
        if self._dead is not None:
            raise self._dead
        self._proc.stdin.write((json.dumps(req) + "\n").encode())

    async def generate(self, request: dict[str, Any], timeout_s: float) -> list[dict[str, Any]]:
        rid = next(self._ids)
        fut: asyncio.Future[list[dict[str, Any]]] = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        try:
            self._send({"op": "sample", "id": rid, **request})
            return await asyncio.wait_for(fut, timeout_s)
        except TimeoutError:
            raise AgentError("TimeoutError", f"no result within {timeout_s:g} s") from None
        finally:
            self._pending.pop(rid, None)

    async def _read_events(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        why: AgentError | None = None
        try:
            while line := await self._proc.stdout.readline():
                self._dispatch(json.loads(line))
        except (ValueError, asyncio.LimitOverrunError):  # LimitOverrun surfaces as ValueError from readline
            why = AgentError("OutputFlood", f"the runner wrote an event over {MAX_EVENT_BYTES} bytes")
            with contextlib.suppress(ProcessLookupError):
                self._proc.kill()
        code = await self._proc.wait()
        await asyncio.sleep(0)  # let the stderr drain take the last bytes
        tail = self._stderr.decode(errors="replace").strip().splitlines()[-3:]
        self._fail(why or AgentError("RunnerDied", f"the runner exited ({code}): {' | '.join(tail)[-600:]}"))

    def _dispatch(self, event: dict[str, Any]) -> None:
        kind = event.get("event")
        if kind == "ready" and self._ready is not None and not self._ready.done():
            self._ready.set_result(event)
            return
        if kind == "error" and event.get("id") is None:
            self._fail(AgentError(str(event.get("type")), str(event.get("message"))))
            return
        fut = self._pending.get(event.get("id", -1))
        if fut is None or fut.done():
            return
        if kind == "result":
            fut.set_result(list(event["samples"]))
        elif kind == "error":
            fut.set_exception(AgentError(str(event.get("type")), str(event.get("message"))))

    def _fail(self, err: AgentError) -> None:
        self._dead = self._dead or err
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(err)
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(err)

    async def _drain_stderr(self) -> None:
        assert self._proc is not None and self._proc.stderr is not None
        while chunk := await self._proc.stderr.read(65536):
            self._stderr = (self._stderr + chunk)[-STDERR_TAIL:]

    async def close(self) -> None:
        """Stop the runner's process group (idempotent)."""
        if self._proc is None:
            return
        if self._proc.returncode is None:
            await asyncio.to_thread(stop_groups, [self._proc.pid], grace_s=2.0)
        with contextlib.suppress(ProcessLookupError):
            await self._proc.wait()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._ready is not None and not self._ready.done():
            self._ready.cancel()
