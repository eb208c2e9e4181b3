"""Object labels and dict rewards, with miles' semantics: a row's label is the raw JSON value
(search-r1's `{"ground_truth": ...}`) for custom rewards and generate functions; a dict reward
counts by `eval_reward_key or reward_key` (miles' `inference_rollout_eval.py`:
`sample.reward if not reward_key else sample.reward[reward_key]`), through scoring, the function
rollout and the results tables."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from pinned_eval.datasets.loader import DatasetError, EvalSample, load_dataset
from pinned_eval.fleet.generate import RouterGenerator
from pinned_eval.results.tables import generation_fields, generation_row
from pinned_eval.rollout import PointSession, Sample
from pinned_eval.rollout.function import FunctionRollout
from pinned_eval.scoring.answers import RewardTypeError
from pinned_eval.scoring.miles_custom import eval_reward_key, reward_value
from pinned_eval.scoring.remote import RewardItem, score_responses
from pinned_eval.skips import EvalSkipped
from pinned_eval.suite import DatasetSpec, EvalSuite
from tests.conftest import free_port

DAPO = {"score": -1.0, "acc": True, "pred": "7"}


def miles_eval_reward(reward: Any, reward_key: str | None, eval_key: str | None) -> Any:
    """miles' own rule, as written in `inference_rollout_eval.py` (the reference semantics)."""
    args = SimpleNamespace(reward_key=reward_key, eval_reward_key=eval_key)
    key = args.eval_reward_key or args.reward_key
    return reward if not key else reward[key]


@pytest.mark.parametrize(
    ("reward", "reward_key", "eval_key", "expected"),
    [
        (0.5, None, None, 0.5),
        (None, None, None, None),
        (DAPO, "score", None, -1.0),
        (DAPO, "score", "acc", 1.0),  # the eval key wins; miles' mean counts True as 1
        (DAPO, None, "pred_len", "KeyError"),
        ({"score": 1.0, "acc": False}, "acc", None, 0.0),
    ],
)
def test_reward_value_follows_miles_eval_rule(reward: Any, reward_key: str | None, eval_key: str | None,
                                              expected: Any) -> None:
    key = eval_reward_key(SimpleNamespace(reward_key=reward_key, eval_reward_key=eval_key))
    if expected == "KeyError":
        with pytest.raises(KeyError):
            miles_eval_reward(reward, reward_key, eval_key)
        with pytest.raises(RewardTypeError, match=r"reward 'r' returned a dict without 'pred_len' "
                                                  r"\(eval_reward_key/reward_key\)"):
            reward_value("r", reward, key)
        return
    miles = miles_eval_reward(reward, reward_key, eval_key)
    assert reward_value("r", reward, key) == (None if miles is None else float(miles)) == expected


def test_pinned_eval_extends_miles_where_miles_fails() -> None:
    """Where miles' eval raises or logs a dict, pinned-eval keeps a number (documented)."""
    with pytest.raises(TypeError):
        miles_eval_reward(0.5, "score", None)  # miles on main: 'float' object is not subscriptable
    assert reward_value("r", 0.5, "score") == 0.5
    assert reward_value("r", DAPO, None) == -1.0  # miles would log the dict itself
    with pytest.raises(RewardTypeError, match=r"returned 'x' \(str\); expected a float or None"):
        reward_value("r", {"score": "x"}, None)


def _rows(tmp_path: Path, label: Any) -> Path:
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt": "Name a prime.", "label": label}) + "\n")
    return path


@pytest.mark.parametrize("reward", ["custom:tests.rewards:dapo_dict", "remote_rm"])
def test_an_object_label_loads_for_what_reads_it(tmp_path: Path, reward: str) -> None:
    extra = {"remote_reward": {"url": "http://127.0.0.1:9/score"}} if reward == "remote_rm" else {}
    suite = EvalSuite(datasets=(DatasetSpec(name="d", path=str(_rows(tmp_path, {"ground_truth": "7"})),
                                            reward=reward),), **extra)
    [row] = load_dataset(suite.resolved()[0])
    assert row.label == {"ground_truth": "7"}


def test_an_object_label_for_a_builtin_reward_is_refused_naming_key_and_reward(tmp_path: Path) -> None:
    suite = EvalSuite(datasets=(DatasetSpec(name="d", path=str(_rows(tmp_path, {"ground_truth": "7"})),
                                            reward="math"),))
    with pytest.raises(DatasetError, match=r"line 1: key 'label' is a JSON object; reward 'math' needs a string or "
                                           r"a number"):
        load_dataset(suite.resolved()[0])


def test_scoring_a_dict_reward_uses_the_suites_reward_keys(tmp_path: Path) -> None:
    text = (f"eval:\n  defaults: {{reward: 'custom:tests.rewards:dapo_dict', reward_key: score}}\n  datasets:\n"
            f"    - {{name: by_score, path: {_rows(tmp_path, {'ground_truth': '7'})}}}\n"
            f"    - {{name: by_acc, path: {tmp_path}/rows.jsonl, eval_reward_key: acc}}\n")
    suite = EvalSuite.from_miles_yaml(text)
    scored = {}
    for ds in suite.resolved():
        [row] = load_dataset(ds)
        items = [RewardItem("Name a prime.", r, row.label) for r in ("7", "9")]
        scored[ds.name] = asyncio.run(score_responses(ds.reward, items, None, suite.miles_args(ds)))
    assert scored == {"by_score": [1.0, -1.0], "by_acc": [1.0, 0.0]}
    with pytest.raises(ValueError, match=r"eval.datasets\[1\].eval_reward_key: a pinned-eval extension miles does "
                                         r"not read"):
        EvalSuite.from_miles_yaml(text, strict_miles=True)


def test_an_object_label_round_trips_through_the_results_tables() -> None:
    sample = Sample(dataset="d", prompt_index=0, sample_index=0, prompt="p", label={"ground_truth": ["7", 7]},
                    metadata={}, response="7", response_len=1, finish_reason="stop", weight_version="3")
    row = generation_row(sample.model_dump())
    assert row["label"] == '{"ground_truth": ["7", 7]}'
    assert Sample(**generation_fields(row)) == sample


GENERATE = '''
from miles.utils.types import Sample


async def generate(args, sample, sampling_params):
    sample.response = str(sample.label["ground_truth"])
    sample.status = Sample.Status.COMPLETED
    sample.reward = {"score": -1.0, "acc": True, "seen": [args.reward_key, args.eval_reward_key]}
    return sample
'''


async def _produce(tmp_path: Path, **keys: str) -> list:
    (tmp_path / "labelled.py").write_text(GENERATE)
    [ds] = EvalSuite(datasets=(DatasetSpec(name="fn", path="/a.jsonl", generate_function="labelled.generate",
                                           reward="math", **keys),)).resolved()
    row = EvalSample(0, "p", {"ground_truth": 7})
    async with httpx.AsyncClient() as http:
        session = PointSession(RouterGenerator(http, f"http://127.0.0.1:{free_port()}", api_key="k"),
                               expected_version="5", rid_prefix="p5")
        async with FunctionRollout(python_path=[str(tmp_path)]).open(session, [ds], {"fn": [row]}) as produce:
            return await produce(ds, row, 0)


async def test_a_generate_functions_dict_reward_counts_by_the_eval_reward_key(tmp_path: Path) -> None:
    [sample] = await _produce(tmp_path, reward_key="score", eval_reward_key="acc")
    assert (sample.response, sample.reward, sample.label) == ("7", 1.0, {"ground_truth": 7})
    [sample] = await _produce(tmp_path, reward_key="score")
    assert sample.reward == -1.0


async def test_a_dict_reward_without_the_key_is_an_agent_error(tmp_path: Path) -> None:
    with pytest.raises(EvalSkipped, match=r"^agent_error: dataset 'fn' sample 0 \(j=0\): TypeError: reward 'of the "
                                          r"generate function' returned a dict without 'pred'"):
        await _produce(tmp_path, reward_key="pred")
