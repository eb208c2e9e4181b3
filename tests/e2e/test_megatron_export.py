"""Megatron-core → HF export, proven by logits: the transformers model loaded from the exported
snapshot must reproduce the Megatron model's logits (max |Δ| ≤ 1e-5, fp32) for Llama, Qwen2 and
Qwen3, from a live model at TP=2 and TP=1 (DP=2) and offline from a torch_dist checkpoint.

One spawned 2-rank gloo job builds every model, records its logits, runs the collective live
export and saves the torch_dist checkpoints; the tests then load and compare in this process.
The job runs under a hard deadline (dist_checkpointing can hang without psutil) and its
processes are killed by PID if it overruns.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[megatron]')")
pytest.importorskip("psutil", reason="psutil is required by megatron dist_checkpointing save")

from tests.conftest import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

JOB_DEADLINE_S = 180
TOL = 1e-5
FAMILIES = ("llama", "qwen2", "qwen3")
TPS = (2, 1)


def _ids() -> torch.Tensor:
    return torch.randint(0, 150, (2, 12), generator=torch.Generator().manual_seed(7))


def _job(rank: int, world: int, port: int, root: str) -> None:
    from pinned_eval.snapshot.megatron import export_live_model
    from tests import megatron_helpers as mh

    out = Path(root)
    mh.init_process_group(rank, world, port)
    results = {}
    try:
        for tp in TPS:
            mh.init_parallel(tp)
            for fam in FAMILIES:
                model = mh.build_model(mh.SPECS[fam], tp)
                logits = mh.forward(model, _ids())
                if rank == 0:
                    torch.save(logits, out / f"logits-{fam}-tp{tp}.pt")
                res = export_live_model(model, str(out / f"base-{fam}"), str(out / f"live-{fam}-tp{tp}"))
                results[f"{fam}-tp{tp}"] = asdict(res)
                if tp == 2:  # the two-phase form: staged into rank 0's host buffer, written after
                    from pinned_eval.snapshot.host_staging import HostStaging
                    from pinned_eval.snapshot.megatron import stage_live_model

                    pool = HostStaging(pinned=False) if rank == 0 else None
                    staged = stage_live_model(model, str(out / f"base-{fam}"), pool=pool)
                    if rank == 0:
                        staged.write(str(out / f"staged-{fam}-tp2"))
                        staged.discard()
                    results[f"{fam}-staged"] = {"ok": staged.ok, "rank": staged.rank}
                    t0 = time.perf_counter()
                    mh.save_torch_dist(model, out / f"ckpt-{fam}")
                    results[f"{fam}-save"] = {"seconds": time.perf_counter() - t0}
                    model.bfloat16()  # in place: parameters keep their TP attributes
                    res = export_live_model(model, str(out / f"base-{fam}"), str(out / f"live-{fam}-bf16"))
                    results[f"{fam}-bf16"] = asdict(res)
        (out / f"results-{rank}.json").write_text(json.dumps(results))
    finally:
        torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def mcore_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch.multiprocessing as mp

    from tests import megatron_helpers as mh

    root = tmp_path_factory.mktemp("mcore")
    for fam in FAMILIES:
        mh.write_hf_base(mh.SPECS[fam], root / f"base-{fam}")
    args = (2, free_port(), str(root))
    ctx = mp.start_processes(_job, args=args, nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + JOB_DEADLINE_S
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail(f"spawned megatron job did not finish within {JOB_DEADLINE_S} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)
    return root


def _hf_logits(snapshot: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(snapshot), dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(input_ids=_ids()).logits


def _assert_same_logits(snapshot: Path, logits_file: Path) -> None:
    assert (snapshot / ".complete").is_file()
    ref = torch.load(logits_file)[..., :150]  # Megatron's vocab is padded to 160
    got = _hf_logits(snapshot)
    assert got.shape == ref.shape
    diff = (got - ref).abs().max().item()
    assert diff <= TOL, f"max |Δlogits| = {diff:.3g}"


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("family", FAMILIES)
def test_live_export_matches_megatron_logits(mcore_run: Path, family: str, tp: int) -> None:
    _assert_same_logits(mcore_run / f"live-{family}-tp{tp}", mcore_run / f"logits-{family}-tp{tp}.pt")
    results = [json.loads((mcore_run / f"results-{r}.json").read_text())[f"{family}-tp{tp}"] for r in (0, 1)]
    assert all(r["ok"] for r in results)
    assert results[0]["path"] == results[1]["path"] == str(mcore_run / f"live-{family}-tp{tp}")
    assert results[1]["bytes"] == results[0]["bytes"] > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_staged_live_export_equals_the_synchronous_one(mcore_run: Path, family: str) -> None:
    from safetensors.torch import load_file

    def tensors(snap: Path) -> dict[str, torch.Tensor]:
        return {k: v for f in sorted(snap.glob("*.safetensors")) for k, v in load_file(str(f)).items()}

    staged, live = tensors(mcore_run / f"staged-{family}-tp2"), tensors(mcore_run / f"live-{family}-tp2")
    assert staged.keys() == live.keys() and all(torch.equal(staged[k], live[k]) for k in live)
    assert (mcore_run / f"staged-{family}-tp2" / ".complete").is_file()
    results = [json.loads((mcore_run / f"results-{r}.json").read_text())[f"{family}-staged"] for r in (0, 1)]
    assert results == [{"ok": True, "rank": 0}, {"ok": True, "rank": 1}]


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_model_exports_bf16_snapshot_bit_exact(mcore_run: Path, family: str) -> None:
    from safetensors.torch import load_file

    def tensors(snap: Path) -> dict[str, torch.Tensor]:
        shards = set(json.loads((snap / "model.safetensors.index.json").read_text())["weight_map"].values())
        return {k: v for s in shards for k, v in load_file(snap / s).items()}

    bf16, fp32 = tensors(mcore_run / f"live-{family}-bf16"), tensors(mcore_run / f"live-{family}-tp2")
    assert bf16.keys() == fp32.keys()
    for name, t in bf16.items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, fp32[name].to(torch.bfloat16)), name
    config = json.loads((mcore_run / f"live-{family}-bf16" / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16"


def test_qwen2_tied_snapshot_has_no_lm_head(mcore_run: Path) -> None:
    index = json.loads((mcore_run / "live-qwen2-tp2" / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" not in index["weight_map"]
    assert "model.layers.1.self_attn.k_proj.bias" in index["weight_map"]


@pytest.mark.parametrize("family", FAMILIES)
def test_offline_torch_dist_export_matches(mcore_run: Path, tmp_path: Path, family: str) -> None:
    from pinned_eval.snapshot.megatron import export_megatron_checkpoint

    res = export_megatron_checkpoint(mcore_run / f"ckpt-{family}", str(mcore_run / f"base-{family}"),
                                     str(tmp_path / "hf"), max_shard_bytes=64 << 10)
    assert res.shards > 1  # small shards: the stream crosses shard boundaries
    _assert_same_logits(tmp_path / "hf", mcore_run / f"logits-{family}-tp2.pt")


def test_offline_export_reads_megatron_lm_save_root(mcore_run: Path, tmp_path: Path) -> None:
    """A Megatron-LM save root resolves to its latest iteration directory."""
    from pinned_eval.snapshot.megatron import export_megatron_checkpoint

    root = tmp_path / "save"
    root.mkdir()
    # a copy, not a symlink: the reader refuses entries that resolve outside the checkpoint
    shutil.copytree(mcore_run / "ckpt-qwen3", root / "iter_0000020")
    (root / "latest_checkpointed_iteration.txt").write_text("20\n")
    export_megatron_checkpoint(root, str(mcore_run / "base-qwen3"), str(tmp_path / "hf"))
    _assert_same_logits(tmp_path / "hf", mcore_run / "logits-qwen3-tp2.pt")


def test_offline_export_rejects_wrong_family_before_writing(mcore_run: Path, tmp_path: Path) -> None:
    from pinned_eval.snapshot.megatron import export_megatron_checkpoint

    with pytest.raises(ValueError, match="q_norm"):  # a Qwen3 HF config expects q/k norms
        export_megatron_checkpoint(mcore_run / "ckpt-llama", str(mcore_run / "base-llama"),
                                   str(tmp_path / "hf"), family="qwen3")
    assert not (tmp_path / "hf").exists()


# ---- edges of the converter and the checkpoint reader (no process group) ----


def _base_variant(mcore_run: Path, family: str, dest: Path, **changes: object) -> Path:
    dest.mkdir()
    cfg = json.loads((mcore_run / f"base-{family}" / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**cfg, **changes}))
    return dest


def test_tied_megatron_to_untied_hf_writes_lm_head_copy(mcore_run: Path, tmp_path: Path) -> None:
    from pinned_eval.snapshot.megatron import export_megatron_checkpoint

    base = _base_variant(mcore_run, "qwen2", tmp_path / "base", tie_word_embeddings=False)
    export_megatron_checkpoint(mcore_run / "ckpt-qwen2", str(base), str(tmp_path / "hf"))
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" in index["weight_map"]
    _assert_same_logits(tmp_path / "hf", mcore_run / "logits-qwen2-tp2.pt")


def test_untied_megatron_to_tied_hf_is_refused(mcore_run: Path, tmp_path: Path) -> None:
    from pinned_eval.snapshot.megatron import export_megatron_checkpoint

    base = _base_variant(mcore_run, "llama", tmp_path / "base", tie_word_embeddings=True)
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        export_megatron_checkpoint(mcore_run / "ckpt-llama", str(base), str(tmp_path / "hf"))
    assert not (tmp_path / "hf").exists()


def test_reader_unstacks_chunks_spanning_all_layers_and_skips_non_model_keys(
    mcore_run: Path, tmp_path: Path
) -> None:
    """A torch_dist directory whose stacked keys are stored as one chunk (not one per layer), with
    optimizer state next to the model, converts to the same model."""
    import torch.distributed.checkpoint as dcp

    from pinned_eval.snapshot.mcore_checkpoint import TorchDistReader
    from pinned_eval.snapshot.megatron import export_megatron_checkpoint

    src = TorchDistReader(mcore_run / "ckpt-qwen3")
    state = {k: src.read(k) for k in src.keys}
    state["optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight"] = torch.zeros(3)
    dcp.save(state, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    reread = TorchDistReader(tmp_path / "ckpt")
    assert reread.keys.keys() == src.keys.keys() and reread.num_layers == 2
    assert all(reread.spans_layers(k) for k in reread.stacked)
    export_megatron_checkpoint(tmp_path / "ckpt", str(mcore_run / "base-qwen3"), str(tmp_path / "hf"))
    _assert_same_logits(tmp_path / "hf", mcore_run / "logits-qwen3-tp2.pt")


@pytest.mark.parametrize(
    ("change", "field"),
    [({"hidden_size": None}, "hidden_size"), ({"model_type": "gpt2"}, "model_type"),
     ({"num_key_value_heads": 3}, "num_key_value_heads"), ({"mlp_bias": True}, "mlp_bias")],
)
def test_hf_config_errors_name_the_field(change: dict, field: str) -> None:
    from pinned_eval.snapshot.mcore_names import DenseLayout

    cfg = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 150, **change}
    with pytest.raises(ValueError, match=field):
        DenseLayout.from_hf_config(cfg)


def test_unmapped_megatron_tensor_is_an_error() -> None:
    from pinned_eval.snapshot.mcore_names import DenseLayout, MegatronToHf, UnmappedTensor

    layout = DenseLayout.from_hf_config({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                                         "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 150})
    conv = MegatronToHf(layout, source_tied=False)
    with pytest.raises(UnmappedTensor, match=r"linear_fc1\.layer_norm_bias"):
        conv.convert("module.module.decoder.layers.0.mlp.linear_fc1.layer_norm_bias", torch.zeros(64))
    assert conv.convert("decoder.layers.0.self_attention.core_attention._extra_state", torch.zeros(1)) == []
