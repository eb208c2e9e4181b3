"""state_dict source -> snapshot -> transformers loads it with the source model's logits; CLI verbs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from app.cli import app
from pinned_eval.snapshot.check import check_snapshot
from pinned_eval.snapshot.state_dict import StateDictMismatchError, export_state_dict
from tests.snapshot_fixtures import logits, perturbed_state_dict, tiny_hf_base


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_hf_base(tmp_path_factory.mktemp("llama") / "base", "llama")


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_hf_base(tmp_path_factory.mktemp("qwen2") / "base", "qwen2")


def _source_logits(base: Path, sd: dict[str, torch.Tensor]) -> torch.Tensor:
    """Logits of the base architecture with `sd` loaded in memory (no snapshot involved)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base)).eval()
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    ids = torch.randint(3, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_export_loads_with_equal_logits(llama: Path, tmp_path: Path, suffix: str) -> None:
    sd = perturbed_state_dict(llama, seed=1)
    f = tmp_path / f"weights{suffix}"
    save_file(sd, str(f)) if suffix == ".safetensors" else torch.save(sd, f)
    res = export_state_dict(f, llama, str(tmp_path / "snap"), max_shard_bytes=200_000, metadata={"step": 3})
    assert res.shards > 1
    assert check_snapshot(str(tmp_path / "snap")).complete
    got, want = logits(tmp_path / "snap"), _source_logits(llama, sd)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not torch.equal(got, logits(llama)), "the snapshot must hold the new weights, not the base's"
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (llama / name).exists():
            assert (tmp_path / "snap" / name).read_bytes() == (llama / name).read_bytes()


def test_tied_embeddings(qwen2: Path, tmp_path: Path) -> None:
    sd = perturbed_state_dict(qwen2, seed=2)
    assert "lm_head.weight" not in sd
    export_state_dict_file = tmp_path / "w.safetensors"
    save_file(sd, str(export_state_dict_file))
    export_state_dict(export_state_dict_file, qwen2, str(tmp_path / "a"))
    torch.testing.assert_close(logits(tmp_path / "a"), _source_logits(qwen2, sd), rtol=0, atol=0)

    with_head = {**sd, "lm_head.weight": sd["model.embed_tokens.weight"].clone()}
    torch.save(with_head, tmp_path / "w.pt")
    export_state_dict(tmp_path / "w.pt", qwen2, str(tmp_path / "b"))  # equal tied copy: accepted, dropped
    torch.testing.assert_close(logits(tmp_path / "b"), logits(tmp_path / "a"), rtol=0, atol=0)

    with_head["lm_head.weight"] = with_head["lm_head.weight"] + 1
    torch.save(with_head, tmp_path / "w2.pt")
    with pytest.raises(StateDictMismatchError, match="tied"):
        export_state_dict(tmp_path / "w2.pt", qwen2, str(tmp_path / "c"))
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize(("change", "match"), [
    (lambda sd: sd.pop("model.norm.weight"), "missing 1"),
    (lambda sd: sd.update({"model.extra.weight": torch.zeros(2)}), "unexpected 1"),
    (lambda sd: sd.update({"model.norm.weight": torch.zeros(3)}), "wrong shape"),
])
def test_mismatched_state_dict_is_refused_before_writing(llama: Path, tmp_path: Path, change, match: str) -> None:
    sd = perturbed_state_dict(llama, seed=3)
    change(sd)
    save_file(sd, str(tmp_path / "w.safetensors"))
    with pytest.raises(StateDictMismatchError, match=match):
        export_state_dict(tmp_path / "w.safetensors", llama, str(tmp_path / "snap"))
    assert not (tmp_path / "snap").exists()


def test_dtype_cast(llama: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    sd = perturbed_state_dict(llama, seed=4)
    save_file(sd, str(tmp_path / "w.safetensors"))
    export_state_dict(tmp_path / "w.safetensors", llama, str(tmp_path / "snap"), dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "snap"))
    assert model.dtype == torch.bfloat16
    assert torch.equal(model.model.norm.weight, sd["model.norm.weight"].to(torch.bfloat16))


# ---- CLI -----------------------------------------------------------------------------------------

def test_cli_export_check_ls(llama: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    sd = perturbed_state_dict(llama, seed=5)
    save_file(sd, str(tmp_path / "w.safetensors"))
    dest = tmp_path / "stage" / "exp1" / "step_00000005"
    r = runner.invoke(app, ["export", "--state-dict", str(tmp_path / "w.safetensors"), "--hf-base", str(llama),
                            "--out", str(dest), "--max-shard-size", "100KB"])
    assert r.exit_code == 0, r.output
    assert "shards" in r.stdout

    r = runner.invoke(app, ["snapshot", "check", str(dest)])
    assert r.exit_code == 0 and "complete" in r.stdout

    r = runner.invoke(app, ["snapshot", "ls", str(tmp_path / "stage")])
    assert r.exit_code == 0
    row = r.stdout.splitlines()[1].split()
    assert row[:4] == ["exp1", "5", "True", "False"]

    shard = sorted(dest.glob("model-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-1])
    r = runner.invoke(app, ["snapshot", "check", str(dest)])
    assert r.exit_code == 1 and "truncated_shard" in r.stderr


def test_cli_export_usage_errors(llama: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    base = ["export", "--hf-base", str(llama), "--out", str(tmp_path / "o")]
    assert runner.invoke(app, base).exit_code == 2  # neither source
    f = tmp_path / "w.safetensors"
    save_file({"x": torch.zeros(1)}, str(f))
    assert runner.invoke(app, [*base, "--state-dict", str(f), "--megatron-ckpt", str(tmp_path)]).exit_code == 2
    assert runner.invoke(app, [*base, "--state-dict", str(f), "--max-shard-size", "lots"]).exit_code == 2
    r = runner.invoke(app, [*base, "--state-dict", str(f)])  # wrong names for the architecture
    assert r.exit_code == 1 and r.stderr.startswith("error: export failed (partial output removed): state dict "
                                                    "does not match the base config: missing 21 ")
    assert "StateDictMismatchError" not in r.stderr  # the user's words, not a class name
    assert not (tmp_path / "o").exists()
