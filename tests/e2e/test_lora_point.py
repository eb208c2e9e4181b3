"""LoRA eval points end to end: real Prefect server, CPU engines behind the real sglang-router,
recording proxies in front of the engines (what each engine really received, after the router)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from blocks import FleetBlock, StagingBlock
from engine.tiny_model import make_tiny_adapter, make_tiny_model
from flows.eval_point import eval_point
from pinned_eval.sinks import JsonlSink
from pinned_eval.snapshot.lora import write_adapter_snapshot
from tests.faults import LoraLoadLiar, RecordingProxy
from tests.pointkit import CpuFleet, PointEnv, save_point_blocks

pytestmark = pytest.mark.e2e

PROMPTS_PER_POINT = 12  # SMALL_SUITE: 2 datasets x 6 prompts x 1 sample


@pytest.fixture
def proxies(cpu_fleet: CpuFleet) -> Iterator[list[RecordingProxy]]:
    recorders = [RecordingProxy(u) for u in cpu_fleet.engine_urls]
    try:
        yield recorders
    finally:
        for p in recorders:
            p.close()
        with httpx.Client(timeout=60, headers=cpu_fleet.headers()) as http:  # leave the engines adapter-free
            for url in cpu_fleet.engine_urls:
                for card in http.get(f"{url}/v1/models").json()["data"][1:]:
                    http.post(f"{url}/unload_lora_adapter", json={"lora_name": card["id"]},
                              headers=cpu_fleet.headers(admin=True)).raise_for_status()


def _env(tmp_path: Path, cpu_fleet: CpuFleet, proxies: list[RecordingProxy], mode: str, keep: int = 1) -> PointEnv:
    fleet = FleetBlock(
        name=f"lora-{mode}", mode="attach", engine_urls=[p.url for p in proxies], router_url=cpu_fleet.router_url,
        lora_mode=mode, **cpu_fleet.block_keys(),
    )
    return save_point_blocks(tmp_path, fleet, keep_snapshots=keep)


def _run(env: PointEnv, step: int, source: dict[str, str]):
    return eval_point(**env.params(step, source=source), return_state=True)


def _staging_path(env: PointEnv, step: int) -> str:
    return StagingBlock.load(env.blocks["staging"]).staging().path_for(env.run, step)


def test_adapter_mode_points_measure_exactly_their_adapter(
    prefect_server: str, cpu_fleet: CpuFleet, proxies: list[RecordingProxy], tiny_model: Path, tmp_path: Path
) -> None:
    env = _env(tmp_path, cpu_fleet, proxies, "adapter")
    first = make_tiny_adapter(tiny_model, tmp_path / "trainer" / "adapter-3", seed=3, scale=2.0)
    # step 3: the trainer hands over its adapter dir; step 4: it staged the adapter snapshot itself
    s3 = _run(env, 3, {"kind": "lora", "path": str(first), "hf_base": str(tiny_model)})
    staged4 = _staging_path(env, 4)
    second = make_tiny_adapter(tiny_model, tmp_path / "trainer" / "adapter-4", seed=4, scale=2.0)
    write_adapter_snapshot(second, staged4)
    s4 = _run(env, 4, {"kind": "lora", "path": staged4, "hf_base": str(tiny_model)})
    assert s3.is_completed() and s3.name == "Completed", s3.message
    assert s4.is_completed() and s4.name == "Completed", s4.message

    rows = JsonlSink(env.jsonl).read(env.run)
    assert sorted({(r.step, r.weight_version) for r in rows}) == [(3, "3"), (4, "4")]
    for r in rows:
        assert r.metrics[f"eval/{r.dataset}/weight_version/mixed_version_ratio"] == 0

    # what the engines received (after the router): every /generate named the point's adapter
    generates = [b for p in proxies for b in p.bodies("/generate")]
    measured = [b for b in generates if str(b.get("rid")).startswith(f"{env.run}-")]
    assert len(measured) == 2 * PROMPTS_PER_POINT
    assert sorted(b["lora_path"] for b in measured) == ["3"] * PROMPTS_PER_POINT + ["4"] * PROMPTS_PER_POINT
    probes = [b for b in generates if b not in measured]  # the router readiness probe after each pin
    assert all(b["sampling_params"]["max_new_tokens"] == 1 for b in probes)
    for proxy in proxies:  # each engine: load 3; then unload 3 before loading 4
        lora_calls = [(p, b) for _, p, b in proxy.requests if p in ("/load_lora_adapter", "/unload_lora_adapter")]
        assert [(p, b["lora_name"]) for p, b in lora_calls] == [
            ("/load_lora_adapter", "3"), ("/unload_lora_adapter", "3"), ("/load_lora_adapter", "4")
        ]
        assert lora_calls[2][1]["lora_path"] == staged4
        assert not proxy.bodies("/update_weights_from_disk") or all(
            b["model_path"] == str(tiny_model) for b in proxy.bodies("/update_weights_from_disk")
        )  # the fleet keeps the base: only the base is ever loaded in full
    with httpx.Client(timeout=60, headers=cpu_fleet.headers()) as http:
        for url in cpu_fleet.engine_urls:
            cards = http.get(f"{url}/v1/models").json()["data"]
            assert [(c["id"], c["root"]) for c in cards[1:]] == [("4", staged4)]
            assert http.get(f"{url}/model_info").json()["weight_version"] == "4"
        # the adapter changes generations (so the checks above measure something)
        body = {"text": "What is 3 plus 4?", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
        engine = cpu_fleet.engine_urls[0]
        with_adapter = http.post(f"{engine}/generate", json={**body, "lora_path": "4"}).json()
        base = http.post(f"{engine}/generate", json=body).json()
        assert with_adapter["output_ids"] != base["output_ids"]
        unknown = http.post(f"{engine}/generate", json={**body, "lora_path": "3"})  # unloaded by point 4
        assert unknown.status_code == 400 and "lora_path" in unknown.json()["error"]

    # retired like any snapshot: keep-ring of 1 -> step 3's adapter deleted, step 4's kept and marked
    assert not Path(_staging_path(env, 3)).exists()
    assert (Path(staged4) / ".retired").exists()


def test_bad_adapters_are_typed_skips_naming_the_file(
    prefect_server: str, cpu_fleet: CpuFleet, proxies: list[RecordingProxy], tiny_model: Path, tmp_path: Path
) -> None:
    env = _env(tmp_path, cpu_fleet, proxies, "adapter", keep=0)
    good = make_tiny_adapter(tiny_model, tmp_path / "good", seed=1)
    # truncated weights, staged by the trainer: the completeness check catches it
    truncated = _staging_path(env, 1)
    write_adapter_snapshot(good, truncated)
    weights = Path(truncated) / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64])
    s1 = _run(env, 1, {"kind": "lora", "path": truncated, "hf_base": str(tiny_model)})
    assert s1.name == "Skipped" and s1.message.startswith("ckpt_missing"), s1.message
    assert "adapter_model.safetensors" in s1.message
    # weights missing from the trainer's adapter dir
    missing = tmp_path / "missing"
    missing.mkdir()
    (missing / "adapter_config.json").write_bytes((good / "adapter_config.json").read_bytes())
    s2 = _run(env, 2, {"kind": "lora", "path": str(missing), "hf_base": str(tiny_model)})
    assert s2.name == "Skipped" and s2.message.startswith("ckpt_missing"), s2.message
    assert "adapter_model.safetensors is missing" in s2.message
    # complete, but made for another base (hidden 32, not 64): every engine refuses it at load
    narrow = make_tiny_model(tmp_path / "narrow", hidden_size=32)
    s3 = _run(env, 3, {"kind": "lora", "path": str(make_tiny_adapter(narrow, tmp_path / "wrong", seed=2)),
                       "hf_base": str(tiny_model)})
    assert s3.name == "Skipped" and s3.message.startswith("pin_violation"), s3.message
    assert "adapter_model.safetensors: model.layers." in s3.message
    assert not any(str(b.get("rid")).startswith(f"{env.run}-") for p in proxies for b in p.bodies("/generate"))
    for step in (1, 2, 3):  # retired: keep_snapshots=0 deletes every owned snapshot
        assert not Path(_staging_path(env, step)).exists()
    rows = JsonlSink(env.jsonl).read(env.run)
    assert sorted((r.step, r.state) for r in rows) == [(1, "skipped"), (2, "skipped"), (3, "skipped")]


def test_merged_mode_point_pins_a_full_merged_snapshot(
    prefect_server: str, cpu_fleet: CpuFleet, proxies: list[RecordingProxy], tiny_model: Path, tmp_path: Path
) -> None:
    env = _env(tmp_path, cpu_fleet, proxies, "merged")
    adapter = make_tiny_adapter(tiny_model, tmp_path / "adapter", seed=5, scale=2.0)
    state = _run(env, 5, {"kind": "lora", "path": str(adapter), "hf_base": str(tiny_model)})
    assert state.is_completed() and state.name == "Completed", state.message
    staged = _staging_path(env, 5)
    for proxy in proxies:
        assert [b["model_path"] for b in proxy.bodies("/update_weights_from_disk")] == [staged]
        assert not proxy.bodies("/load_lora_adapter")
    generates = [b for p in proxies for b in p.bodies("/generate") if str(b.get("rid")).startswith(f"{env.run}-")]
    assert len(generates) == PROMPTS_PER_POINT and not any(b.get("lora_path") for b in generates)
    assert (Path(staged) / "model.safetensors.index.json").exists()
    assert not (Path(staged) / "adapter_config.json").exists()
    assert {r.weight_version for r in JsonlSink(env.jsonl).read(env.run)} == {"5"}


def test_an_engine_that_claims_a_load_it_did_not_do_is_a_pin_violation(
    prefect_server: str, cpu_fleet: CpuFleet, proxies: list[RecordingProxy], tiny_model: Path, tmp_path: Path
) -> None:
    liar = LoraLoadLiar(cpu_fleet.engine_urls[0])
    try:
        fleet = FleetBlock(name="lora-liar", mode="attach", engine_urls=[liar.url, proxies[1].url],
                           router_url=cpu_fleet.router_url, **cpu_fleet.block_keys())
        env = save_point_blocks(tmp_path, fleet, keep_snapshots=0)
        adapter = make_tiny_adapter(tiny_model, tmp_path / "adapter", seed=6)
        state = _run(env, 6, {"kind": "lora", "path": str(adapter), "hf_base": str(tiny_model)})
    finally:
        liar.close()
    assert state.name == "Skipped" and state.message.startswith("pin_violation"), state.message
    assert f"{liar.url}: loaded adapters {{}}, expected only '6'" in state.message
    assert len(liar.bodies("/load_lora_adapter")) == 2  # two attempts, then the skip
    assert not any(str(b.get("rid")).startswith(f"{env.run}-") for p in (liar, *proxies) for b in p.bodies("/generate"))
