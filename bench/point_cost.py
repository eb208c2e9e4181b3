"""Orchestration cost of one real eval point, this tree against a base revision, side by side.

Per checkout (a temporary `git worktree` of the base, alternating rounds: `bench.checkouts`), a
fresh interpreter with `PYTHONPATH` set to that checkout starts a local Prefect server (SQLite),
saves the point's blocks and runs real `eval_point` flow runs in-process: hf source (no export),
one CPU engine behind sglang-router serving a tiny model (one fleet shared by both checkouts),
builtin `arith_add`, 4 prompts, `max_new_tokens` 4. Per point, after one warm-up point:
- `api requests`: HTTP requests to the Prefect API made while the flow ran (every `httpx` send to
  the API URL; log batches, which a background worker posts on a timer, counted apart);
- `task runs`, `artifacts`: read back from the API by the flow run's id;
- `slot 423s`, `slot 503s`: answers to `POST /v2/concurrency_limits/increment-with-lease`. A 423
  is a slot refused because its limit is held (the caller waits the `Retry-After`); a 503 is the
  SQLite server's "database is locked" (the increment's read-then-write transaction lost to a
  concurrent write of the server's own event services), which Prefect's client retries after
  2 s (±jitter), so a point with a 503 takes ~2 s longer; `other 503s`: those of every other call;
- `wall s/point` (noisy), also split by points with and without a 503;
- `s after final state`: from the answer to the flow run's last `set_state` to the return of
  `eval_point(...)`: Prefect's sync flow engine joins its heartbeat thread there, which sleeps
  in 1 s steps (0-1 s).
Requests, task runs and artifacts are exact counts (`a-b`: the range over the points; a 503 adds
one `increment-with-lease` request); the calls whose per-point counts differ between the
checkouts are listed (method and path, ids elided).

`python -m bench point_cost --base REV [--rounds N] [--points N]`
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

_SLOT = "POST /v2/concurrency_limits/increment-with-lease"
_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def _call(method: str, url: str, api_url: str) -> str:
    return f"{method} {_ID.sub('{id}', url[len(api_url):].split('?')[0])}"


def probe(points: int, state_file: str, model: str) -> dict[str, list[Any]]:
    """Runs inside the checkout under test (imports resolve there); JSON of samples on stdout."""
    import httpx
    from prefect import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        FlowRunFilter,
        FlowRunFilterId,
    )

    from app.prefect_server import running_server
    from blocks import EvalSuiteBlock, FleetBlock, SinksBlock, StagingBlock
    from flows.eval_point import eval_point
    from pinned_eval.suite import DatasetSpec, EvalSuite, SamplingDefaults

    suite = EvalSuite(
        datasets=(DatasetSpec(name="arith_add", path="builtin:arith_add.jsonl", max_prompts=4),),
        defaults=SamplingDefaults(temperature=0.0, max_new_tokens=4, n_samples_per_prompt=1, reward="exact_match"),
    )
    calls: list[str] = []
    answers: list[tuple[str, int, float]] = []  # (call, status or 0 when none, time of the answer)
    recording = [False]

    with tempfile.TemporaryDirectory() as tmp, running_server(Path(tmp) / "home") as server:
        api = server.api_url.rstrip("/")

        def sent(request: httpx.Request) -> str | None:
            if not (recording[0] and str(request.url).startswith(api)):
                return None
            calls.append(_call(request.method, str(request.url), api))
            return calls[-1]

        def answered(call: str | None, response: Any) -> None:
            if call is not None:
                answers.append((call, getattr(response, "status_code", 0), time.perf_counter()))

        def wrap(cls: Any, name: str) -> None:
            orig = getattr(cls, name)
            if name == "send" and cls is httpx.AsyncClient:
                async def send(self: Any, request: httpx.Request, *a: Any, **kw: Any) -> Any:
                    call, response = sent(request), None
                    try:
                        response = await orig(self, request, *a, **kw)
                        return response
                    finally:
                        answered(call, response)
            else:
                def send(self: Any, request: httpx.Request, *a: Any, **kw: Any) -> Any:  # type: ignore[misc]
                    call, response = sent(request), None
                    try:
                        response = orig(self, request, *a, **kw)
                        return response
                    finally:
                        answered(call, response)
            setattr(cls, name, send)

        wrap(httpx.AsyncClient, "send")
        wrap(httpx.Client, "send")
        tag = "bench"  # one server per probe: fixed names keep the calls of both checkouts comparable
        staging = Path(tmp) / "staging"
        staging.mkdir()
        EvalSuiteBlock(suite=suite).save(f"suite-{tag}")
        FleetBlock(name=f"f{tag}", mode="launch", state_file=state_file).save(f"fleet-{tag}")
        StagingBlock(root=str(staging), keep_snapshots=0, source_roots=[str(Path(model).parent)]).save(f"staging-{tag}")
        SinksBlock(jsonl_path=str(Path(tmp) / "metrics.jsonl")).save(f"sinks-{tag}")
        params = {kind: f"{kind}-{tag}" for kind in ("suite", "fleet", "staging", "sinks")}
        source = {"kind": "hf", "path": model, "require_marker": False}
        out: dict[str, list[Any]] = {"wall": [], "requests": [], "logs": [], "task_runs": [], "artifacts": [],
                                     "calls": [], "locked": [], "busy": [], "other_busy": [], "end_wait": []}
        for step in range(points + 1):  # step 0: warm-up (imports, limit creation, first client)
            calls.clear()
            answers.clear()
            recording[0] = True
            t0 = time.perf_counter()
            state = eval_point(run="pc", step=step, source=source, **params, return_state=True)
            returned = time.perf_counter()
            wall = returned - t0
            recording[0] = False
            if state.name != "Completed":
                raise SystemExit(f"point {step}: {state.name}: {state.message}")
            frid = state.state_details.flow_run_id
            with get_client(sync_client=True) as c:
                # task runs are recorded server-side from events: read until every one is final
                # and two reads 0.5 s apart agree
                deadline, last = time.monotonic() + 60, -1
                while True:
                    runs = c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[frid])))
                    final = all(r.state is not None and r.state.is_final() for r in runs)
                    if (final and len(runs) == last) or time.monotonic() > deadline:
                        break
                    last = len(runs) if final else -1
                    time.sleep(0.5)
                by_run = ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[frid]))
                arts = c.read_artifacts(artifact_filter=by_run)
            if step == 0:
                continue
            logs = [x for x in calls if x.startswith("POST /logs")]
            out["wall"].append(wall)
            out["requests"].append(len(calls) - len(logs))
            out["logs"].append(len(logs))
            out["task_runs"].append(len(runs))
            out["artifacts"].append(len(arts))
            out["calls"].append(dict(Counter(x for x in calls if not x.startswith("POST /logs"))))
            out["locked"].append(sum(1 for c, status, _ in answers if c == _SLOT and status == 423))
            out["busy"].append(sum(1 for c, status, _ in answers if c == _SLOT and status == 503))
            out["other_busy"].append(sum(1 for c, status, _ in answers if c != _SLOT and status == 503))
            final = [at for c, _, at in answers if c == "POST /flow_runs/{id}/set_state"][-1]
            out["end_wait"].append(returned - final)
    return out


def _one(values: list[int]) -> str:
    """An exact count: the value if all agree, else `min-max`."""
    return str(values[0]) if len(set(values)) == 1 else f"{min(values)}-{max(values)}"


def _seen(per_point: list[dict[str, int]], call: str) -> str:
    """The counts of `call` seen in a point (0 where absent), e.g. `2` or `2-3`."""
    return _one([counts.get(call, 0) for counts in per_point])


def _ratio(after: float, before: float) -> str:
    return f"{after / before:>8.2f}" if before else f"{'-':>8}"


def _median(values: list[float]) -> str:
    return f"{statistics.median(values):.2f}" if values else "-"


def table(samples: dict[str, dict[str, list[Any]]], base: str) -> list[str]:
    """The printed comparison: one row per measure, base vs this tree with the ratio of medians."""
    b, a = samples["base"], samples["this tree"]
    lines = [f"base {base} vs this tree; {len(a['wall'])} points each",
             f"{'measure':<26}{'base':>10}{'this tree':>12}{'ratio':>8}"]
    for name, key in (("api requests/point", "requests"), ("task runs/point", "task_runs"),
                      ("artifacts/point", "artifacts"), ("log posts/point", "logs"),
                      ("slot 423s/point", "locked"), ("slot 503s/point", "busy"),
                      ("other 503s/point", "other_busy")):
        ratio = _ratio(statistics.median(a[key]), statistics.median(b[key]))
        lines.append(f"{name:<26}{_one(b[key]):>10}{_one(a[key]):>12}{ratio}")
    for name, key in (("wall s/point (median)", "wall"), ("s after final state (med.)", "end_wait")):
        wb, wa = statistics.median(b[key]), statistics.median(a[key])
        lines.append(f"{name:<26}{wb:>10.2f}{wa:>12.2f}{_ratio(wa, wb)}")
    for name, busy in (("wall s, no 503 (median)", False), ("wall s, a 503 (median)", True)):
        split = [[w for w, n in zip(side["wall"], side["busy"], strict=True) if (n > 0) == busy] for side in (b, a)]
        lines.append(f"{name:<26}{_median(split[0]):>10}{_median(split[1]):>12}"
                     f"  ({len(split[0])} and {len(split[1])} points)")
    for call in sorted({c for side in (b, a) for per_point in side["calls"] for c in per_point}):
        seen_b, seen_a = _seen(b["calls"], call), _seen(a["calls"], call)
        if seen_b != seen_a:
            lines.append(f"  differs: {call}: {seen_b} -> {seen_a}")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench point_cost")
    parser.add_argument("--base", required=True, help="git revision to compare against")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--points", type=int, default=3, help="points per round and checkout (after a warm-up)")
    args = parser.parse_args(argv or [])
    from bench.checkouts import alternate, run_probe
    from engine.tiny_model import make_tiny_model
    from pinned_eval.fleet.launcher import launch_cpu_fleet

    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "models" / "tiny")
        fleet = launch_cpu_fleet(model, 1, state_file=Path(tmp) / "fleet.json", ready_timeout_s=180)
        try:
            script, probe_args = Path(__file__), [str(args.points), str(Path(tmp) / "fleet.json"), str(model)]
            samples = alternate(args.base, args.rounds, lambda co: run_probe(co, script, probe_args))
        finally:
            fleet.stop()
    print("\n".join(table(samples, args.base)))
    print(f"load average (1 min) at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--probe"]:
        print(json.dumps(probe(int(sys.argv[2]), sys.argv[3], sys.argv[4])))
    else:
        main(sys.argv[1:])
