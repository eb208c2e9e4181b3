"""The `function` rollout kind: a miles generate function per sample, run in a runner subprocess
against the point's gateway (docs/agentic.md).

Contract:
- `open` starts the point's `PointGateway` (the only model address user code sees) and one
  `AgentRunner` (`pinned_eval.agentic`) for the point; both end when the context exits (the
  runner's process group is stopped: nothing of user code stays running).
- the prompt handed to the function is miles' `Dataset` prompt: with `apply_chat_template` the
  rendered text (tools included, `pinned_eval.prompts`), otherwise the row's prompt as it is (a
  string or a message list); `metadata` holds the row's tools; `label` its JSON value.
- miles' `args` (`pinned_eval.agentic.runner.DEFAULT_ARGS`): the router is the gateway; the
  dataset's reward as `rm_type` / `custom_rm_path`; `hf_checkpoint` the pinned snapshot; the
  dataset's generate-function flags (`generate_max_turns`, ...). `sampling_params` are miles'
  `compute_sampling_params` of the dataset: temperature, top_p, top_k, max_new_tokens, `stop`
  (None when empty), `stop_token_ids` None, `skip_special_tokens` False (so a response keeps its
  EOS text, as miles' does), `no_stop_trim`, `spaces_between_special_tokens` False
  (`MILES_SAMPLING`), plus `sampling_seed` i * 1000 + j. The sample's routing key is `<dataset>-<i>-<j>`, the
  gateway's per-sample key.
- `produce` sends one sample and awaits its `Sample`s: several when the function returns a list
  (multi-agent), each kept as an eval sample as miles does. A reward set during generation is
  kept; the dataset's reward scores the others in the runner (ABORTED ones get none); a dict
  reward counts by its `eval_reward_key or reward_key` entry (`scoring.miles_custom.reward_value`,
  miles' eval rule), anything but a number is `agent_error`; `status`
  is miles' status name and `finish_reason` the one it implies (truncated -> `length`). Each
  sample gets its own gateway session (`session_url`, the agent function's `base_url`); the
  gateway's transcript of the sample (calls made in its session or naming its routing key) is
  kept as `messages` and counted as `turns`; an agent function's sample (miles' hub
  `agentic_tool_call`) takes its response, status and weight versions from that session as miles'
  session server merges it (`pinned_eval.rollout.trajectory`: each turn's output with its EOS text,
  the template's tool turn between); a transcript that cannot be merged so (logged) falls back
  to the last reply.
  Once the runner answers for a sample (its result or its error), its session is closed
  (`DELETE /sessions/{id}` on the gateway) before the transcript is read: a task the user code
  left running can add no call to a finished sample (every later call of it is refused, 404).
- the runner's import roots: the constructor's `python_path`, then the datasets' (`python_path`,
  by default the YAML's directory: the roots the suite-load check used), each checked by
  `pinned_eval.agentic.imports.check_import_roots`; its interpreter the datasets' `miles_python`
  (else this one). A refused root or interpreter is the skip `agent_error`, before anything runs.
- the gateway's limits: the constructor's `limits`, else the datasets' `agent_*` fields (the
  suite's, `gateway_limits`); a sample's deadline `sample_timeout_s`, else its dataset's
  `agent_sample_timeout_s`.
- the gateway's `violation` (a reply of another weight version -> `pin_violation`, a budget ->
  `agent_budget`) fails the point first; any failure of user code (an exception, no result within
  `sample_timeout_s`, the runner dying, e.g. of `memory_bytes`, an output flood) is the skip
  `agent_error` naming the dataset, the sample index and the exception type, and the per-sample
  limit the sample reached at the gateway if it reached one.
This module imports no Prefect.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import httpx

from pinned_eval.agentic.client import AgentError, AgentRunner
from pinned_eval.agentic.imports import check_import_roots, check_interpreter, runner_settings
from pinned_eval.datasets.loader import EvalSample
from pinned_eval.datasets.spec import ResolvedDataset
from pinned_eval.prompts import PromptError, PromptRenderer, load_tokenizer
from pinned_eval.rollout.session import PointSession
from pinned_eval.rollout.single_turn import sampling
from pinned_eval.rollout.trajectory import TrajectoryError, session_response
from pinned_eval.rollout.types import Sample, Usage
from pinned_eval.scoring.answers import RewardTypeError
from pinned_eval.scoring.miles_custom import reward_value
from pinned_eval.skips import EvalSkipped, SkipReason

if TYPE_CHECKING:  # the gateway imports the rollout package (the session): imported where used
    from pinned_eval.gateway import GatewayLimits

log = logging.getLogger(__name__)

__all__ = ["FINISH_OF_STATUS", "FunctionRollout", "dataset_args", "gateway_limits"]

# what miles' `compute_sampling_params` adds to the eval's temperature / top_p / top_k / max_new_tokens
# (`rollout_stop_token_ids`, `rollout_skip_special_tokens` at miles' defaults): the response keeps
# the EOS text as miles' does
MILES_SAMPLING: dict[str, Any] = {"stop_token_ids": None, "skip_special_tokens": False, "no_stop_trim": True,
                                  "spaces_between_special_tokens": False}
FINISH_OF_STATUS = {"completed": "stop", "truncated": "length", "aborted": "abort", "failed": "failed"}


def dataset_args(ds: ResolvedDataset) -> dict[str, Any]:
    """miles' `args` entries of one dataset (reward and generate-function flags)."""
    custom = ds.reward.removeprefix("custom:") if ds.reward.startswith("custom:") else None
    out: dict[str, Any] = {
        "rm_type": None if custom else ds.reward,
        "custom_rm_path": custom,
        "apply_chat_template": ds.apply_chat_template,
        "apply_chat_template_kwargs": dict(ds.apply_chat_template_kwargs),
        "rollout_max_response_len": ds.max_new_tokens,
        "rollout_temperature": ds.temperature,
        "rollout_top_p": ds.top_p,
        "rollout_top_k": ds.top_k,
        "rollout_stop": list(ds.stop) or None,
        "n_samples_per_eval_prompt": ds.n_samples_per_prompt,
        "reward_key": ds.reward_key,
        "eval_reward_key": ds.eval_reward_key,
    }
    for flag in ("generate_max_turns", "generate_tool_specs_path", "generate_tool_call_parser",
                 "generate_execute_tool_function_path", "custom_agent_function_path"):
        if getattr(ds, flag) is not None:
            out[flag] = getattr(ds, flag)
    return out


def gateway_limits(datasets: Sequence[ResolvedDataset]) -> GatewayLimits:
    """The point gateway's limits from the datasets' `agent_*` fields (the suite checks that its
    agentic datasets agree; datasets that disagree here are refused, naming the field)."""
    from pinned_eval.gateway import GatewayLimits

    names = {"max_requests": "agent_max_requests", "max_tokens": "agent_max_tokens",
             "max_turns_per_sample": "agent_max_turns", "max_tokens_per_sample": "agent_max_tokens_per_sample",
             "sample_wall_s": "agent_sample_wall_s"}
    values: dict[str, Any] = {}
    for limit, field in names.items():
        seen = {getattr(ds, field) for ds in datasets}
        if len(seen) > 1:
            raise ValueError(f"{field}: one gateway per point; datasets set {sorted(seen, key=str)}")
        values[limit] = seen.pop() if seen else None
    return GatewayLimits(**values)


class FunctionRollout:
    """miles generate functions (see the module docstring)."""

    name = "function"

    def __init__(
        self,
        limits: GatewayLimits | None = None,
        *,
        sample_timeout_s: float | None = None,
        memory_bytes: int | None = 4 * 1024**3,
        python_path: Sequence[str] = (),
    ) -> None:
        self.limits = limits
        self.sample_timeout_s = sample_timeout_s
        self.memory_bytes = memory_bytes
        self.python_path = list(python_path)

    @asynccontextmanager
    async def open(
        self,
        session: PointSession,
        datasets: Sequence[ResolvedDataset],
        rows: Mapping[str, Sequence[EvalSample]],
    ) -> AsyncIterator[Any]:
        from pinned_eval.gateway import PointGateway

        renderer = PromptRenderer(session.tokenizer_dir)
        prompts = {
            (ds.name, s.index): renderer.render(ds, s).text if ds.apply_chat_template else s.prompt
            for ds in datasets for s in rows[ds.name]
        }
        try:
            roots, python = runner_settings(datasets)
            roots = check_import_roots([*self.python_path, *(r for r in roots if r not in self.python_path)])
            if python is not None:
                check_interpreter(python)
        except ValueError as exc:
            raise EvalSkipped(SkipReason.AGENT_ERROR, f"generate-function runner: {exc}") from None
        async with PointGateway(session, self.limits or gateway_limits(datasets)) as gateway:
            url = urlsplit(gateway.base_url)
            init = {
                "miles_args": {"sglang_router_ip": url.hostname, "sglang_router_port": url.port,
                               "hf_checkpoint": session.tokenizer_dir},
                "gateway": {"base_url": gateway.base_url, "token": gateway.token},
                "python_path": roots,
            }
            async with (AgentRunner(init, memory_bytes=self.memory_bytes, python=python) as runner,
                        httpx.AsyncClient(headers={"Authorization": f"Bearer {gateway.token}"}, timeout=30) as http):

                async def close_session(url: str, where: str) -> None:
                    """The sample is done: no later call of it is admitted (see the module docstring)."""
                    try:
                        reply = await http.delete(url)
                        why = None if reply.status_code == 200 else f"{reply.status_code} {reply.text[:300]}"
                    except httpx.HTTPError as exc:
                        why = f"{type(exc).__name__}: {exc}"
                    if why is not None:
                        raise EvalSkipped(SkipReason.AGENT_ERROR,
                                          f"{where}: the gateway did not close its session: {why}")

                async def produce(ds: ResolvedDataset, row: EvalSample, j: int) -> list[Sample]:
                    key = f"{ds.name}-{row.index}-{j}"
                    where = f"dataset {ds.name!r} sample {row.index} (j={j})"
                    session_url = gateway.open_sample(key)
                    params = {**sampling(ds, seed=row.index * 1000 + j), **MILES_SAMPLING,
                              "stop": list(ds.stop) or None}
                    request = {
                        "function": ds.generate_function,
                        "args": dataset_args(ds),
                        "sample": {
                            "index": row.index * ds.n_samples_per_prompt + j,  # miles: prompt x sample
                            "prompt": prompts[ds.name, row.index],
                            "label": row.label,
                            "metadata": dict(row.metadata),
                            "routing_key": key,
                            "session_url": session_url,
                        },
                        "sampling_params": params,
                        "reward": ds.reward,
                    }
                    try:
                        records = await runner.generate(request, self.sample_timeout_s or ds.agent_sample_timeout_s)
                    except AgentError as exc:
                        await close_session(session_url, where)
                        if gateway.violation is not None:
                            raise gateway.violation from exc
                        breach = gateway.sample_breaches.get(key)
                        why = f" (the sample reached the gateway's {breach})" if breach else ""
                        raise EvalSkipped(
                            SkipReason.AGENT_ERROR,
                            f"dataset {ds.name!r} sample {row.index} (j={j}): {exc.type}: {exc.message}"[:900] + why,
                        ) from None
                    await close_session(session_url, where)
                    if gateway.violation is not None:
                        raise gateway.violation
                    calls = gateway.transcript(key)
                    return [_sample(ds, row, j, rec, calls, session.tokenizer_dir) for rec in records]

                yield produce


def _from_session(ds: ResolvedDataset, where: str, calls: list[dict[str, Any]],
                  tokenizer_dir: str | None) -> dict[str, Any]:
    """An agent function's response, status and weight versions: miles' merged session trajectory
    (`pinned_eval.rollout.trajectory`), else (logged) the last reply."""
    try:
        if tokenizer_dir is None:
            raise TrajectoryError("the point has no tokenizer")
        response, length, merged = session_response(calls, load_tokenizer(tokenizer_dir),
                                                     dict(ds.apply_chat_template_kwargs))
    except (TrajectoryError, PromptError) as exc:
        log.warning("%s: miles' session trajectory not rebuilt (%s); the response is the last reply", where, exc)
        merged = calls[-1:]
        response, length = merged[0].get("text") or "", int(merged[0].get("completion_tokens") or 0)
    return {"response": response, "response_length": length,
            "status": "truncated" if merged[-1].get("finish_reason") == "length" else "completed",
            "weight_versions": [c["weight_version"] for c in merged if c.get("weight_version")]}


def _sample(ds: ResolvedDataset, row: EvalSample, j: int, rec: dict[str, Any], calls: list[dict[str, Any]],
            tokenizer_dir: str | None = None) -> Sample:
    metadata = dict(rec.get("metadata") or {})
    if metadata.pop("from_transcript", False) and calls:  # an agent function: what the fleet answered
        where = f"dataset {ds.name!r} sample {row.index} (j={j})"
        rec = {**rec, **_from_session(ds, where, calls, tokenizer_dir)}
    try:  # miles' eval: reward[eval_reward_key or reward_key] for a dict reward
        reward = reward_value("of the generate function", rec.get("reward"), ds.eval_reward_key or ds.reward_key)
    except RewardTypeError as exc:
        raise EvalSkipped(
            SkipReason.AGENT_ERROR, f"dataset {ds.name!r} sample {row.index} (j={j}): TypeError: {exc}"[:900]
        ) from None
    status = rec.get("status")
    versions = rec.get("weight_versions") or []
    prompt = rec.get("prompt")
    return Sample(
        dataset=ds.name,
        prompt_index=row.index,
        sample_index=j,
        prompt=prompt if isinstance(prompt, str) else str(prompt),
        label=row.label,
        metadata=metadata,
        response=rec.get("response") or "",
        response_len=int(rec.get("response_length") or 0),
        finish_reason=FINISH_OF_STATUS.get(str(status)),
        weight_version=versions[-1] if versions else None,
        status=status,
        reward=reward,
        turns=len(calls),
        messages=calls or None,
        usage=Usage(requests=len(calls)),
    )
