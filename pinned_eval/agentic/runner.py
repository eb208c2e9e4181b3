"""The runner: `python -m pinned_eval.agentic.runner`, the subprocess that runs miles generate
functions for one point. User code runs here, never in the worker.

Protocol (JSON lines; requests on stdin, events on the process's original stdout; whatever user
code prints goes to stderr, so it cannot forge an event):
- first request `{"op": "init", "miles_args": {...}, "gateway": {"base_url", "token"} | null,
  "python_path": [dirs]}`: the miles-compatible surface is installed unless real miles is
  importable (`pinned_eval.agentic.compat.install`), `python_path` is put first on `sys.path`,
  requests to the gateway carry its token (also in `OPENAI_API_KEY`, for agents' OpenAI
  clients); answered `{"event": "ready", "miles": "installed" | "compat"}`;
- `{"op": "sample", "id", "function", "args": {...}, "sample": {index, prompt, label, metadata,
  routing_key?, session_url?}, "sampling_params": {...}, "reward": name?}` (`session_url`: the
  sample's gateway session, the `base_url` an agent function gets): the function (`function` is miles'
  `module.attr`; loaded through `pinned_eval.plugins`, once per path) is called with
  `evaluation=True` in the shape miles' `load_generate_function` accepts: a class is instantiated
  with no arguments; a function with three or more parameters whose first is not named `input`
  is the old form `(args, sample, sampling_params[, evaluation=True])`; anything else gets a
  `GenerateFnInput(state, sample, sampling_params, evaluation=True)`. It may return a `Sample`,
  a `list[Sample]` or a `GenerateFnOutput` of either. Then, as miles' `generate_and_rm`: a
  reward set during generation is kept; every other sample but an ABORTED one gets the dataset's
  reward `reward` (`dataset_reward`). Answered `{"event": "result", "id",
  "samples": [...]}` (`sample_record`) or `{"event": "error", "id", "type", "message"}`
  naming the exception's type;
- requests run concurrently; `{"event": "heartbeat"}` is written every `HEARTBEAT_S`; EOF on
  stdin ends the process.
- the worker starts it through `pinned_eval.agentic.imports.runner_command`: the working directory
  is not on `sys.path`, only the init's `python_path` (checked by the worker first) and the
  interpreter's own paths;
- `args` (miles' namespace, §1.7 names): `DEFAULT_ARGS`, then the init's `miles_args`, then the
  request's `args`; `sglang_router_ip/port` name the point gateway.
`python -m pinned_eval.agentic.runner --check PATH... [--python-path DIR]...` imports each function
path with the surface installed and those roots first on `sys.path`, and prints one JSON line:
`{"ok": true}` or `{"ok": false, "path", "message"}`.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import os
import sys
from types import SimpleNamespace
from typing import Any

__all__ = ["DEFAULT_ARGS", "HEARTBEAT_S", "call_generate", "main", "sample_record"]

HEARTBEAT_S = 2.0
DEFAULT_ARGS: dict[str, Any] = {
    "sglang_router_ip": "127.0.0.1", "sglang_router_port": None, "sglang_router_policy": None,
    "hf_checkpoint": None, "chat_template_path": None, "apply_chat_template": False,
    "apply_chat_template_kwargs": {}, "partial_rollout": False, "mask_offpolicy_in_partial_rollout": False,
    "rollout_max_context_len": None, "eval_max_context_len": None, "eval_max_prompt_len": None,
    "rollout_max_response_len": 1024, "rollout_temperature": 1.0, "rollout_top_p": 1.0, "rollout_top_k": -1,
    "rollout_stop": None, "rollout_stop_token_ids": None, "rollout_skip_special_tokens": False,
    "rollout_seed": 42, "sglang_server_concurrency": 64, "rollout_num_gpus": 1, "rollout_num_gpus_per_engine": 1,
    "eval_num_gpus": 0, "eval_num_gpus_per_engine": 1, "use_distributed_post": False,
    "use_rollout_routing_replay": False, "use_rollout_indexer_replay": False, "sglang_speculative_algorithm": None,
    "num_layers": None, "multimodal_keys": None, "save_debug_trajectory_data": False, "group_rm": False,
    "reward_key": None, "eval_reward_key": None, "rm_type": None, "custom_rm_path": None, "rm_url": None,
    "generate_max_turns": 16, "generate_tool_specs_path": None, "generate_tool_call_parser": None,
    "generate_execute_tool_function_path": None, "custom_agent_function_path": None, "max_seq_len": None,
    "use_session_server": False, "session_server_ip": None, "session_server_port": None,
}


def _emit(stream: Any, event: dict[str, Any]) -> None:
    stream.write((json.dumps(event, default=str) + "\n").encode())
    stream.flush()


def _json_safe(value: Any) -> Any:
    try:
        return json.loads(json.dumps(value, default=str))
    except (TypeError, ValueError):
        return str(value)


def sample_record(sample: Any) -> dict[str, Any]:
    """A returned miles `Sample` as JSON: what pinned-eval keeps of it."""
    status = getattr(sample, "status", None)
    return {
        "index": sample.index,
        "prompt": sample.prompt if isinstance(sample.prompt, str) else _json_safe(sample.prompt),
        "response": sample.response,
        "response_length": int(sample.response_length or 0),
        "status": getattr(status, "value", status),
        "reward": _json_safe(sample.reward),
        "label": _json_safe(sample.label),
        "metadata": _json_safe(sample.metadata or {}),
        "weight_versions": [str(v) for v in (sample.weight_versions or [])],
    }


async def dataset_reward(name: str, args: Any, sample: Any) -> Any:
    """The dataset's reward of `sample`: a miles `async (args, sample)` custom reward is called
    with the runner's args and sample; any other reward (`pinned_eval.scoring.rewards`) scores
    (response, label, metadata). `remote_rm` is left to the worker (None)."""
    from pinned_eval.scoring.miles_custom import is_miles_sample_reward
    from pinned_eval.scoring.rewards import CUSTOM_PREFIX, REMOTE_REWARD, get_reward

    if name == REMOTE_REWARD:
        return None
    if name.startswith(CUSTOM_PREFIX):
        from pinned_eval.plugins import load_object

        fn = load_object(name.removeprefix(CUSTOM_PREFIX), expect=callable, what=f"reward {name!r}")
        if is_miles_sample_reward(fn):
            result = fn(args, sample)
            return await result if inspect.isawaitable(result) else result
    return get_reward(name)(sample.response, sample.label, sample.metadata)


def _is_old_form(fn: Any) -> bool:
    params = list(inspect.signature(fn).parameters.values())
    return len(params) >= 3 and params[0].name != "input"


async def call_generate(fn: Any, args: Any, sample: Any, sampling_params: dict[str, Any]) -> list[Any]:
    """Call `fn` as miles' `load_generate_function` would (see the module docstring); the samples."""
    if inspect.isclass(fn):
        fn = fn()
    if _is_old_form(fn):
        kwargs = {"evaluation": True} if "evaluation" in inspect.signature(fn).parameters else {}
        out = await fn(args, sample, sampling_params, **kwargs)
    else:
        from miles.rollout.base_types import GenerateFnInput  # served by the surface or real miles
        from miles.rollout.sglang_rollout import GenerateState

        state = GenerateState(args)
        out = await fn(GenerateFnInput(state=state, sample=sample, sampling_params=sampling_params, evaluation=True))
    out = getattr(out, "samples", out)
    samples = out if isinstance(out, list) else [out]
    for s in samples:
        if not hasattr(s, "response") or not hasattr(s, "status"):
            raise TypeError(f"the generate function returned {type(s).__name__}, not a Sample")
    return samples


class _Runner:
    def __init__(self, out: Any) -> None:
        self.out = out
        self.base_args: dict[str, Any] = dict(DEFAULT_ARGS)
        self.functions: dict[str, Any] = {}
        self.tasks: set[asyncio.Task[None]] = set()

    def init(self, req: dict[str, Any]) -> dict[str, Any]:
        from pinned_eval.agentic import compat

        for path in reversed(req.get("python_path") or []):
            sys.path.insert(0, path)
        installed = compat.install()
        self.base_args.update(req.get("miles_args") or {})
        gateway = req.get("gateway")
        if gateway:
            if installed:
                from pinned_eval.agentic.compat.http_utils import set_gateway_auth
            else:  # real miles: its module-global client gets the header
                set_gateway_auth = self._real_miles_auth
            set_gateway_auth(gateway["base_url"], gateway["token"])
            os.environ["OPENAI_API_KEY"] = gateway["token"]  # what an agent's OpenAI client sends
        return {"event": "ready", "miles": "compat" if installed else "installed"}

    def _real_miles_auth(self, base_url: str, token: str) -> None:
        """Real miles: its module-global client (made here, as miles' `init_http_client(args)`
        does) sends the gateway's token; miles' `post` sends no header of its own."""
        from miles.utils import http_utils

        http_utils.init_http_client(SimpleNamespace(**self.base_args))
        http_utils._http_client.headers["Authorization"] = f"Bearer {token}"

    def function(self, path: str) -> Any:
        if path not in self.functions:
            from pinned_eval.plugins import load_object

            self.functions[path] = load_object(path, expect=callable, what=f"generate function {path!r}")
        return self.functions[path]

    async def sample(self, req: dict[str, Any]) -> None:
        rid = req.get("id")
        try:
            from miles.utils.types import Sample

            fn = self.function(req["function"])
            args = SimpleNamespace(**{**self.base_args, **(req.get("args") or {})})
            raw = req["sample"]
            sample = Sample(
                index=raw["index"], prompt=raw["prompt"], label=raw.get("label"),
                metadata=dict(raw.get("metadata") or {}),
                generate_function_path=req["function"], routing_key=raw.get("routing_key"),
            )
            if installed_surface():
                from pinned_eval.agentic.compat.agentic_tool_call import SESSION_URL

                SESSION_URL.set(raw.get("session_url"))  # this task's context only
            samples = await call_generate(fn, args, sample, dict(req.get("sampling_params") or {}))
            for s in samples:  # miles' generate_and_rm: a preset reward is kept; ABORTED is not scored
                if s.reward is None and req.get("reward") and getattr(s.status, "value", s.status) != "aborted":
                    s.reward = await dataset_reward(req["reward"], args, s)
            _emit(self.out, {"event": "result", "id": rid, "samples": [sample_record(s) for s in samples]})
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError):
                raise
            _emit(self.out, {"event": "error", "id": rid, "type": type(exc).__name__, "message": str(exc)[:2000]})

    async def serve(self, reader: asyncio.StreamReader) -> None:
        beat = asyncio.create_task(self._heartbeat())
        try:
            while line := await reader.readline():
                req = json.loads(line)
                if req.get("op") == "init":
                    try:
                        _emit(self.out, self.init(req))
                    except Exception as exc:
                        _emit(self.out, {"event": "error", "id": None, "type": type(exc).__name__, "message": str(exc)})
                        return
                elif req.get("op") == "sample":
                    task = asyncio.create_task(self.sample(req))
                    self.tasks.add(task)
                    task.add_done_callback(self.tasks.discard)
        finally:
            beat.cancel()

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            _emit(self.out, {"event": "heartbeat"})


def installed_surface() -> bool:
    """Whether this process serves pinned-eval's miles-compatible surface."""
    from pinned_eval.agentic.compat import MilesSurfaceFinder

    return any(isinstance(f, MilesSurfaceFinder) for f in sys.meta_path)




def check_paths(paths: list[str], python_path: list[str] | None = None) -> dict[str, Any]:
    """Import every path with the surface installed and `python_path` first on `sys.path` (as
    `init` puts it); the first failure, named."""
    from pinned_eval.agentic import compat
    from pinned_eval.plugins import load_object

    for root in reversed(python_path or []):
        sys.path.insert(0, root)
    compat.install()
    for path in paths:
        try:
            load_object(path, expect=lambda obj: obj is not None, what=f"generate function {path!r}")
        except Exception as exc:
            cause = exc.__cause__ if isinstance(exc.__cause__, ImportError) else exc
            return {"ok": False, "path": path, "message": str(cause)}
    return {"ok": True}


async def _amain(out: Any) -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=64 * 1024 * 1024)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    await _Runner(out).serve(reader)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pinned_eval.agentic.runner")
    parser.add_argument("--check", nargs="*", default=None, help="dry-import these generate function paths")
    parser.add_argument("--python-path", action="append", default=[], help="an import root (--check)")
    ns = parser.parse_args(argv)
    out = os.fdopen(os.dup(1), "wb")  # the protocol stream; fd 1 now goes to stderr (user prints)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    if ns.check is not None:
        _emit(out, check_paths(ns.check, ns.python_path))
        return
    asyncio.run(_amain(out))


if __name__ == "__main__":
    main()
