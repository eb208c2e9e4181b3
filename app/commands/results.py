"""`pinned-eval compare|rescore`: read a run's stored samples (the sinks block's results store).

- `compare RUN STEP_A STEP_B`: per dataset, the examples that flipped each way between the two
  points (`pinned_eval.results.compare`), with their prompts and responses, and for agentic samples
  where two steps' transcripts first differ.
- `rescore RUN STEP`: score the point's stored generations again with the suite block's current
  rewards (no fleet, no engine request; a reward an agentic rollout set itself is kept), rewrite
  its samples file (marked rescored) and replace its JSONL rows: the new `eval/<ds>...` metrics,
  the point's other metrics (step, lag, duration) as they were, and `eval/rescored: 1`.

Exit codes: 0 success; 1 nothing stored for the point (or no results store configured), or
Prefect unreachable; 2 bad input (a suite without the stored datasets, a `custom:` reward whose
module cannot be imported here — it must be on PYTHONPATH or installed — or a bad option value).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Any

import typer

from app.commands._cli import STEP, fail, in_words
from app.commands.points import prefect_client

if TYPE_CHECKING:
    from app.history import RunHistory
    from blocks import EvalSuiteBlock, SinksBlock
    from pinned_eval.results.store import ResultsStore

RunArg = Annotated[str, typer.Argument(help="Training run name, e.g. exp42.")]
SinksOpt = Annotated[str, typer.Option("--sinks", help="Sinks block whose results_root holds the samples.")]
RESCORED = "eval/rescored"


def _store(sinks: SinksBlock) -> ResultsStore:
    store = sinks.results_store()
    if store is None:
        fail("--sinks: the sinks block sets no results_root; no samples are stored")
    return store


def compare(
    run: RunArg,
    step_a: Annotated[int, typer.Argument(parser=STEP, help="Step A (the earlier point, usually).")],
    step_b: Annotated[int, typer.Argument(parser=STEP, help="Step B.")],
    sinks: SinksOpt = "default",
    threshold: Annotated[
        float, typer.Option("--threshold", help="An example is correct when its mean reward is >= this.")
    ] = 1.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print the flips as JSON.")] = False,
) -> None:
    """Examples that flipped between two points: correct in A and wrong in B, and the reverse."""
    from blocks import SinksBlock
    from blocks._meta import load_block
    from pinned_eval.results.compare import compare_samples, format_flips
    from pinned_eval.results.store import SAMPLES

    with prefect_client():
        store = _store(load_block(SinksBlock, sinks))
    try:
        a, b = store.read(run, step_a, SAMPLES), store.read(run, step_b, SAMPLES)
    except (FileNotFoundError, ValueError) as exc:  # absent, another point's, or not this user's alone
        fail(str(exc))
    flips = compare_samples(a, b, threshold)
    if as_json:
        typer.echo(json.dumps([f.as_json() for f in flips], indent=2))
    else:
        typer.echo(format_flips(run, step_a, step_b, flips))


def rescore(
    run: RunArg,
    step: Annotated[int, typer.Argument(parser=STEP, help="Step of the point.")],
    suite: Annotated[str, typer.Option("--suite", help="Suite block whose rewards score the samples.")] = "default",
    sinks: SinksOpt = "default",
) -> None:
    """Re-score a point's stored generations with the suite's current rewards; no fleet needed."""
    from blocks import EvalSuiteBlock, SinksBlock
    from blocks._meta import load_block

    with prefect_client():
        suite_block, sinks_block = load_block(EvalSuiteBlock, suite), load_block(SinksBlock, sinks)
        metrics = rescore_point(run, step, suite_block, sinks_block)
    for ds, m in sorted(metrics.items()):
        typer.echo(f"{ds}: eval/{ds}={m[f'eval/{ds}']:.4f} (rescored)")


def rescore_point(run: str, step: int, suite: EvalSuiteBlock, sinks: SinksBlock) -> dict[str, dict[str, float]]:
    """Score the stored generations of (run, step) again; returns the new metrics per dataset."""
    from pinned_eval.results.store import GENERATIONS
    from pinned_eval.results.tables import generation_fields, table_key
    from pinned_eval.sinks import Ledger, MetricRow
    from tasks.generate import Generation
    from tasks.results import write_samples
    from tasks.score import score_generations

    store = _store(sinks)
    try:
        table = store.read(run, step, GENERATIONS)
    except (FileNotFoundError, ValueError) as exc:  # absent, another point's, or not this user's alone
        fail(str(exc))
    gens = [Generation(**generation_fields(r)) for r in table.to_pylist()]
    stored = {g.dataset for g in gens}
    datasets = [ds for ds in suite.resolved() if ds.name in stored]
    if {ds.name for ds in datasets} != stored:
        missing = sorted(stored - {ds.name for ds in datasets})
        fail(f"--suite: suite block {suite._block_document_name!r} has no dataset {', '.join(missing)} "
             f"(stored for {run} step {step})", 2)
    check_custom_rewards(datasets)
    per_ds, _, rewards = score_generations(gens, datasets, suite.suite, step)
    write_samples(store, run, step, gens, rewards, table_key(table), rescored=True, link=False)
    if sinks.jsonl_path:
        jsonl = Ledger(sinks.jsonl_path)
        old = [r for r in jsonl.read(run) if r.step == step]
        point = {"eval/step": float(step)}
        for r in old:
            if r.state == "measured" and r.dataset is not None:
                own = (f"eval/{r.dataset}", "eval/sink_")
                point.update({k: v for k, v in r.metrics.items() if not k.startswith(own)})
        rows = [
            MetricRow(run=run, step=step, dataset=ds, state="measured", weight_version=str(step),
                      metrics={**point, **m, RESCORED: 1.0})
            for ds, m in per_ds.items()
        ]
        jsonl.write_point(rows)
    return per_ds


CUSTOM_HINT = ("a custom reward's module must be importable by this command's Python and the worker's: "
               "installed in the environment, or in a directory on PYTHONPATH when the command starts "
               "(e.g. `PYTHONPATH=$PWD pinned-eval worker`; docs/blocks.md, Rewards)")


def check_custom_rewards(datasets: list[Any]) -> None:
    """Exit 2 naming the dataset when a `custom:` reward cannot be imported here (`CUSTOM_HINT`)."""
    from pinned_eval.scoring.rewards import CUSTOM_PREFIX, get_reward

    for ds in datasets:
        if str(ds.reward).startswith(CUSTOM_PREFIX):
            try:
                get_reward(ds.reward)
            except (ValueError, ImportError) as exc:
                fail(f"--suite: dataset {ds.name!r}: {in_words(exc)}; {CUSTOM_HINT}", 2)


def last_two_compared(history: RunHistory, sinks: str) -> str:
    """The report's comparison section (`app.report.comparison_html`) between the last two measured
    steps of `history` that have samples in the sinks block's results store ("" when fewer than two)."""
    from app.report import comparison_html
    from blocks import SinksBlock
    from blocks._meta import load_block
    from pinned_eval.results.compare import compare_samples
    from pinned_eval.results.store import SAMPLES

    store = _store(load_block(SinksBlock, sinks))
    try:  # a stored file refused (another point's, not this user's alone): one line, like `compare`
        steps = [p.step for p in history.points
                 if p.outcome == "measured" and store.exists(history.run, p.step, SAMPLES)]
        if len(steps) < 2:
            return ""
        a, b = steps[-2:]
        flips = compare_samples(store.read(history.run, a, SAMPLES), store.read(history.run, b, SAMPLES))
    except (FileNotFoundError, ValueError) as exc:  # ResultsKeyError, UntrustedPathError are ValueErrors
        fail(f"--sinks: {exc}")
    return comparison_html(a, b, flips)


def demo_summary(run: str, step_a: int, step_b: int, sinks: str = "default", limit: int = 3) -> list[str]:
    """What the demo prints at its end (call with the Prefect API configured): the flips between
    two measured steps (at most `limit` listed each way) and where step B's samples file is;
    [] when the sinks block keeps no samples or a step has none; one line "samples not compared: ..."
    when the store refuses a file (another point's, or a path not this user's alone)."""
    from blocks import SinksBlock
    from blocks._meta import load_block
    from pinned_eval.results.compare import compare_samples, format_flips
    from pinned_eval.results.store import SAMPLES

    store = load_block(SinksBlock, sinks).results_store()
    try:
        if store is None or not (store.exists(run, step_a, SAMPLES) and store.exists(run, step_b, SAMPLES)):
            return []
        flips = compare_samples(store.read(run, step_a, SAMPLES), store.read(run, step_b, SAMPLES))
    except (FileNotFoundError, ValueError) as exc:  # ResultsKeyError, UntrustedPathError are ValueErrors
        return [f"samples not compared: {exc}"]
    return [*format_flips(run, step_a, step_b, flips, limit=limit).splitlines(),
            f"samples of step {step_b}: {store.url(run, step_b, SAMPLES)}"]
