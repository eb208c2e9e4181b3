"""Record golden outputs of miles generate functions with miles' own code (not needed by tests).

Runs miles' `generate_and_rm` (`miles.rollout.inference_rollout.inference_rollout_common`, with
`evaluation=True`, as miles' eval does) on fixtures in tests/fixtures/miles_style/ against the
same scripted CPU engine the e2e tests use (tests/e2e/test_function_fleet.py: its RULES, the tiny
llama model, behind the real sglang-router; its retriever stub), and prints one JSON line per fixture: what
`tests/data/miles_generate_golden.jsonl` holds.

    python scripts/record_miles_generate_goldens.py --miles /path/to/miles-checkout >> tests/data/...

miles' import chain pulls in `ray` and `sglang` modules that these fixtures' code paths never
call; without them installed, they are served as stubs that raise when called, and the script
refuses to print anything if one was. `pybase64` (miles' endpoint utils) must be importable.

The agent function over chat completions (`agentic_tool_call`) runs behind miles' own session
server (`miles.rollout.session.server.SessionServer`, v1, on 127.0.0.1). It proxies to the engine
itself, as behind miles' pass-through router: its token tracking needs SGLang's chat extensions
(`input_ids`, `return_meta_info`), which the sglang-router drops
(tests/e2e/test_engine_v1_contract.py). It imports sglang's OpenAI protocol models, which are real
after `pip install --no-deps sglang` plus `pip install openai msgspec` (in a scratch venv); then
only sglang's import-time `triton` / `zmq` / `IPython` and the modules of sglang's main branch the
release lacks (SGLANG_NEWER) are stubs. The agent carries the fleet's key itself
(`OPENAI_API_KEY`); the session server forwards it to the engine.

The retool-style case runs the generate hub's `multi_turn` with the fixture's `tool_specs` and
`execute_tool` (tests/fixtures/miles_style/retool_style.py) and sglang's real `qwen25` tool-call
parser, which also needs `pip install partial_json_parser` and
`pip install --no-deps xgrammar apache-tvm-ffi` (its import-time `StructuralTag` is a pydantic field).
The Python-tool case runs miles' own retool tool (`examples.retool_v2.tool_sandbox`, from the
checkout) on the code the scripted engine of tests/e2e/test_agentic_point.py writes (`print(6*7)`).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import types
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "miles_style"
CALLED: list[str] = []
AGENT = "miles.rollout.generate_hub.agentic_tool_call.generate"
TOOLS = [{"type": "function", "function": {"name": "code_interpreter", "parameters": {"type": "object"}}}]
# fixture, reward (pinned-eval's name), rows (prompt, label[, metadata]), max_new_tokens[, extra miles args]
CASES: list[tuple[Any, ...]] = [
    ("search_r1_style.generate", "custom:search_r1_style.reward_func", [("Capital of France?", "Paris")], 48),
    ("multi_agent_style.generate_with_multi_agents", "math", [("3+4?", "7")], 48),
    ("echo_old.generate", "math", [("p0", "1"), ("p1", "2")], 1024),
    ("miles.rollout.generate_hub.single_turn.generate", "math", [("Capital of France?", "x")], 48),
    (AGENT, "custom:agent_chat.reward_from_metadata", [("What is 2+2?", "4", {"tools": TOOLS})], 256,
     {"custom_agent_function_path": "agent_chat.run_agent", "use_session_server": True}),
    ("miles.rollout.generate_hub.multi_turn.generate", "math", [("What is 2+2?", "4")], 256,
     {"generate_max_turns": 3, "generate_tool_specs_path": "retool_style.tool_specs",
      "generate_tool_call_parser": "qwen25", "generate_execute_tool_function_path": "retool_style.execute_tool"}),
]
# against tests/e2e/test_agentic_point.py's engine (its RULES, weight version 3 as its point pins):
# the retool-style dataset with a Python tool that really runs the model's code, miles' own
# (examples/retool_v2/tool_sandbox.py) where pinned-eval runs its stock tool in the sandbox
PYTHON_TOOL_CASES: list[tuple[Any, ...]] = [
    ("miles.rollout.generate_hub.multi_turn.generate", "math", [("What is 6*7?", "42")], 256,
     {"generate_max_turns": 3, "generate_tool_specs_path": "examples.retool_v2.tool_sandbox.tool_specs",
      "generate_tool_call_parser": "qwen25",
      "generate_execute_tool_function_path": "examples.retool_v2.tool_sandbox.execute_tool"}),
]
# sglang's package imports these at import time; the protocol models the agent path uses never call them
SGLANG_IMPORT_TIME = ("triton", "zmq", "IPython")
# modules miles imports from sglang's main branch that the released sglang lacks (stubbed when missing)
SGLANG_NEWER = ("sglang.srt.entrypoints.openai.encoding_dsv4",)


class _Stub(types.ModuleType):
    """A module nothing on the recorded path may use: any call raises (and is remembered)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Stub(f"{self.__name__}.{name}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and callable(args[0]) and not kwargs:  # a decorator at import time
            return args[0]
        CALLED.append(self.__name__)
        raise RuntimeError(f"stubbed {self.__name__} was called")

    def __mro_entries__(self, bases: tuple[Any, ...]) -> tuple[type, ...]:
        return (object,)


class _StubFinder:
    def __init__(self, roots: set[str]) -> None:
        self.roots = roots

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if any(name == r or name.startswith(f"{r}.") for r in self.roots):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        return _Stub(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__path__ = []  # type: ignore[attr-defined]


def _retriever() -> Any:
    """The e2e tests' retriever stub (tests/e2e/test_function_fleet.py) on 127.0.0.1."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            docs = [{"document": {"contents": "Paris is the capital of France."}}]
            out = json.dumps({"result": [docs[: body["topk"]]]}).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *a: object) -> None:
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _args(model: Path, router: str, reward: str, max_new_tokens: int) -> argparse.Namespace:
    from pinned_eval.agentic.runner import DEFAULT_ARGS

    host, port = router.removeprefix("http://").rsplit(":", 1)
    custom = reward.removeprefix("custom:").replace(":", ".") if reward.startswith("custom:") else None
    return argparse.Namespace(**{
        **DEFAULT_ARGS, "sglang_router_ip": host, "sglang_router_port": int(port), "hf_checkpoint": str(model),
        "rm_type": None if custom else reward, "custom_rm_path": custom, "custom_generate_function_path": None,
        "rollout_temperature": 0.0, "rollout_max_response_len": max_new_tokens, "rollout_num_gpus": 1,
    })


def _session_server(args: argparse.Namespace, engine: str) -> tuple[Any, Any]:
    """miles' own session server (v1) on 127.0.0.1, proxying to `engine`; returns (server, thread)."""
    import threading

    import uvicorn
    from miles.rollout.session.server import SessionServer

    config = uvicorn.Config(SessionServer(args, engine).app, host="127.0.0.1", port=args.session_server_ports[0],
                            log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise SystemExit("miles' session server did not start")
        thread.join(0.05)
    return server, thread


async def _record(cases: list[tuple[Any, ...]], model: Path, router: str, engine: str, api_key: str,
                  miles_commit: str) -> list[dict[str, Any]]:
    from miles.rollout.inference_rollout.inference_rollout_common import (
        GenerateState,
        compute_sampling_params,
        generate_and_rm,
    )
    from miles.utils import http_utils
    from miles.utils.types import Sample

    from tests.conftest import free_port

    out = []
    for fixture, reward, rows, max_new_tokens, *extra in cases:
        args = _args(model, router, reward, max_new_tokens)
        session = None
        if extra:
            vars(args).update(extra[0])
        if args.use_session_server:
            port = free_port()
            vars(args).update(session_server_ip="127.0.0.1", session_server_ports=[port], session_server_port=port)
            session = _session_server(args, engine)
            os.environ["OPENAI_API_KEY"] = api_key
        http_utils._http_client = None
        http_utils.init_http_client(args)
        assert http_utils._http_client is not None
        http_utils._http_client.headers["Authorization"] = f"Bearer {api_key}"  # the fleet's key, as the gateway adds
        state = GenerateState(args)
        params = compute_sampling_params(args, temperature=0.0, top_p=1.0, top_k=-1, max_new_tokens=max_new_tokens)
        try:
            for index, (prompt, label, *row_metadata) in enumerate(rows):
                metadata = {**(row_metadata[0] if row_metadata else {}), "rm_type": args.rm_type}
                sample = Sample(index=index, prompt=prompt, label=label, metadata=metadata,
                                generate_function_path=fixture)
                got = await generate_and_rm(state, sample, sampling_params=params, evaluation=True)
                samples = got if isinstance(got, list) else [got]
                out.append({
                    "fixture": fixture, "reward": reward, "miles_commit": miles_commit, "prompt": prompt,
                    "label": label, "max_new_tokens": max_new_tokens,
                    **({"metadata": row_metadata[0]} if row_metadata else {}),
                    **({"miles_args": extra[0]} if extra else {}),
                    "samples": [{"response": s.response, "status": s.status.value, "reward_value": s.reward,
                                 "weight_versions": list(s.weight_versions)} for s in samples],
                })
        finally:
            if session is not None:
                session[0].should_exit = True
                session[1].join()
    return out


def _on_fleet(cases: list[tuple[Any, ...]], model: Path, rules: list[dict[str, str]], version: str,
              commit: str) -> list[dict[str, Any]]:
    """Record `cases` on one scripted CPU engine (`rules`, `version`) behind the real sglang-router."""
    from pinned_eval.fleet.cpu_engine import CpuEngineArgs, engine_spec
    from pinned_eval.fleet.keys import FleetKeys
    from pinned_eval.fleet.launcher import launch_fleet
    from tests.conftest import free_port

    with tempfile.TemporaryDirectory() as tmp:
        rules_file = Path(tmp) / "rules.json"
        rules_file.write_text(json.dumps(rules))
        keys = FleetKeys.resolve()
        spec = engine_spec(
            CpuEngineArgs(model_path=str(model), port=free_port(), weight_version=version, api_key=keys.api,
                          admin_api_key=keys.admin, scripted_completions=str(rules_file), tool_call_parser="qwen25"),
            env={"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"},
        )
        fleet = launch_fleet([spec], log_dir=Path(tmp) / "logs", keys=keys, ready_timeout_s=120)
        try:
            assert fleet.router_url is not None
            return asyncio.run(_record(cases, model, fleet.router_url, fleet.engine_urls[0], keys.api, commit))
        finally:
            fleet.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--miles", required=True, help="a miles checkout (its root holds the `miles` package)")
    parser.add_argument("--commit", help="the checkout's commit (default: git rev-parse HEAD there)")
    ns = parser.parse_args()
    miles = str(Path(ns.miles).resolve())
    commit = ns.commit or subprocess.run(["git", "-C", miles, "rev-parse", "HEAD"], capture_output=True,
                                         text=True, check=True).stdout.strip()
    roots = {r for r in ("ray", "sglang", *SGLANG_IMPORT_TIME) if importlib.util.find_spec(r) is None}
    if "sglang" in roots:
        raise SystemExit("the agent-function case needs sglang's protocol models: pip install --no-deps sglang")
    sglang_dir = Path(importlib.util.find_spec("sglang").submodule_search_locations[0])  # type: ignore[union-attr]
    roots |= {m for m in SGLANG_NEWER if not (sglang_dir.parent / f"{m.replace('.', '/')}.py").exists()}
    sys.meta_path.insert(0, _StubFinder(roots))
    sys.path[:0] = [miles, str(FIXTURES)]

    sys.path.insert(0, str(REPO))
    from engine.tiny_model import make_tiny_model
    from tests.e2e.test_agentic_point import RULES as POINT_RULES
    from tests.e2e.test_function_fleet import RULES

    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "m", arch="llama", seed=0, chat_template="chatml")
        retriever = _retriever()
        os.environ["RETRIEVER_URL"] = f"http://127.0.0.1:{retriever.server_port}/retrieve"
        try:
            for cases, rules, version in ((CASES, RULES, "5"), (PYTHON_TOOL_CASES, POINT_RULES, "3")):
                lines += _on_fleet(cases, model, rules, version, commit)
        finally:
            retriever.shutdown()
    if CALLED:
        raise SystemExit(f"a stub was called ({CALLED}): these goldens would not be miles' own results")
    for line in lines:
        print(json.dumps(line))


if __name__ == "__main__":
    main()
