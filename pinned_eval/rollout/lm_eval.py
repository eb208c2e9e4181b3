"""The `lm_eval` rollout kind: a dataset of lm-eval tasks, run by lm-eval's own `simple_evaluate`
against the point's gateway (docs/harnesses.md).

Contract:
- `open` starts a `PointGateway` on the point's session (limits: the constructor's, else the
  datasets' `agent_*` fields) and, per dataset, one `python -m pinned_eval.harness.lm_eval_child`
  subprocess, all at once; both end when the context exits (the child's process group is stopped).
- the child runs lm-eval's `local-completions` (or `local-chat-completions`) model with
  `base_url` = the gateway's `/v1/completions` (`/v1/chat/completions`), `model: default`,
  `tokenized_requests: False` (text prompts: the router refuses token ids on `/v1/completions`),
  the pinned snapshot's tokenizer (loglikelihood context lengths), `num_concurrent` = the
  session's bound, `max_retries: 1`; the gateway's token as `OPENAI_API_KEY` (what lm-eval sends);
  `HF_DATASETS_OFFLINE=1`, `HF_HUB_OFFLINE=1` and a private, per-run `HF_DATASETS_CACHE` (nothing is
  downloaded, no cache is shared); its working directory is `task_dir` (relative `data_files`
  resolve there). `max_prompts` is lm-eval's `limit`, `num_fewshot` its `num_fewshot`.
- so every request lm-eval makes is version-checked, counted in the point's budget and recorded
  by the gateway (`calls`); a reply of another weight version or a used-up budget fails the
  point with the gateway's `violation` (`pin_violation`, `agent_budget`); a child that fails
  (an unknown task, lm-eval raising, no result within `timeout_s`) is the skip `harness_error`
  naming the dataset and the child's last stderr line.
- rows are one per named task (`pinned_eval.datasets.loader`); `produce(ds, row, 0)` is that
  task's samples, one per lm-eval document in lm-eval's order (`j > 0`: none; lm-eval's own
  repeats apply); a named group's row holds the samples of every task under it (nested groups
  too, in lm-eval's `group_subtasks` order), a named tag's those of its tasks. A sample's
  `prompt_index` runs over the rows' samples in order; `prompt` is its first
  request's context (chat: lm-eval's messages as a JSON string); its `response` is
  lm-eval's filtered response (a generation's text; loglikelihood results as JSON); `reward` is
  its first metric's value; `metadata` holds `lm_eval_task`, lm-eval's per-sample record
  (`lm_eval`: doc, arguments, resps, filtered_resps, the metric values) and the task's results as
  lm-eval reported them (`lm_eval_results`, read by `lm_eval_metrics`); the first sample of a
  group's row also holds lm-eval's `groups` entries of that group and of the groups nested in it
  (`lm_eval_groups`); `weight_version` is the pinned version when every answered call of the
  gateway carried it.
- `lm_eval_metrics(samples)`: `eval/<task>/<metric>` for each numeric entry of lm-eval's results
  (`<metric>,none` -> `<metric>`, `<metric>,<filter>` -> `<metric>/<filter>`; its stderr is lm-eval's
  `<metric>_stderr`), and `eval/<group>/<metric>` alike for each group lm-eval aggregated (its
  `groups` entry: the `aggregate_metric_list` metrics, by size or not as the group says); a stderr
  lm-eval gives as `N/A` is left out.
This module imports no Prefect (and no lm-eval: only the child does).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import tempfile
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pinned_eval.datasets.loader import EvalSample
from pinned_eval.datasets.spec import ResolvedDataset
from pinned_eval.processes import pipe_child_options, stop_groups
from pinned_eval.rollout.session import PointSession
from pinned_eval.rollout.types import Sample
from pinned_eval.skips import EvalSkipped, SkipReason

if TYPE_CHECKING:  # the gateway imports the rollout package (the session): imported where used
    from pinned_eval.gateway import GatewayLimits, PointGateway

__all__ = ["LmEvalRollout", "child_env", "child_request", "lm_eval_metrics", "model_args"]

_STDERR_TAIL = 8192
_ROUTES = {"local-completions": "/v1/completions", "local-chat-completions": "/v1/chat/completions"}


def model_args(model: str, base_url: str, tokenizer_dir: str | None, num_concurrent: int) -> dict[str, Any]:
    """lm-eval's `model_args` for `model` against the OpenAI-compatible server at `base_url`."""
    args: dict[str, Any] = {"model": "default", "base_url": base_url + _ROUTES[model],
                            "num_concurrent": num_concurrent, "max_retries": 1}
    if model == "local-completions":
        args |= {"tokenizer_backend": "huggingface", "tokenizer": tokenizer_dir, "tokenized_requests": False}
    return args


def child_request(
    ds: ResolvedDataset, base_url: str, tokenizer_dir: str | None, num_concurrent: int, out: Path
) -> dict[str, Any]:
    """The child's request for `ds` (`pinned_eval.harness.lm_eval_child`): `max_prompts` is lm-eval's
    `limit`, `task_dir` its `include_path`."""
    return {
        "model": ds.lm_eval_model,
        "model_args": model_args(ds.lm_eval_model, base_url, tokenizer_dir, num_concurrent),
        "tasks": list(ds.tasks),
        "include_path": str(ds.task_dir) if ds.task_dir is not None else None,
        "limit": ds.max_prompts,
        "num_fewshot": ds.num_fewshot,
        "out": str(out),
    }


def child_env(token: str, tmp: Path) -> dict[str, str]:
    """The child's environment: the worker's, plus the gateway's token as lm-eval's API key, offline
    Hugging Face libraries and a datasets cache of its own under `tmp`."""
    return {**os.environ, "OPENAI_API_KEY": token, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_CACHE": str(tmp / "hf-datasets"), "TOKENIZERS_PARALLELISM": "false"}


class LmEvalRollout:
    """lm-eval tasks as a dataset (see the module docstring)."""

    name = "lm_eval"

    def __init__(
        self, limits: GatewayLimits | None = None, *, timeout_s: float | None = None,
        memory_bytes: int | None = 8 * 1024**3,
    ) -> None:
        self.limits = limits
        self.timeout_s = timeout_s
        self.memory_bytes = memory_bytes

    @asynccontextmanager
    async def open(
        self, session: PointSession, datasets: Sequence[ResolvedDataset], rows: Mapping[str, Sequence[EvalSample]],
    ) -> AsyncIterator[Any]:
        from pinned_eval.gateway import PointGateway
        from pinned_eval.rollout.function import gateway_limits

        async with PointGateway(session, self.limits or gateway_limits(datasets)) as gateway:
            runs = {ds.name: asyncio.create_task(self._run(gateway, session, ds)) for ds in datasets}
            try:

                async def produce(ds: ResolvedDataset, row: EvalSample, j: int) -> list[Sample]:
                    if j > 0:
                        return []
                    by_task = await asyncio.shield(runs[ds.name])
                    return by_task[str(row.prompt)]

                yield produce
            finally:
                for task in runs.values():
                    task.cancel()
                for task in runs.values():
                    with contextlib.suppress(BaseException):
                        await task

    async def _run(self, gateway: PointGateway, session: PointSession, ds: ResolvedDataset) -> dict[str, list[Sample]]:
        with tempfile.TemporaryDirectory(prefix="pe-lm-eval-") as tmp:  # 0700: this user's only
            out = Path(tmp) / "result.json"
            request = child_request(ds, gateway.base_url, session.tokenizer_dir, session.max_concurrency, out)
            code, tail = await self._child(request, child_env(gateway.token, Path(tmp)), str(ds.task_dir or tmp))
            if gateway.violation is not None:
                raise gateway.violation
            if code != 0:
                last = (tail.strip().splitlines() or ["(no output)"])[-1]
                raise EvalSkipped(SkipReason.HARNESS_ERROR,
                                  f"dataset {ds.name!r}: lm-eval failed (exit {code}): {last}"[:900])
            result = json.loads(out.read_text(encoding="utf-8"))
        versions = {c.weight_version for c in gateway.calls if c.status == 200 and c.route != "/v1/models"}
        version = session.expected_version if versions == {session.expected_version} else None
        return _samples(ds, result, version)

    async def _child(self, request: dict[str, Any], env: dict[str, str], cwd: str) -> tuple[int, str]:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "pinned_eval.harness.lm_eval_child",
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
            cwd=cwd, env=env, **pipe_child_options(memory_bytes=self.memory_bytes),  # type: ignore[arg-type]
        )
        tail = b""

        async def drain() -> None:
            nonlocal tail
            assert proc.stderr is not None
            while chunk := await proc.stderr.read(65536):
                tail = (tail + chunk)[-_STDERR_TAIL:]

        try:
            assert proc.stdin is not None
            proc.stdin.write(json.dumps(request).encode())
            proc.stdin.close()
            try:
                async with asyncio.timeout(self.timeout_s):
                    await asyncio.gather(drain(), proc.wait())
            except TimeoutError:
                return -1, f"no result within {self.timeout_s} s"
        finally:
            if proc.returncode is None:
                await asyncio.to_thread(stop_groups, [proc.pid], grace_s=2.0)
                with contextlib.suppress(ProcessLookupError):
                    await proc.wait()
        return proc.returncode or 0, tail.decode("utf-8", "replace")


def _samples(ds: ResolvedDataset, result: dict[str, Any], version: str | None) -> dict[str, list[Sample]]:
    out: dict[str, list[Sample]] = {}
    index = 0
    subtasks: dict[str, list[str]] = result.get("group_subtasks") or {}
    tags: dict[str, list[str]] = result.get("tags") or {}
    groups: dict[str, Any] = result.get("groups") or {}
    for name in ds.tasks:
        out[name] = []
        leaves, nested = _expand(name, subtasks, tags)
        for task in leaves:
            results = result["results"].get(task, {})
            for rec in result["samples"].get(task, []):
                out[name].append(_sample(ds, rec, task, results, index, version))
                index += 1
        carried = {g: groups[g] for g in nested if g in groups}
        if carried and out[name]:
            first = out[name][0]
            out[name][0] = first.model_copy(update={"metadata": {**first.metadata, "lm_eval_groups": carried}})
    return out


def _expand(name: str, subtasks: Mapping[str, list[str]], tags: Mapping[str, list[str]]) -> tuple[list[str], list[str]]:
    """The tasks under `name` (itself when a task) and the groups it is or holds, in lm-eval's order."""
    if name in tags:
        return list(tags[name]), []
    if name not in subtasks:
        return [name], []
    leaves, nested = [], [name]
    for child in subtasks[name]:
        more, inner = _expand(child, subtasks, {})
        leaves += more
        nested += inner
    return leaves, nested


def _sample(ds: ResolvedDataset, rec: dict[str, Any], task: str, results: Any, index: int,
            version: str | None) -> Sample:
    names = rec.get("metrics") or []
    values = [rec.get(m) for m in names]
    reward = next((float(v) for v in values if isinstance(v, int | float) and not isinstance(v, bool)), None)
    filtered = rec.get("filtered_resps")
    response = filtered[0] if isinstance(filtered, list) and filtered and isinstance(filtered[0], str) \
        else json.dumps(filtered)
    target = rec.get("target")
    return Sample(
        dataset=ds.name, prompt_index=index, sample_index=0,
        prompt=_prompt(rec.get("arguments")),
        label=target if isinstance(target, str | int | float) and not isinstance(target, bool)
        else json.dumps(target),
        metadata={"lm_eval_task": task, "lm_eval": rec, "lm_eval_results": results},
        response=response, response_len=0, finish_reason=None, weight_version=version,
        status="completed", reward=0.0 if reward is None else reward,
    )


def _prompt(arguments: Any) -> str:
    """The first request's context: a string, or (chat) lm-eval's JSON messages string in a 1-tuple."""
    first = arguments[0][0] if isinstance(arguments, list) and arguments and isinstance(arguments[0], list) \
        and arguments[0] else ""
    while isinstance(first, list) and first:
        first = first[0]
    return first if isinstance(first, str) else json.dumps(first)


def lm_eval_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    """`eval/<task>/<metric>` and `eval/<group>/<metric>` from lm-eval's results carried by `samples`
    (see the module docstring)."""
    out: dict[str, float] = {}
    for s in samples:
        task, results = s.metadata.get("lm_eval_task"), s.metadata.get("lm_eval_results")
        if isinstance(task, str) and isinstance(results, dict):
            out.update(_numbers(task, results))
        groups = s.metadata.get("lm_eval_groups")
        for group, aggregates in (groups.items() if isinstance(groups, dict) else ()):
            if isinstance(group, str) and isinstance(aggregates, dict):
                out.update(_numbers(group, aggregates))
    return out


def _numbers(name: str, results: dict[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for key, value in results.items():
        if "," not in key or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        metric, _, flt = key.partition(",")
        out[f"eval/{name}/{metric}" + ("" if flt == "none" else f"/{flt}")] = float(value)
    return out
