"""The reference external backend generates through the one rollout path and scores as the flow's
score task does: a miles `async (args, sample)` reward gets the suite's full `args` namespace
(`EvalSuite.miles_args`), not a two-field stand-in. Real CPU engine, attached by URL."""

from __future__ import annotations

import importlib
import itertools
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from pinned_eval.datasets.loader import EvalSample, load_dataset
from pinned_eval.external import EvalInput
from pinned_eval.fleet.cpu_engine import EngineProcess
from pinned_eval.suite import DatasetSpec, EvalSuite, SamplingDefaults
from tests.e2e.conftest import EngineStarter
from tests.pointkit import write_step_snapshot
from trainer_integration.sglang_backend import SGLangCheckpointEval

pytestmark = pytest.mark.e2e
_ids = itertools.count()


@pytest.fixture(scope="module")
def engine(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    starter = EngineStarter(tmp_path_factory.mktemp("rollout-engine"))
    try:
        yield starter(tiny_model)
    finally:
        starter.stop_all()


async def test_external_backend_rewards_get_the_suites_args(
    engine: EngineProcess, tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = f"rollout_miles_rm_{next(_ids)}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent("""
        CALLS = []

        async def rm(args, sample):
            CALLS.append((sample.prompt, sample.response, dict(vars(args))))
            return 1.0
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    suite = EvalSuite(
        datasets=(
            DatasetSpec(name="add", path="builtin:arith_add.jsonl", max_prompts=2),
            DatasetSpec(
                name="sub", path="builtin:arith_sub.jsonl", max_prompts=1, n_samples_per_prompt=2, temperature=0.5
            ),
        ),
        defaults=SamplingDefaults(temperature=0.0, max_new_tokens=3, reward=f"custom:{name}:rm"),
    )
    snap = write_step_snapshot(tiny_model, str(tmp_path / "step_3"))
    backend = SGLangCheckpointEval(url=engine.url)
    results = await backend.evaluate_checkpoint(snap, EvalInput(run="exp42", step=3, hf_dir=snap, suite=suite))
    backend.dispose()
    calls = importlib.import_module(name).CALLS
    assert len(calls) == 4 and backend.history.generated == 4
    expected = {ds.name: dict(vars(suite.miles_args(ds))) for ds in suite.resolved()}
    assert expected["sub"]["n_samples_per_eval_prompt"] == 2 and expected["sub"]["eval_temperature"] == 0.5
    by_prompt = {p: args for p, _, args in calls}
    add_prompts = [s.prompt for s in _rows(suite, "add")]
    sub_prompts = [s.prompt for s in _rows(suite, "sub")]
    assert sorted(by_prompt) == sorted(add_prompts + sub_prompts)
    assert all(by_prompt[p] == expected["add"] for p in add_prompts)
    assert all(by_prompt[p] == expected["sub"] for p in sub_prompts)
    assert {ds: r.rewards for ds, r in results.data.items()} == {"add": [1.0, 1.0], "sub": [1.0, 1.0]}
    assert {v for r in results.data.values() for v in r.weight_versions} == {"3"}


def _rows(suite: EvalSuite, name: str) -> list[EvalSample]:
    [ds] = [d for d in suite.resolved() if d.name == name]
    return load_dataset(ds)
