"""The rollout seam (`pinned_eval.rollout`): a contract every registered rollout kind keeps, run
against a recording session (a `PointSession` over a fake router client: fakes only for the
engines), plus the session's pin contract, the one loop and the registry."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import pytest
from pydantic import ValidationError

from pinned_eval.datasets.loader import EvalSample
from pinned_eval.datasets.spec import ResolvedDataset
from pinned_eval.fleet.errors import WeightVersionMismatch
from pinned_eval.fleet.generate import check_version
from pinned_eval.fleet.models import GenerateResult
from pinned_eval.prompts import PromptError
from pinned_eval.rollout import (
    ROLLOUTS,
    PointSession,
    Sample,
    Usage,
    register_rollout,
    rollout_kind,
    run_rollouts,
)
from pinned_eval.suite import DatasetSpec, EvalSuite, SamplingDefaults
from tasks.generate import Generation

SUITE = EvalSuite(
    datasets=(
        DatasetSpec(name="add", path="builtin:arith_add.jsonl", max_prompts=3, stop=("\n",)),
        DatasetSpec(
            name="sub", path="builtin:arith_sub.jsonl", max_prompts=2, n_samples_per_prompt=2, temperature=0.7
        ),
    ),
    defaults=SamplingDefaults(temperature=0.0, max_new_tokens=5, reward="exact_match"),
)
DATASETS = SUITE.resolved()


def _rows() -> dict[str, list[EvalSample]]:
    return {
        "add": [EvalSample(i, f"{i}+1=", str(i + 1), {"row": i}) for i in range(3)],
        "sub": [EvalSample(i, f"{i}-0=", i, {}) for i in range(2)],  # an int label keeps its type
    }


WORK = [("add", i, 0) for i in range(3)] + [("sub", i, j) for i in range(2) for j in range(2)]


class FakeRouter:
    """Stands in for `RouterGenerator` (the engines): records every body, answers like an engine
    serving `serving`, and checks the version as the real client does."""

    max_concurrency = 4
    abort_retries = 3

    def __init__(self, serving: str = "7") -> None:
        self.serving = serving
        self.bodies: list[dict[str, Any]] = []

    async def generate(self, body: dict[str, Any], expected_version: str) -> GenerateResult:
        self.bodies.append(body)
        n = len(self.bodies)
        result = GenerateResult.model_validate({
            "text": f"answer-{n}",
            "meta_info": {"finish_reason": {"type": "length" if n % 2 else "stop"}, "prompt_tokens": 10 + n,
                          "completion_tokens": n, "weight_version": self.serving},
        })
        check_version(result, expected_version)
        return result


class RecordingSession(PointSession):
    """A `PointSession` that records each model call a rollout makes, as the rollout made it."""

    def __init__(self, router: FakeRouter, **kw: Any) -> None:
        super().__init__(router, **kw)  # type: ignore[arg-type]
        self.router = router
        self.calls: list[dict[str, Any]] = []

    async def generate(self, prompt: str | None = None, **kw: Any) -> GenerateResult:
        self.calls.append({"prompt": prompt, **kw})
        return await super().generate(prompt, **kw)


def _session(serving: str = "7", lora: str | None = None) -> RecordingSession:
    return RecordingSession(FakeRouter(serving), expected_version="7", rid_prefix="exp42-7", lora=lora)


# ---------------------------------------------------------------------------- the contract, per kind

# kinds that produce these (plain) datasets over the recording session; the `function` kind runs
# user code against a real gateway: tests/fast/test_function_rollout.py, tests/e2e/test_function_fleet.py;
# the `lm_eval` kind runs lm-eval against one: tests/e2e/test_lm_eval_point.py
SEAM_KINDS = sorted(k for k in ROLLOUTS if k not in ("function", "lm_eval"))


@pytest.mark.parametrize("kind", SEAM_KINDS)
async def test_contract_every_sample_comes_through_the_session(kind: str) -> None:
    session, rows = _session(), _rows()
    by_name = {ds.name: ds for ds in DATASETS}
    async with ROLLOUTS[kind].open(session, DATASETS, rows) as produce:
        assert session.calls == [], "opening a kind makes no model call"
        samples = [await produce(by_name[d], rows[d][i], j) for d, i, j in WORK]
    assert [(s.dataset, s.prompt_index, s.sample_index) for s in samples] == WORK
    assert all(isinstance(s, Sample) and s.weight_version == "7" for s in samples)
    assert [(s.label, s.metadata) for s in samples] == [(rows[d][i].label, rows[d][i].metadata) for d, i, _ in WORK]
    assert len(session.calls) >= len(WORK) and session.counters.completed == len(session.router.bodies)
    rids = [b["rid"] for b in session.router.bodies]
    assert len(set(rids)) == len(rids) and all(r.startswith("exp42-7-") for r in rids)


@pytest.mark.parametrize("kind", SEAM_KINDS)
async def test_contract_a_reply_from_other_weights_fails_the_sample(kind: str) -> None:
    session, rows = _session(serving="6"), _rows()
    async with ROLLOUTS[kind].open(session, DATASETS, rows) as produce:
        with pytest.raises(WeightVersionMismatch, match="'7'"):
            await produce(DATASETS[0], rows["add"][0], 0)


@pytest.mark.parametrize("kind", SEAM_KINDS)
async def test_contract_a_row_it_cannot_run_fails_open_before_any_call(kind: str) -> None:
    session, rows = _session(), _rows()
    rows["sub"][1] = EvalSample(1, [{"role": "user", "content": "1-0="}], "1")  # messages, no chat template
    with pytest.raises(PromptError, match=r"^dataset 'sub' row 1: 'prompt' is a message list"):
        async with ROLLOUTS[kind].open(session, DATASETS, rows):
            pass
    assert session.calls == []


def test_registry_refuses_a_second_kind_of_the_same_name() -> None:
    class Again:
        name = "single_turn"

        @asynccontextmanager
        async def open(self, session: PointSession, datasets: Sequence[ResolvedDataset],
                       rows: Mapping[str, Sequence[EvalSample]]):
            yield None

    with pytest.raises(ValueError, match=r"^rollout 'single_turn': already registered \(SingleTurn\)$"):
        register_rollout(Again())
    assert type(ROLLOUTS["single_turn"]).__name__ == "SingleTurn"


def test_every_dataset_has_a_registered_kind() -> None:
    assert {rollout_kind(ds) for ds in DATASETS} == {"single_turn"}
    assert set(ROLLOUTS) == {"single_turn", "function", "lm_eval"}


# ---------------------------------------------------------------------------- single turn, the loop, the session


async def test_run_rollouts_single_turn_requests_and_samples() -> None:
    session, rows = _session(lora="7"), _rows()
    started: list[tuple[int, int]] = []
    done: list[Sample] = []
    out = await run_rollouts(session, DATASETS, rows, on_start=lambda n: started.append((n, len(session.calls))),
                             on_sample=done.append)
    assert started == [(7, 0)], "on_start once, with the total, before the first request"
    assert sorted(done, key=_work_order) == out and len(done) == 7
    assert [(s.dataset, s.prompt_index, s.sample_index) for s in out] == WORK
    bodies = sorted(session.router.bodies, key=lambda b: b["rid"])
    assert [b["rid"] for b in bodies] == sorted(f"exp42-7-{d}-{i}-{j}" for d, i, j in WORK)
    by_rid = {b["rid"]: b for b in bodies}
    assert by_rid["exp42-7-add-2-0"] == {
        "text": "2+1=", "rid": "exp42-7-add-2-0", "lora_path": "7",
        "sampling_params": {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 5, "stop": ["\n"],
                            "sampling_seed": 2000},
    }
    assert by_rid["exp42-7-sub-1-1"]["sampling_params"] == {
        "temperature": 0.7, "top_p": 1.0, "top_k": -1, "max_new_tokens": 5, "sampling_seed": 1001}  # no empty stop
    first = next(s for s in out if (s.dataset, s.prompt_index, s.sample_index) == ("sub", 1, 1))
    n = int(first.response.removeprefix("answer-"))
    assert first == Sample(dataset="sub", prompt_index=1, sample_index=1, prompt="1-0=", label=1, metadata={},
                           response=f"answer-{n}", response_len=n, prompt_tokens=10 + n,
                           finish_reason="length" if n % 2 else "stop", weight_version="7")
    assert (first.messages, first.turns, first.tool_calls, first.status, first.reward, first.usage) == (None,) * 6
    c = session.counters
    assert (c.requests, c.completed, c.prompt_tokens, c.completion_tokens) == (7, 7, 7 * 10 + 28, 28)


def _work_order(s: Sample) -> int:
    return WORK.index((s.dataset, s.prompt_index, s.sample_index))


async def test_run_rollouts_renders_every_prompt_before_any_request() -> None:
    session, rows = _session(), _rows()
    rows["sub"][0] = EvalSample(0, [{"role": "user", "content": "x"}], "1")
    started: list[int] = []
    with pytest.raises(PromptError, match="dataset 'sub' row 0"):
        await run_rollouts(session, DATASETS, rows, on_start=started.append)
    assert session.router.bodies == [] and started == [] and session.counters.requests == 0


async def test_session_counts_a_refused_reply_as_requested_not_completed() -> None:
    session = _session(serving="8")
    with pytest.raises(WeightVersionMismatch):
        await session.generate("1+1=", sampling_params={"max_new_tokens": 2}, rid="add-0-0")
    assert (session.counters.requests, session.counters.completed) == (1, 0)
    assert (session.max_concurrency, session.abort_retries, session.expected_version) == (4, 3, "7")
    assert session.router.bodies == [{"text": "1+1=", "rid": "exp42-7-add-0-0",
                                      "sampling_params": {"max_new_tokens": 2, "temperature": 1.0}}]


def test_generation_is_the_sample_record_for_one_release_and_it_is_frozen() -> None:
    assert Generation is Sample
    sample = Sample(dataset="d", prompt_index=0, sample_index=0, prompt="p", label="l", metadata={}, response="r",
                    response_len=1, finish_reason="stop", weight_version="7")
    with pytest.raises(ValidationError, match="frozen"):
        sample.response = "other"
    assert sample.usage is None and Usage(requests=1).model_dump() == {
        "requests": 1, "prompt_tokens": 0, "completion_tokens": 0}
