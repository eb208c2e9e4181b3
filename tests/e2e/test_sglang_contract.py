"""Schema-drift check: every `/generate` body the fleet client sends decodes under SGLang's own schema.

The schema is `sglang/api/v1/api_types.py` from the real `sglang==0.5.23` wheel (downloaded at test
time with `pip download --no-deps`, once per session; nothing vendored), loaded standalone (it needs
only msgspec). `GenerateRequest.from_json_value` is the gate the SGLang server applies (§1.3 of the
protocol reference), so a body that passes here passes there. The bodies are captured on the wire by
a recording transport while the client drives a real CPU engine behind the real sglang-router:
pin (router readiness probe), text and token-id prompts, every sampling key, and an aborted request's
retry. The responses the client parsed are decoded with SGLang's response types too. The LoRA calls
(`/load_lora_adapter`, `/unload_lora_adapter`, `/v1/models`, `lora_path` on `/generate`) are checked
against the wheel's own `io_struct.py` / `openai/protocol.py` classes (fields read with `ast`: those
modules need the full SGLang runtime to import) and the routes `http_server.py` declares.
"""

from __future__ import annotations

import ast
import asyncio
import importlib.util
import json
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest

from pinned_eval.fleet import FleetClient, FleetConfig, LaunchedFleet, SamplingParams, launch_cpu_fleet

pytestmark = pytest.mark.e2e

SGLANG_VERSION = "0.5.23"
API_TYPES = "sglang/api/v1/api_types.py"
IO_STRUCT = "sglang/srt/managers/io_struct.py"
HTTP_SERVER = "sglang/srt/entrypoints/http_server.py"
OPENAI_PROTOCOL = "sglang/srt/entrypoints/openai/protocol.py"
LORA_PATHS = ("/load_lora_adapter", "/unload_lora_adapter", "/v1/models")


@pytest.fixture(scope="session")
def sglang_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real `sglang==0.5.23` wheel (pip download, once per session)."""
    dest = tmp_path_factory.mktemp("sglang-wheel")
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "-q",
        "-d",
        str(dest),
        f"sglang=={SGLANG_VERSION}",
    ]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        pytest.skip(f"cannot download sglang=={SGLANG_VERSION}: pip timed out")
    wheels = sorted(dest.glob("sglang-*.whl"))
    if done.returncode != 0 or not wheels:
        pytest.skip(f"cannot download sglang=={SGLANG_VERSION} (no index reachable?): {done.stderr[-800:]}")
    return wheels[0]


@pytest.fixture(scope="session")
def api_types(sglang_wheel: Path) -> ModuleType:
    """SGLang's generated API types, from the wheel, loaded standalone."""
    pytest.importorskip("msgspec", reason="msgspec (dev extra) loads SGLang's api_types")
    with zipfile.ZipFile(sglang_wheel) as whl:
        source = whl.read(API_TYPES)  # KeyError = the schema moved: a real failure, not a skip
    path = sglang_wheel.parent / "sglang_api_types.py"
    path.write_bytes(source)
    spec = importlib.util.spec_from_file_location("sglang_api_types_v1", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # msgspec resolves the string annotations through the module
    spec.loader.exec_module(module)
    return module


class RecordingTransport(httpx.AsyncBaseTransport):
    """A real HTTP transport that keeps every `/generate` request body and response body it carries."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.generate: list[tuple[dict[str, Any], int, Any]] = []
        self.model_info: list[Any] = []
        self.lora: list[tuple[str, Any, int, Any]] = []  # (path, request body, status, response body)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = await request.aread()
        response = await self.inner.handle_async_request(request)
        if request.url.path in LORA_PATHS:
            content = await response.aread()
            self.lora.append((request.url.path, json.loads(body) if body else None, response.status_code,
                              json.loads(content) if content else None))
        if request.url.path in ("/generate", "/model_info"):
            content = await response.aread()
            parsed = json.loads(content) if content else None
            if request.url.path == "/generate":
                self.generate.append((json.loads(body), response.status_code, parsed))
            else:
                self.model_info.append(parsed)
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()


@pytest.fixture(scope="module")
def fleet(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LaunchedFleet]:
    launched = launch_cpu_fleet(tiny_model_dir, 1, log_dir=tmp_path_factory.mktemp("contract-logs"))
    try:
        yield launched
    finally:
        launched.stop()


EVERY_KEY = SamplingParams(
    max_new_tokens=3,
    temperature=0.7,
    top_p=0.9,
    top_k=20,
    min_p=0.01,
    stop=["\n", "="],
    stop_token_ids=[2],
    frequency_penalty=0.1,
    presence_penalty=0.1,
    repetition_penalty=1.1,
    min_new_tokens=1,
    ignore_eos=False,
    skip_special_tokens=True,
    no_stop_trim=False,
    sampling_seed=1234,
)


async def _abort_when_running(fleet: LaunchedFleet, rid: str) -> None:
    """Abort `rid` on the engine as soon as the engine reports a running request."""
    engine, keys = fleet.engine_urls[0], fleet.keys
    assert keys is not None
    async with httpx.AsyncClient() as http:
        for _ in range(500):
            load = (await http.get(f"{engine}/get_load", headers={"Authorization": f"Bearer {keys.api}"})).json()[0]
            if load["num_reqs"]:
                admin = {"Authorization": f"Bearer {keys.admin}"}
                (await http.post(f"{engine}/abort_request", json={"rid": rid}, headers=admin)).raise_for_status()
                return
            await asyncio.sleep(0.01)
    raise AssertionError("the request never showed up as running")


async def test_every_generate_body_decodes_under_sglang_schema(
    api_types: ModuleType, fleet: LaunchedFleet, snapshot_dir: Path
) -> None:
    transport = RecordingTransport()
    config = fleet.client_config(FleetConfig(router_ready_timeout_s=60, worker_timeout_s=60))
    async with FleetClient(fleet.engine_urls, fleet.router_url, config=config, transport=transport) as client:
        await client.pin(snapshot_dir, "11")
        await client.generate("What is 2 plus 2?", sampling_params=EVERY_KEY, rid="contract-text")
        await client.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2, "temperature": 0.0})
        await client.generate("1+1=")
        long = SamplingParams(max_new_tokens=400, temperature=0.0, ignore_eos=True)
        gen = asyncio.create_task(client.generate("count", sampling_params=long, rid="contract-abort"))
        await _abort_when_running(fleet, "contract-abort")
        retried = await gen
    assert retried.attempts == 2  # the abort came back as HTTP 200 and was sent again
    sent = [body for body, _, _ in transport.generate]
    assert [b.get("rid") for b in sent][-2:] == ["contract-abort", "contract-abort.retry1"]
    assert any("text" in b for b in sent) and any("input_ids" in b for b in sent)
    assert any(b.get("sampling_params") == EVERY_KEY.to_wire() for b in sent)
    for body in sent:
        request = api_types.GenerateRequest.from_json_value(body)  # raises JsonContractError on drift
        assert request.sampling_params is not None
    for _, status, response in transport.generate:
        assert status == 200
        decoded = api_types.GenerateResponse.from_json_value(response)
        assert decoded.meta_info.weight_version == "11"
        assert decoded.meta_info.finish_reason is not None
    for info in transport.model_info:
        assert api_types.GetModelInfoResponse.from_json_value(info).weight_version == "11"


def test_schema_check_bites_on_names_sglang_rejects(api_types: ModuleType) -> None:
    """The gate is not vacuous: OpenAI names and text batches' shape errors are refused."""
    for bad in ({"seed": 7}, {"max_tokens": 7}, {"max_new_tokens": "many"}):
        with pytest.raises(api_types.JsonContractError):
            api_types.GenerateRequest.from_json_value({"text": "x", "sampling_params": bad})


def test_client_sampling_keys_are_a_subset_of_sglang_keys(api_types: ModuleType) -> None:
    import msgspec

    sglang_keys = {f.name for f in msgspec.structs.fields(api_types.SamplingParams)}
    ours = set(SamplingParams.model_fields)
    assert ours <= sglang_keys, f"not SGLang sampling keys: {sorted(ours - sglang_keys)}"


@pytest.fixture(scope="module")
def snapshot_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine.tiny_model import perturb_snapshot

    return perturb_snapshot(tiny_model_dir, tmp_path_factory.mktemp("contract-snap") / "step_11", seed=11)


def _fields(source: bytes, cls: str) -> dict[str, bool]:
    """Field name -> required, of class `cls` in a Python source (annotated class attributes)."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return {
                s.target.id: s.value is None
                for s in node.body
                if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
            }
    raise AssertionError(f"{cls} not found: SGLang's schema moved")


def _conforms(obj: dict[str, Any], fields: dict[str, bool], what: str) -> None:
    assert set(obj) <= set(fields), f"{what}: not SGLang fields: {sorted(set(obj) - set(fields))}"
    missing = [f for f, required in fields.items() if required and f not in obj]
    assert not missing, f"{what}: required SGLang fields missing: {missing}"


async def test_lora_requests_and_replies_match_sglang(
    sglang_wheel: Path, api_types: ModuleType, fleet: LaunchedFleet, tiny_model_dir: Path, tmp_path: Path
) -> None:
    from engine.tiny_model import make_tiny_adapter
    from pinned_eval.snapshot.lora import write_adapter_snapshot

    with zipfile.ZipFile(sglang_wheel) as whl:
        io_struct, server, protocol = whl.read(IO_STRUCT), whl.read(HTTP_SERVER).decode(), whl.read(OPENAI_PROTOCOL)
    for route in ("/load_lora_adapter", "/unload_lora_adapter"):
        assert f'@app.api_route("{route}", methods=["POST"])' in server
    load_in = _fields(io_struct, "LoadLoRAAdapterReqInput")
    unload_in = _fields(io_struct, "UnloadLoRAAdapterReqInput")
    update_out = _fields(io_struct, "LoRAUpdateOutput")
    card = _fields(protocol, "ModelCard")

    adapters = {v: make_tiny_adapter(tiny_model_dir, tmp_path / f"a{v}", seed=v) for v in (21, 22)}
    snaps = [write_adapter_snapshot(a, str(tmp_path / f"step_{v}")) for v, a in adapters.items()]
    transport = RecordingTransport()
    config = fleet.client_config(FleetConfig(router_ready_timeout_s=60, worker_timeout_s=60))
    async with FleetClient(fleet.engine_urls, fleet.router_url, config=config, transport=transport) as client:
        await client.pin(snaps[0], "21", lora_base=tiny_model_dir)
        await client.pin(snaps[1], "22", lora_base=tiny_model_dir)  # unloads 21 first
        out = await client.generate("1+1=", sampling_params={"max_new_tokens": 2, "temperature": 0.0}, lora_path="22")
        refused = await client.engines.load_lora(fleet.engine_urls[0], "x", str(tmp_path / "nowhere"))
    assert out.weight_version == "22"
    assert not refused.ok and refused.status_code == 400 and "nowhere" in refused.message

    calls = {path: [c for c in transport.lora if c[0] == path] for path in LORA_PATHS}
    assert [b["lora_name"] for _, b, _, _ in calls["/load_lora_adapter"]] == ["21", "22", "x"]
    assert [b["lora_name"] for _, b, _, _ in calls["/unload_lora_adapter"]] == ["21"]
    for path, body, status, reply in calls["/load_lora_adapter"] + calls["/unload_lora_adapter"]:
        _conforms(body, load_in if path == "/load_lora_adapter" else unload_in, f"{path} request")
        _conforms(reply, update_out, f"{path} reply")
        assert reply["success"] is (status == 200)
    for _, _, _, models in calls["/v1/models"]:
        for c in models["data"][1:]:
            _conforms(c, card, "/v1/models adapter card")
            assert c["parent"] is not None
        api_types.ModelCard.from_json_value(models["data"][0])
    lora_generates = [b for b, _, _ in transport.generate if "lora_path" in b]
    assert len(lora_generates) == 1
    decoded = api_types.GenerateRequest.from_json_value(lora_generates[0])
    assert decoded.lora_path == "22"
