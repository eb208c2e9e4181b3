"""The results store (paths, modes, round trip), the generation cache key and the flip comparison."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from pinned_eval.datasets.loader import EvalSample
from pinned_eval.results.cache import generation_key, snapshot_digest
from pinned_eval.results.compare import compare_samples, format_flips
from pinned_eval.results.store import SAMPLES, ResultsPathError, ResultsStore
from pinned_eval.results.tables import generation_fields, generation_row, samples_table, table_key
from pinned_eval.snapshot.writer import write_snapshot
from pinned_eval.suite import DatasetSpec, EvalSuite, SamplingDefaults


def _gen(ds: str, i: int, response: str, j: int = 0) -> dict[str, object]:
    return {"dataset": ds, "prompt_index": i, "sample_index": j, "prompt": f"p{i}", "label": 7 if i else "x",
            "metadata": {"k": [i]}, "response": response, "response_len": 3, "finish_reason": "length",
            "weight_version": "5", "prompt_tokens": 4}


def _samples(rewards: dict[int, float], ds: str = "d") -> object:
    rows = [{**generation_row(_gen(ds, i, f"r{i}-{r}")), "reward": r} for i, r in rewards.items()]
    return samples_table(rows, key="k1")


def test_round_trip_keeps_types_and_key(tmp_path: Path) -> None:
    store = ResultsStore(str(tmp_path / "results"))
    url = store.write("exp-1", 5, SAMPLES, _samples({0: 1.0, 1: 0.0}))  # type: ignore[arg-type]
    assert url == str(tmp_path / "results" / "exp-1" / "step_00000005" / SAMPLES)
    table = store.read("exp-1", 5, SAMPLES)
    assert table_key(table) == "k1"
    rows = table.to_pylist()
    assert [generation_fields(r) for r in rows] == [_gen("d", 0, "r0-1.0"), _gen("d", 1, "r1-0.0")]
    assert [r["reward"] for r in rows] == [1.0, 0.0]


def test_local_files_are_private(tmp_path: Path) -> None:
    os.umask(0o022)
    store = ResultsStore(str(tmp_path / "results"))
    store.write("exp", 0, SAMPLES, _samples({0: 1.0}))  # type: ignore[arg-type]
    step_dir = tmp_path / "results" / "exp" / "step_00000000"
    for d in (tmp_path / "results", step_dir.parent, step_dir):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    assert stat.S_IMODE((step_dir / SAMPLES).stat().st_mode) == 0o600
    assert [p.name for p in step_dir.iterdir()] == [SAMPLES]  # no temp file left behind


@pytest.mark.parametrize("run", ["../x", "a/b", "exp\n", "..", ".hidden", ""])
def test_run_names_that_are_not_run_names_are_refused(tmp_path: Path, run: str) -> None:
    store = ResultsStore(str(tmp_path))
    with pytest.raises(ResultsPathError, match="is refused: a run name is 1 to 63 letters"):
        store.write(run, 1, SAMPLES, _samples({0: 1.0}))  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


def test_runs_differing_only_in_case_never_share_a_directory(tmp_path: Path) -> None:
    store = ResultsStore(str(tmp_path))
    store.write("Exp42", 1, SAMPLES, _samples({0: 1.0}))  # type: ignore[arg-type]
    store.write("exp42", 1, SAMPLES, _samples({0: 0.0}))  # type: ignore[arg-type]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e.xp42", "exp42"]
    assert store.url("qwen3-8b-v1.2", 7, SAMPLES) == str(tmp_path / "qwen3-8b-v1_.2" / "step_00000007" / SAMPLES)


def test_a_symlinked_run_dir_is_refused(tmp_path: Path) -> None:
    (tmp_path / "results").mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "results" / "exp").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ResultsPathError, match="symlink"):
        ResultsStore(str(tmp_path / "results")).write("exp", 1, SAMPLES, _samples({0: 1.0}))  # type: ignore[arg-type]
    assert list((tmp_path / "elsewhere").iterdir()) == []


def test_compare_lists_flips_each_way_with_texts() -> None:
    a = _samples({0: 1.0, 1: 0.0, 2: 1.0, 3: 0.0, 5: 1.0})
    b = _samples({0: 0.0, 1: 1.0, 2: 1.0, 3: 0.0, 4: 1.0})
    [d] = compare_samples(a, b)  # type: ignore[arg-type]
    assert (d.dataset, d.examples, d.unmatched) == ("d", 4, 2)
    assert [(f.example_id, f.response_a, f.response_b) for f in d.lost] == [(0, "r0-1.0", "r0-0.0")]
    assert [(f.example_id, f.response_a, f.response_b, f.label) for f in d.gained] == [(1, "r1-0.0", "r1-1.0", "7")]
    text = format_flips("exp", 1, 2, [d])
    assert "d: 4 examples, 1 correct in A and wrong in B, 1 wrong in A and correct in B, 2 unmatched" in text
    assert "  [correct in A, wrong in B] #0 prompt='p0' label=\"x\"" in text


def test_compare_judges_the_mean_of_an_examples_samples() -> None:
    rows_a = [{**generation_row(_gen("d", 0, "a", j)), "reward": r} for j, r in enumerate([1.0, 1.0])]
    rows_b = [{**generation_row(_gen("d", 0, "b", j)), "reward": r} for j, r in enumerate([1.0, None])]
    [d] = compare_samples(samples_table(rows_a, key=None), samples_table(rows_b, key=None))
    assert [(f.reward_a, f.reward_b) for f in d.lost] == [(1.0, 0.5)]
    [d] = compare_samples(samples_table(rows_a, key=None), samples_table(rows_b, key=None), threshold=0.5)
    assert d.lost == [] and d.gained == []


SUITE = EvalSuite(
    datasets=(DatasetSpec(name="arith_add", path="builtin:arith_add.jsonl", max_prompts=3),),
    defaults=SamplingDefaults(temperature=0.0, max_new_tokens=3, n_samples_per_prompt=1, reward="exact_match"),
)


def _snapshot(dest: Path, value: float = 1.0) -> str:
    import torch

    write_snapshot([("w", torch.full((4, 4), value))], str(dest))
    return str(dest)


def test_generation_key_changes_with_what_changes_generations(tmp_path: Path) -> None:
    ds = SUITE.resolved()
    rows = {"arith_add": [EvalSample(0, "1+1=", "2"), EvalSample(1, "2+2=", "4")]}
    snap = snapshot_digest(_snapshot(tmp_path / "a"))
    key = generation_key(snap, "5", ds, rows, None)
    assert generation_key(snap, "5", ds, rows, None) == key
    other_rewards = EvalSuite(datasets=SUITE.datasets, defaults=SUITE.defaults.model_copy(update={"reward": "math"}))
    assert generation_key(snap, "5", other_rewards.resolved(), rows, None) == key  # rewards: not in the key
    changed = [
        generation_key(snapshot_digest(_snapshot(tmp_path / "b")), "5", ds, rows, None),  # another export
        generation_key(snap, "6", ds, rows, None),
        generation_key(snap, "5", ds, {"arith_add": rows["arith_add"][:1]}, None),
        generation_key(snap, "5", [ds[0].model_copy(update={"max_new_tokens": 4})], rows, None),
        generation_key(snap, "5", [ds[0].model_copy(update={"temperature": 0.5})], rows, None),
        generation_key(snap, "5", [ds[0].model_copy(update={"apply_chat_template": True})], rows, None),
    ]
    assert len({key, *changed}) == 1 + len(changed)


def test_chat_template_is_in_the_key_when_applied(tmp_path: Path) -> None:
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "chat_template.jinja").write_text("{{ messages }}")
    ds = [SUITE.resolved()[0].model_copy(update={"apply_chat_template": True})]
    rows = {"arith_add": [EvalSample(0, "1+1=", "2")]}
    key = generation_key("s", "5", ds, rows, str(tok))
    (tok / "chat_template.jinja").write_text("{{ messages }}!")
    assert generation_key("s", "5", ds, rows, str(tok)) != key


def test_snapshot_digest_reads_the_manifest_not_the_tensors(tmp_path: Path) -> None:
    path = Path(_snapshot(tmp_path / "s"))
    digest = snapshot_digest(path)
    [shard] = path.glob("*.safetensors")
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # tensor bytes changed in place, manifest unchanged: same export, same digest
    shard.write_bytes(bytes(data))
    assert snapshot_digest(path) == digest
    (path / ".complete").write_text("")  # a bare marker: judged by the files (sizes, times, headers)
    bare = snapshot_digest(path)
    assert bare != digest
    os.utime(shard, ns=(1, 1))
    assert snapshot_digest(path) != bare
