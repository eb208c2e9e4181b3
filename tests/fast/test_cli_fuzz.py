"""Every verb, every argument, hostile values: never a Python traceback, always an exit code.

The verbs are enumerated from the Typer app (a new verb is fuzzed without touching this file).
For each parameter that takes a value, each hostile value is given to it alone (the verb's other
required parameters get a harmless placeholder), in-process with `CliRunner`, in a fresh home
with no Prefect API configured: a verb that needs the API says so (exit 2). What would start
something long-lived (a server, a worker's stack, a fleet, an engine, the demo, a tiny model)
is replaced by a recording fake that fails in words, so a value that gets that far is still
checked for a clean exit. A second test points the home at a server that is down: every API verb
says the API is unreachable and how to start it.
"""

from __future__ import annotations

import errno
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
import typer
import typer.testing
from typer.testing import CliRunner

from app.cli import app
from tests.conftest import free_port

HOSTILE = [
    "", "\x00", "a\x00b", "a" * 5000, "/proc/self", "http://x", "s3://nobucket/x",
    "99999999999999999999999", "1.0", "+1", "1_000", "01", "-1",
]
PLACEHOLDER = "placeholder"
SLOT = "\0slot"  # where the fuzzed argument goes


def leaf_commands(group: click.Command, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], click.Command]]:
    if hasattr(group, "commands"):  # a group (Typer's click or click's)
        for name, sub in group.commands.items():
            yield from leaf_commands(sub, (*path, name))
    else:
        yield path, group


def value_params(command: click.Command) -> list[click.Parameter]:
    return [p for p in command.params if not (is_option(p) and (p.is_flag or p.count))]


def is_option(p: click.Parameter) -> bool:
    return p.param_type_name == "option"


def base_args(command: click.Command, skip: click.Parameter) -> tuple[list[str], list[str]]:
    """(arguments, options) for every required parameter but `skip`, with the placeholder."""
    arguments: list[str] = []
    options: list[str] = []
    for p in command.params:
        if p is skip:
            if not is_option(p):
                arguments.append(SLOT)
            continue
        if not is_option(p) and p.required:
            arguments.append(PLACEHOLDER)
        elif is_option(p) and p.required:
            options += [p.opts[0], PLACEHOLDER]
    return arguments, options


class Recorded(Exception):
    pass


@pytest.fixture
def sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """A fresh cwd and home, no Prefect API, no AWS metadata lookups; long-lived starts recorded."""
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    calls: list[str] = []

    def fake(name: str):  # type: ignore[no-untyped-def]
        def record(*_a: object, **_k: object) -> None:
            calls.append(name)
            raise OSError(errno.EPERM, f"{name} is not started in this test")

        return record

    import app.commands.fleet as fleet_cmd
    import app.demo.run as demo_run
    import engine.server as engine_server
    import engine.tiny_model as tiny
    from app.stack import LocalStack

    monkeypatch.setattr(LocalStack, "server_up", fake("server up"))
    monkeypatch.setattr(LocalStack, "deploy", fake("deploy"))
    monkeypatch.setattr(LocalStack, "run_worker", fake("worker"))
    monkeypatch.setattr(fleet_cmd, "launch_cpu_fleet", fake("fleet up"))
    monkeypatch.setattr(fleet_cmd, "launch_sglang_fleet", fake("fleet up"))
    monkeypatch.setattr(demo_run, "run_demo", fake("demo"))
    monkeypatch.setattr(engine_server, "serve", fake("engine serve"))
    monkeypatch.setattr(tiny, "make_tiny_model", fake("tiny-model"))
    monkeypatch.setattr(typer.testing, "_get_command", lambda _app: COMMAND)
    monkeypatch.chdir(tmp_path)
    for var in ("PREFECT_API_URL", "PREFECT_API_AUTH_STRING", "PINNED_EVAL_API_AUTH_FILE", "AWS_ACCESS_KEY_ID",
                "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "PINNED_EVAL_DEBUG"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PINNED_EVAL_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("COLUMNS", "200")
    with temporary_settings(updates={PREFECT_API_URL: None, PREFECT_API_AUTH_STRING: None}):
        yield calls


COMMAND = typer.main.get_command(app)  # built once: building it per call is most of a call's time


def invoke(args: list[str]) -> tuple[int, str, BaseException | None]:
    result = CliRunner().invoke(app, args)
    return result.exit_code, result.output, result.exception


def assert_clean(args: list[str], code: int, out: str, exc: BaseException | None) -> None:
    shown = [a[:40] for a in args]
    assert isinstance(exc, SystemExit | type(None)), f"{shown}: {exc!r}\n{out}"
    assert "Traceback" not in out and 'File "' not in out, f"{shown}:\n{out}"
    assert code in (0, 1, 2), f"{shown}: exit {code}\n{out}"
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert len(errors) <= 1, f"{shown}: more than one error line\n{out}"


def test_every_verb_and_argument_survives_hostile_values(sandbox: list[str], tmp_path: Path) -> None:
    deep = tmp_path / "deep.yaml"
    deep.write_text("suite:\n  " + "[" * 5000 + "]" * 5000 + "\n")
    values = [*HOSTILE, str(deep), str(tmp_path / "absent" / "x")]
    verbs = list(leaf_commands(COMMAND))
    assert len(verbs) >= 30 and ("compare",) in dict(verbs) and ("block", "apply") in dict(verbs)
    tried = 0
    for path, cmd in verbs:
        for param in value_params(cmd):
            arguments, options = base_args(cmd, param)
            for value in values:
                if not is_option(param):
                    args = [*path, *options, "--", *(value if a == SLOT else a for a in arguments)]
                else:
                    args = [*path, *options, param.opts[0], value, "--", *arguments]
                assert_clean(args, *invoke(args))
                tried += 1
    assert tried > 1000, tried


def test_the_debug_flag_shows_the_traceback_and_its_absence_hides_the_type(sandbox: list[str]) -> None:
    code, out, _ = invoke(["snapshot", "ls", "/proc/self/fd/0/x"])
    assert code == 1 and out.startswith("error: ") and "Traceback" not in out, out
    assert out.strip().endswith("(--debug shows the traceback)") and "Error:" not in out
    code, out, _ = invoke(["--debug", "snapshot", "ls", "/proc/self/fd/0/x"])
    assert code == 1 and "Traceback (most recent call last)" in out, out
    assert out.strip().splitlines()[-1].startswith("error: NotADirectoryError: ") or "Error: " in out.splitlines()[-1]


def test_step_is_a_strict_int64(sandbox: list[str], tmp_path: Path) -> None:
    for bad in ("1.0", "+1", "1_000", "01", "-1", "9223372036854775808", " 1", "٣"):
        code, out, _ = invoke(["request", "--run", "r", "--step", bad, "--source", f"hf:{tmp_path}"])
        assert code == 2 and "--step" in out, (bad, out)
    code, out, _ = invoke(["request", "--run", "r", "--step", "9223372036854775807", "--source", f"hf:{tmp_path}"])
    assert (code, out.strip().splitlines()[-1]) == (2, "error: no Prefect API: run `pinned-eval server up`, or set "
                                                       "PREFECT_API_URL (e.g. `export PREFECT_API_URL="
                                                       "http://127.0.0.1:4200/api`)")


def test_with_the_server_down_every_api_verb_says_so_and_how_to_start_it(sandbox: list[str], tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    url = f"http://127.0.0.1:{free_port()}/api"  # nothing listens there
    (home / "stack.json").write_text(f'{{"api_url": "{url}"}}')
    (tmp_path / "sample.jsonl").write_text('{"prompt": "1+1=", "label": "2"}\n')
    (tmp_path / "proj.yaml").write_text("sinks:\n  jsonl: m.jsonl\n")
    verbs = [
        ["request", "--run", "r", "--step", "1", "--source", f"hf:{tmp_path}"], ["rerun", "--run", "r", "--step", "1"],
        ["status", "--run", "r"], ["best", "r", "--metric", "eval/x"], ["compare", "r", "1", "2"],
        ["rescore", "r", "1"],
        ["block", "list"], ["block", "show", "suite"], ["block", "apply", "proj.yaml"],
        ["block", "save", "sinks", "x", "--jsonl", "m.jsonl"], ["suite", "miles", "sample.jsonl", "--save", "x"],
        ["janitor"], ["worker"],
    ]
    for args in verbs:
        code, out, exc = invoke(args)
        assert_clean(args, code, out, exc)
        last = out.strip().splitlines()[-1] if out.strip() else ""
        if args[:2] == ["suite", "miles"]:  # not a miles config: refused before any server is needed
            assert code == 2, out
            continue
        assert code == 1 and last.startswith(f"error: cannot reach the Prefect API at {url}"), (args, out)
        assert "`pinned-eval server up`" in last, (args, out)
    assert sandbox == []  # nothing was started


def test_the_boundary_keeps_exit_codes_and_formats_every_failure_in_one_line() -> None:
    from pydantic import BaseModel

    from app.commands._cli import CliError, PinnedTyper, in_words

    class Model(BaseModel):
        count: int

    boundary = PinnedTyper()
    raised: dict[str, BaseException] = {
        "skipped": typer.Exit(3), "failed": typer.Exit(4), "usage": CliError("--x: bad", 2),
        "broken": CliError("it broke"), "pydantic": _validation_error(Model), "oserror": FileNotFoundError(2, "No such "
        "file or directory", "/x/y"), "bare": RuntimeError(), "multiline": ValueError("first\nsecond"),
    }

    @boundary.command("go")
    def go(what: str) -> None:
        raise raised[what]

    @boundary.command("other")
    def other() -> None:  # a second command: Typer then dispatches by name
        pass

    def run(what: str) -> tuple[int, str]:
        result = CliRunner().invoke(boundary, ["go", what])
        return result.exit_code, result.output

    assert run("skipped") == (3, "") and run("failed") == (4, "")
    assert run("usage") == (2, "error: --x: bad\n") and run("broken") == (1, "error: it broke\n")
    parse = "Input should be a valid integer, unable to parse string as an integer"
    assert run("pydantic") == (2, f"error: count: {parse}\n")
    hint = " (--debug shows the traceback)\n"
    assert run("oserror") == (1, "error: /x/y: No such file or directory" + hint)
    assert run("bare") == (1, "error: the operation failed unexpectedly" + hint)
    assert run("multiline") == (1, "error: first" + hint)
    assert in_words(KeyError("k")) == "missing key 'k'"


def _validation_error(model: type) -> BaseException:
    from pydantic import ValidationError

    try:
        model.model_validate({"count": "x"})  # type: ignore[attr-defined]
    except ValidationError as exc:
        return exc
    raise AssertionError("no error")
