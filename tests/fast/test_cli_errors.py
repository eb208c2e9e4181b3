"""CLI errors in the user's words: flags, not Python fields; no empty `: :`; `--help` and errors
agree on source kinds; a request refused before it needs a server (missing local path, bad source);
`status` lines for steps that did not measure; `server up`'s port choice."""

from __future__ import annotations

import socket
from datetime import UTC, datetime
from pathlib import Path

import pytest
from pydantic import BaseModel, ValidationError, field_validator, model_validator
from typer.testing import CliRunner

from app.cli import app
from app.commands.errors import human_errors
from app.commands.history import outcome_lines
from app.history import PointHistory, RunHistory
from app.stack import _preferred_port
from pinned_eval.points import SnapshotSource, SourceKind


def cli(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args), env=env)
    return result.exit_code, result.output


class _Model(BaseModel):
    hf_base: str | None = None
    count: int = 0

    @field_validator("count")
    @classmethod
    def _positive(cls, v: int) -> int:
        if v < 0:
            raise ValueError("must be >= 0")
        return v

    @model_validator(mode="after")
    def _whole(self) -> _Model:
        if self.count == 7:
            raise ValueError("count 7 needs `hf_base`")
        return self


def _errors(**data: object) -> ValidationError:
    with pytest.raises(ValidationError) as info:
        _Model.model_validate(data)
    return info.value


def test_fields_become_flags_and_pydantic_prefixes_go():
    assert human_errors(_errors(count=-1), {"count": "--count"}) == "--count: must be >= 0"
    assert human_errors(_errors(count=-1)) == "count: must be >= 0"  # no flag: the field path


def test_a_model_level_error_has_no_empty_prefix_and_names_the_flag_in_its_text():
    text = human_errors(_errors(count=7), {"hf_base": "--hf-base"})
    assert text == "count 7 needs `--hf-base`"


def test_several_errors_join_in_order():
    text = human_errors(_errors(count="x", hf_base=3), {"count": "--count", "hf_base": "--hf-base"})
    assert text == "--hf-base: Input should be a valid string; --count: Input should be a valid integer, unable to " \
                   "parse string as an integer"


def test_a_source_without_its_base_names_the_flag_not_the_field(tmp_path: Path):
    code, out = cli("request", "--run", "exp42", "--step", "1", "--source", f"megatron:{tmp_path}")
    assert code == 2
    assert out.strip() == "error: source kind 'megatron' needs `--hf-base` (config and tokenizer)"
    assert ": :" not in out and "hf_base" not in out and "Value error" not in out


def test_help_and_errors_name_the_same_source_kinds():
    kinds = ", ".join(k.value for k in SourceKind)
    assert kinds == "hf, staged, megatron, state_dict, lora"
    code, out = cli("request", "--run", "exp42", "--step", "1", "--source", "weird:/x")
    assert code == 2
    assert out.strip() == f"error: --source: 'weird:/x' must be KIND:PATH with KIND one of {kinds}"
    code, out = cli("request", "--help", env={"COLUMNS": "400", "TERM": "dumb", "NO_COLOR": "1"})
    assert code == 0 and f"KIND:PATH, KIND one of {kinds}." in out, out


def test_a_missing_local_path_is_refused_before_any_server_is_needed(tmp_path: Path):
    env = {"PINNED_EVAL_HOME": str(tmp_path / "home")}  # an empty home: refused before any API is looked for
    code, out = cli("request", "--run", "exp42", "--step", "3", "--source", f"hf:{tmp_path}/nope", env=env)
    assert (code, out.strip()) == (2, f"error: --source: {tmp_path}/nope does not exist; nothing was sent")
    code, out = cli("request", "--run", "exp42", "--step", "3", "--source", f"state_dict:{tmp_path}",
                    "--hf-base", f"{tmp_path}/base", env=env)
    assert (code, out.strip()) == (2, f"error: --hf-base: {tmp_path}/base does not exist; nothing was sent")


def test_status_lines_give_reason_and_message_of_every_point_that_did_not_measure():
    now = datetime.now(UTC)

    def point(step: int, outcome: str, reason: str | None, message: str | None) -> PointHistory:
        return PointHistory(run="r", step=step, outcome=outcome, reason=reason, message=message,  # type: ignore[arg-type]
                            end_time=now)

    history = RunHistory(run="r", points=[
        point(1, "measured", None, None),
        point(2, "skipped", "ckpt_missing", "ckpt_missing: /s/step_2: .complete marker missing"),
        point(3, "failed", "crashed", "Flow run encountered an exception: RuntimeError: boom"),
        point(4, "skipped", "busy", None),
        point(5, "running", None, None),
    ])
    assert outcome_lines(history) == [
        "step 2: skipped ckpt_missing: /s/step_2: .complete marker missing",
        "step 3: failed crashed: Flow run encountered an exception: RuntimeError: boom",
        "step 4: skipped busy",
    ]


def test_server_port_is_the_recorded_one_when_free_and_moves_only_when_it_is_taken():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", 0))
        free = holder.getsockname()[1]
    assert _preferred_port(free) == free
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        assert _preferred_port(taken) != taken


def test_source_parsing_round_trip_for_every_kind(tmp_path: Path):
    from app.commands.points import parse_source

    for kind in SourceKind:
        src = parse_source(f"{kind.value}:{tmp_path}", str(tmp_path))
        assert src == SnapshotSource(kind=kind, path=str(tmp_path), hf_base=str(tmp_path))
