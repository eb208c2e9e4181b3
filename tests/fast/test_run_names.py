"""Run names (issue 20 item 4): what W&B and Prefect users name runs (capitals, dots) is accepted;
separators, `..`, whitespace, control characters and overlong names are refused with a sentence;
wherever a name becomes a path or a limit name it goes through `run_key`, which never maps two
names to one key, even case-folded."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prefect.types.names import (
    raise_on_name_alphanumeric_dashes_only,
    raise_on_name_alphanumeric_dashes_underscores_only,
)
from pydantic import ValidationError

from pinned_eval.points import (
    RUN_RE,
    RUN_RULE,
    PointRequest,
    SnapshotSource,
    check_run_name,
    history_artifact_key,
    inflight_limit_name,
    progress_variable_name,
    run_key,
    run_of_key,
)
from pinned_eval.snapshot.staging import Staging, StagingPathError
from pinned_eval.snapshot.writer import write_snapshot
from tests.snapshot_fixtures import named_tensors

HF = SnapshotSource(kind="hf", path="/c")
ACCEPTED = ["Exp42", "exp42", "qwen3-8b-v1.2", "exp-1_a", "A", "9." + "x" * 61]
REFUSED = ["", "a/b", "a\\b", "..", "a..b", "../x", ".hidden", "-x", "_x", "a b", "a\tb", "a\nb", "exp42\n",
           "a\x00b", "é", "x" * 64]

names = st.from_regex(RUN_RE, fullmatch=True).filter(lambda r: ".." not in r)


@pytest.mark.parametrize("run", ACCEPTED)
def test_common_run_names_are_accepted(run: str) -> None:
    assert PointRequest(run=run, step=1, source=HF).run == run


@pytest.mark.parametrize("run", REFUSED)
def test_unsafe_run_names_are_refused_with_a_sentence(run: str) -> None:
    with pytest.raises(ValueError) as refused:
        check_run_name(run)
    assert str(refused.value) == f"run {run!r} is refused: {RUN_RULE}"
    with pytest.raises(ValidationError) as invalid:
        PointRequest(run=run, step=1, source=HF)
    [error] = invalid.value.errors()
    assert error["loc"] == ("run",) and error["msg"] == f"Value error, run {run!r} is refused: {RUN_RULE}"


def test_the_rule_is_a_sentence_with_examples_not_a_regex() -> None:
    assert RUN_RULE == ("a run name is 1 to 63 letters, digits, '.', '_' or '-', starting with a letter or a digit, "
                        "without '..' (e.g. `Exp42`, `qwen3-8b-v1.2`)")


def test_keys_keep_lowercase_names_and_escape_capitals_and_dots() -> None:
    assert [run_key(r) for r in ("exp42", "exp-1_a", "Exp42", "qwen3-8b-v1.2", "EXP")] == [
        "exp42", "exp-1_a", "e.xp42", "qwen3-8b-v1_.2", "e.x.p.",
    ]
    assert run_of_key("e.xp42") == "Exp42" and run_of_key(".exp") is None and run_of_key("a..b") is None


def test_artifact_keys_and_variable_names_are_what_prefect_accepts() -> None:
    runs = ("exp42", "exp-42", "exp_42", "Exp42", "qwen3-8b-v1.2")
    assert [history_artifact_key(r) for r in runs] == [
        "eval-exp42", "eval-exp--42", "eval-exp-u42", "eval-e-dxp42", "eval-qwen3--8b--v1-u-d2",
    ]
    assert [progress_variable_name(r) for r in runs] == [
        "pinned_eval_progress_exp42", "pinned_eval_progress_exp-42", "pinned_eval_progress_exp__42",
        "pinned_eval_progress_e_dxp42", "pinned_eval_progress_qwen3-8b-v1___d2",
    ]


@given(names, names)
def test_two_names_never_share_a_key_even_case_folded(a: str, b: str) -> None:
    if a != b:
        assert run_key(a).casefold() != run_key(b).casefold()
        assert inflight_limit_name(a) != inflight_limit_name(b)
        assert history_artifact_key(a) != history_artifact_key(b)
        assert progress_variable_name(a) != progress_variable_name(b)


@given(names)
def test_artifact_keys_and_variable_names_fit_prefect_alphabets(run: str) -> None:
    assert set(history_artifact_key(run)) <= set("abcdefghijklmnopqrstuvwxyz0123456789-")
    raise_on_name_alphanumeric_dashes_only(history_artifact_key(run))  # Prefect's own checks
    raise_on_name_alphanumeric_dashes_underscores_only(progress_variable_name(run))


@given(names)
def test_a_key_is_a_safe_segment_that_decodes_to_its_name(run: str) -> None:
    key = run_key(run)
    assert run_of_key(key) == run
    assert key == key.lower() and key[0].isalnum() and ".." not in key
    assert set(key) <= set("abcdefghijklmnopqrstuvwxyz0123456789._-") and len(key) <= 2 * len(run)


def test_staging_paths_of_names_that_differ_in_case_differ_and_list_back(tmp_path: Path) -> None:
    staging = Staging(str(tmp_path / "stage"), keep_snapshots=1, cache_dir=tmp_path / "cache")
    upper, lower = staging.path_for("Exp42", 1), staging.path_for("exp42", 1)
    assert upper == str(tmp_path / "stage" / "e.xp42" / "step_00000001")
    assert lower == str(tmp_path / "stage" / "exp42" / "step_00000001")
    write_snapshot(named_tensors(), upper)
    assert [(s.run, s.step) for s in staging.list()] == [("Exp42", 1)]
    assert [s.path for s in staging.list("Exp42")] == [upper] and staging.list("exp42") == []
    assert staging.retire(upper, owned=True).kept == [upper], "the keep-ring finds the run from its key"
    with pytest.raises(StagingPathError, match="is refused: a run name is"):
        staging.path_for("a/b", 1)
