"""pinned-eval's miles-compatible surface (`pinned_eval.agentic.compat`): what it serves, what it
refuses (by name), miles' `Sample` contract, the bounded `post`, agent request names. The finder is
only ever installed in a subprocess (as in the runner), never in the test process."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from pinned_eval.agentic.compat import SURFACE, surface_error
from pinned_eval.agentic.compat.agentic_tool_call import request_kwargs
from pinned_eval.agentic.compat.http_utils import RETRY_CAP, post, set_gateway_auth
from pinned_eval.agentic.compat.types import Sample

# miles' Sample fields (miles/utils/types.py at 31f1ca9) minus spec_info / prefix_cache_info
MILES_FIELDS = [
    "group_index", "index", "rollout_id", "prompt", "tokens", "multimodal_inputs", "multimodal_train_inputs",
    "response", "response_length", "label", "reward", "loss_mask", "weight_versions", "rollout_log_probs",
    "rollout_routed_experts", "rollout_indexer_topk", "remove_sample", "teacher_log_probs", "opd_reverse_kl",
    "status", "metadata", "generate_function_path", "train_metadata", "adapter", "reward_spec", "routing_key",
    "non_generation_time",
]


def _in_subprocess(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


def test_the_surface_is_served_and_anything_else_refused_by_name() -> None:
    out = _in_subprocess(
        "from pinned_eval.agentic import compat; assert compat.install()\n"
        "from miles.utils.types import Sample\n"
        "from miles.rollout.base_types import GenerateFnInput, GenerateFnOutput\n"
        "from miles.utils.http_utils import post\n"
        "from miles.utils.misc import load_function\n"
        "from miles.rollout.sglang_rollout import GenerateState\n"
        "from miles.rollout.generate_hub.single_turn import generate\n"
        "from miles.rollout.generate_hub.agentic_tool_call import generate as agentic\n"
        "from miles.rollout.rm_hub import async_rm, batched_async_rm\n"
        "from miles.rollout.generate_utils.generate_endpoint_utils import update_sample_from_response\n"
        "import pinned_eval.agentic.compat.types as t; assert Sample is t.Sample\n"
        "assert load_function('miles.rollout.generate_hub.single_turn.generate') is generate\n"
        "try:\n    import miles.rollout.generate_hub.tree_search\nexcept ImportError as e:\n    print(e.name, '|', e)\n"
    )
    name, message = out.split(" | ")
    assert name == "miles.rollout.generate_hub.tree_search"
    assert message == str(surface_error("miles.rollout.generate_hub.tree_search"))
    assert message.startswith("miles module 'miles.rollout.generate_hub.tree_search' is not in pinned-eval's")
    assert all(m in message for m, target in SURFACE.items() if target is not None)


def test_the_worker_process_never_gets_the_finder() -> None:
    assert "miles" not in sys.modules
    assert not any(type(f).__name__ == "MilesSurfaceFinder" for f in sys.meta_path)


def test_sample_has_miles_fields_status_and_meta_info_update() -> None:
    assert [f.name for f in dataclasses.fields(Sample)] == MILES_FIELDS
    assert [s.value for s in Sample.Status] == ["pending", "completed", "truncated", "aborted", "failed"]
    s = Sample(index=3, prompt="p")
    assert (s.status, s.response, s.reward, s.weight_versions) == (Sample.Status.PENDING, "", None, [])
    for finish, status in (("length", "TRUNCATED"), ("abort", "ABORTED"), ("stop", "COMPLETED")):
        s.update_from_meta_info(None, {"finish_reason": {"type": finish}, "weight_version": "5"})
        assert s.status is Sample.Status[status]
    assert s.weight_versions == ["5", "5", "5"] and s.oldest_weight_version == 5
    assert s.to_dict()["status"] == "completed"


def test_agent_request_kwargs_use_chat_completion_names() -> None:
    params = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 8, "sampling_seed": 7,
              "no_stop_trim": True, "stop": None}
    assert request_kwargs(params) == {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "max_tokens": 8, "seed": 7}


@pytest.fixture
def server() -> Iterator[tuple[str, list[tuple[str, str | None]]]]:
    seen: list[tuple[str, str | None]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["content-length"]))
            seen.append((self.path, self.headers.get("authorization")))
            code = {"/bad": 400, "/down": 503}.get(self.path, 200)
            body = json.dumps({"ok": self.path}).encode()
            self.send_response(code)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a: object) -> None:
            return

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_port}", seen
    srv.shutdown()


async def test_post_is_bounded_and_adds_the_token_only_to_the_gateway(
    server: tuple[str, list[tuple[str, str | None]]],
) -> None:
    base, seen = server
    set_gateway_auth(base, "tok")
    try:
        assert await post(f"{base}/ok", {"a": 1}) == {"ok": "/ok"}
        with pytest.raises(httpx.HTTPStatusError, match="400"):
            await post(f"{base}/bad", {})  # a 4xx is not retried (miles: 60 tries, ~60 s)
        with pytest.raises(httpx.HTTPStatusError, match="503"):
            await post(f"{base}/down", {})  # a 5xx: RETRY_CAP tries
        set_gateway_auth("http://127.0.0.1:1", "tok")
        await post(f"{base}/ok", {})  # not the gateway: no token
    finally:
        set_gateway_auth("http://127.0.0.1:1", "")
    assert seen == [("/ok", "Bearer tok"), ("/bad", "Bearer tok")] + [("/down", "Bearer tok")] * RETRY_CAP + [
        ("/ok", None)]


def test_generate_state_loads_the_tokenizer_on_first_use(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A function that never reads `state.tokenizer` does not import transformers (seconds in a
    fresh runner); the first read loads the pinned snapshot's tokenizer; no checkpoint -> None."""
    from engine.tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path / "model", chat_template="chatml")
    out = _in_subprocess(
        "import sys, types\n"
        "from pinned_eval.agentic import compat; assert compat.install()\n"
        "from miles.rollout.sglang_rollout import GenerateState\n"
        f"state = GenerateState(types.SimpleNamespace(hf_checkpoint={str(model)!r}, sglang_server_concurrency=2))\n"
        "before = 'transformers' in sys.modules\n"
        "ids = state.tokenizer.encode('hello', add_special_tokens=False)\n"
        "print(before, 'transformers' in sys.modules, GenerateState() is state, state.tokenizer is state.tokenizer, "
        "len(ids) > 0)\n"
        "GenerateState._instance = None\n"
        "print(GenerateState(types.SimpleNamespace()).tokenizer)\n"
    )
    assert out.splitlines() == ["False True True True True", "None"]
