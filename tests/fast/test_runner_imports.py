"""Where generate functions are imported from, and by which interpreter: the suite-load check and
every point use the same roots (the YAML's directory, or the suite's `python_path`), checked as
this user's alone; the working directory is never on the import path; `miles_python` runs the
runner under another interpreter. These functions make no model call (the session points at a
closed port)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from pinned_eval.datasets.loader import EvalSample
from pinned_eval.datasets.spec import ResolvedDataset
from pinned_eval.fleet.generate import RouterGenerator
from pinned_eval.rollout import PointSession
from pinned_eval.rollout.function import FunctionRollout
from pinned_eval.skips import EvalSkipped
from pinned_eval.suite import EvalSuite
from tests.conftest import free_port

MODULE = '''
import sys
from miles.utils.types import Sample


async def generate(args, sample, sampling_params):
    sample.response = "{tag}:" + sample.prompt
    sample.response_length = 1
    sample.status = Sample.Status.COMPLETED
    sample.metadata["prefix"] = sys.prefix
    return sample
'''


def _yaml(where: Path, function: str, extra: str = "") -> Path:
    (where / "rows.jsonl").write_text('{"prompt": "p0", "label": "1"}\n')
    path = where / "eval.yaml"
    path.write_text(f"eval:\n  defaults: {{max_response_len: 4{extra}}}\n  datasets:\n    - name: fn\n"
                    f"      path: rows.jsonl\n      rm_type: math\n      custom_generate_function_path: {function}\n")
    return path


async def _produce(ds: ResolvedDataset, rollout: FunctionRollout | None = None) -> list:
    async with httpx.AsyncClient() as http:
        session = PointSession(RouterGenerator(http, f"http://127.0.0.1:{free_port()}", api_key="k"),
                               expected_version="5", rid_prefix="p5")
        async with (rollout or FunctionRollout()).open(session, [ds], {ds.name: [EvalSample(0, "p0", "1")]}) as produce:
            return await produce(ds, EvalSample(0, "p0", "1"), 0)


@pytest.fixture
def elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The test runs from another directory, so nothing is found through the working directory."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return cwd


async def test_a_module_beside_the_yaml_loads_and_runs_without_pythonpath(tmp_path: Path, elsewhere: Path) -> None:
    conf = tmp_path / "conf"
    conf.mkdir(mode=0o700)
    (conf / "beside.py").write_text(MODULE.format(tag="beside"))
    assert str(conf) not in os.environ.get("PYTHONPATH", "")
    [ds] = EvalSuite.from_miles_yaml(_yaml(conf, "beside.generate")).resolved()
    assert ds.python_path == (str(conf),)

    [sample] = await _produce(ds)

    assert (sample.response, sample.status, sample.reward) == ("beside:p0", "completed", 0.0)


async def test_explicit_python_path_resolves_against_the_yaml_and_replaces_its_directory(
    tmp_path: Path, elsewhere: Path
) -> None:
    conf = tmp_path / "conf"
    (conf / "lib").mkdir(parents=True, mode=0o700)
    (conf / "lib" / "inlib.py").write_text(MODULE.format(tag="lib"))
    (conf / "beside.py").write_text(MODULE.format(tag="beside"))
    [ds] = EvalSuite.from_miles_yaml(_yaml(conf, "inlib.generate", ", python_path: [lib]")).resolved()
    assert ds.python_path == (str(conf / "lib"),)
    [sample] = await _produce(ds)
    assert sample.response == "lib:p0"
    with pytest.raises(ValueError, match=r"^dataset 'fn': 'beside.generate': .*No module named 'beside'"):
        EvalSuite.from_miles_yaml(_yaml(conf, "beside.generate", ", python_path: [lib]"))
    with pytest.raises(ValueError, match=r"eval.defaults.python_path: a pinned-eval extension miles does not read"):
        EvalSuite.from_miles_yaml(_yaml(conf, "inlib.generate", ", python_path: [lib]"), strict_miles=True)


def test_the_working_directory_is_not_an_import_root(tmp_path: Path, elsewhere: Path) -> None:
    (elsewhere / "incwd.py").write_text(MODULE.format(tag="cwd"))
    marker = tmp_path / "shadowed"
    for name in ("json", "runpy", "pinned_eval"):  # a neighbour's stdlib / package shadows in the cwd
        (elsewhere / f"{name}.py").write_text(f"open({str(marker)!r}, 'a').write({name!r})\n")
    with pytest.raises(ValueError, match=r"^dataset 'fn': 'incwd.generate': .*No module named 'incwd'"):
        EvalSuite.from_miles_yaml(_yaml(tmp_path, "incwd.generate").read_text())  # text: no YAML directory
    assert not marker.exists()


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o770])
async def test_a_root_others_can_write_is_refused_at_load_and_at_the_point(
    tmp_path: Path, elsewhere: Path, mode: int
) -> None:
    conf = tmp_path / "conf"
    conf.mkdir(mode=0o700)
    (conf / "beside.py").write_text(MODULE.format(tag="beside"))
    yaml = _yaml(conf, "beside.generate")
    [ds] = EvalSuite.from_miles_yaml(yaml).resolved()
    conf.chmod(mode)  # a neighbour could now drop a module there (sticky bit or not)
    why = rf"python_path entry '{conf}' refused: its group or others can add modules to it \(mode {mode:o}\)"
    with pytest.raises(ValueError, match=rf"^dataset 'fn': {why}"):
        EvalSuite.from_miles_yaml(yaml)
    with pytest.raises(EvalSkipped, match=rf"^agent_error: generate-function runner: {why}") as info:
        await _produce(ds)
    assert info.value.reason == "agent_error"


def test_runners_disagreeing_on_the_interpreter_are_refused(tmp_path: Path) -> None:
    text = (f"eval:\n  defaults: {{rm_type: math}}\n  datasets:\n"
            f"    - {{name: a, path: {tmp_path}/a.jsonl, custom_generate_function_path: m.g,"
            f" miles_python: /x/python}}\n"
            f"    - {{name: b, path: {tmp_path}/b.jsonl, custom_generate_function_path: m.g}}\n")
    with pytest.raises(ValueError, match=r"miles_python: one generate-function runner per point serves datasets"):
        EvalSuite.from_miles_yaml(text, check_imports=False)


@pytest.fixture(scope="module")
def other_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second interpreter (its own venv, its own sys.prefix) that sees this venv's packages
    (pydantic, httpx: what the runner needs) through a .pth file, as a miles venv with them would."""
    venv = tmp_path_factory.mktemp("milesvenv") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    [site] = list(venv.glob("lib/python*/site-packages"))
    ours = next(p for p in sys.path if p.endswith("site-packages") and Path(p, "pydantic").is_dir())
    (site / "ours.pth").write_text(ours + "\n")
    return venv


async def test_miles_python_runs_the_runner_under_that_interpreter(
    tmp_path: Path, elsewhere: Path, other_python: Path
) -> None:
    conf = tmp_path / "conf"
    conf.mkdir(mode=0o700)
    (conf / "beside.py").write_text(MODULE.format(tag="venv"))
    python = other_python / "bin" / "python"
    [ds] = EvalSuite.from_miles_yaml(_yaml(conf, "beside.generate", f", miles_python: {python}")).resolved()
    assert ds.miles_python == str(python)

    [sample] = await _produce(ds)

    assert sample.response == "venv:p0"
    assert sample.metadata["prefix"] == str(other_python)  # not this process's sys.prefix
    assert str(other_python) != sys.prefix


def test_a_miles_python_without_the_runner_dependencies_is_named(tmp_path: Path, elsewhere: Path) -> None:
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    conf = tmp_path / "conf"
    conf.mkdir(mode=0o700)
    (conf / "beside.py").write_text(MODULE.format(tag="bare"))
    python = bare / "bin" / "python"
    with pytest.raises(ValueError, match=rf"^generate functions: the import check failed under miles_python "
                                         rf"'{python}' \(.*No module named"):
        EvalSuite.from_miles_yaml(_yaml(conf, "beside.generate", f", miles_python: {python}"))


@pytest.mark.parametrize(
    ("value", "message"),
    [("relative/python", r"miles_python '.*/relative/python': No such file or directory"),
     ("/etc/passwd", r"miles_python '/etc/passwd': not an executable file")],
)
async def test_a_bad_miles_python_is_refused(tmp_path: Path, elsewhere: Path, value: str, message: str) -> None:
    conf = tmp_path / "conf"
    conf.mkdir(mode=0o700)
    (conf / "beside.py").write_text(MODULE.format(tag="x"))
    with pytest.raises(ValueError, match=rf"^dataset 'fn': {message}"):
        EvalSuite.from_miles_yaml(_yaml(conf, "beside.generate", f", miles_python: {value}"))
