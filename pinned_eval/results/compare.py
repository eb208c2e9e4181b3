"""Per-example comparison of two points' samples: which examples flipped, each way.

An example (dataset, example id) is *correct* at a step when the mean reward of its samples is
>= `threshold` (a sample without a reward counts 0). `lost`: correct at A, wrong at B; `gained`:
wrong at A, correct at B. Examples present at only one of the steps are counted in `unmatched`
and never listed as flips. Flips are ordered by example id.

Transcripts (agentic samples, `pinned_eval.results.tables`): for each example matched at both
steps whose first samples both carry a transcript and say different things, `transcripts` says
where they first differ (`pinned_eval.results.transcripts`). Without transcripts (single-turn
points, files written before the columns existed) `transcripts` is empty and neither the text nor
the JSON of `compare` mentions it.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pyarrow as pa
from pydantic import BaseModel, ConfigDict

from pinned_eval.results.transcripts import TranscriptDiff, transcript_diff


class Flip(BaseModel):
    """One example that flipped; responses are each step's first sample."""

    model_config = ConfigDict(frozen=True)

    example_id: int
    prompt: str
    label: str
    response_a: str
    response_b: str
    reward_a: float
    reward_b: float


class DatasetFlips(BaseModel):
    model_config = ConfigDict(frozen=True)

    dataset: str
    examples: int  # matched at both steps
    lost: list[Flip]
    gained: list[Flip]
    unmatched: int
    transcripts: list[TranscriptDiff] = []

    def as_json(self) -> dict[str, Any]:
        """`compare --json`'s object: `transcripts` only when some transcripts differ."""
        return self.model_dump(exclude=set() if self.transcripts else {"transcripts"})


def _by_example(table: pa.Table) -> dict[tuple[str, int], list[dict[str, Any]]]:
    out: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    for r in table.to_pylist():
        out[r["dataset"], r["example_id"]].append(r)
    for samples in out.values():
        samples.sort(key=lambda r: r["sample_index"])
    return out


def _mean_reward(samples: list[dict[str, Any]]) -> float:
    return sum(r["reward"] or 0.0 for r in samples) / len(samples)


def compare_samples(a: pa.Table, b: pa.Table, threshold: float = 1.0) -> list[DatasetFlips]:
    """Flips per dataset (sorted by name) between samples tables `a` and `b`."""
    ea, eb = _by_example(a), _by_example(b)
    out = []
    for ds in sorted({d for d, _ in ea} | {d for d, _ in eb}):
        ids_a = {i for d, i in ea if d == ds}
        ids_b = {i for d, i in eb if d == ds}
        lost: list[Flip] = []
        gained: list[Flip] = []
        diffs: list[TranscriptDiff] = []
        for i in sorted(ids_a & ids_b):
            sa, sb = ea[ds, i], eb[ds, i]
            diff = transcript_diff(i, sa[0], sb[0])
            if diff is not None:
                diffs.append(diff)
            ra, rb = _mean_reward(sa), _mean_reward(sb)
            ok_a, ok_b = ra >= threshold, rb >= threshold
            if ok_a == ok_b:
                continue
            flip = Flip(example_id=i, prompt=sa[0]["prompt"], label=sa[0]["label"], response_a=sa[0]["response"],
                        response_b=sb[0]["response"], reward_a=ra, reward_b=rb)
            (lost if ok_a else gained).append(flip)
        out.append(DatasetFlips(dataset=ds, examples=len(ids_a & ids_b), lost=lost, gained=gained,
                                unmatched=len(ids_a ^ ids_b), transcripts=diffs))
    return out


def format_flips(
    run: str, step_a: int, step_b: int, flips: list[DatasetFlips], width: int = 60, limit: int | None = None
) -> str:
    """The text `pinned-eval compare` prints; `limit`: at most this many flips listed each way."""

    def cut(text: str) -> str:
        one_line = text.replace("\n", "\\n")
        return one_line if len(one_line) <= width else one_line[: width - 1] + "…"

    lines = [f"run {run}: step {step_a} (A) vs step {step_b} (B)"]
    for d in flips:
        lines.append(f"{d.dataset}: {d.examples} examples, {len(d.lost)} correct in A and wrong in B, "
                     f"{len(d.gained)} wrong in A and correct in B" + (f", {d.unmatched} unmatched" if d.unmatched
                                                                       else "")
                     + (f", {len(d.transcripts)} with transcripts that differ" if d.transcripts else ""))
        for title, items in (("correct in A, wrong in B", d.lost), ("wrong in A, correct in B", d.gained)):
            for f in items[:limit]:
                lines.append(f"  [{title}] #{f.example_id} prompt={cut(f.prompt)!r} label={f.label}")
                lines.append(f"      A ({f.reward_a:g}): {cut(f.response_a)!r}")
                lines.append(f"      B ({f.reward_b:g}): {cut(f.response_b)!r}")
        for t in d.transcripts[:limit]:
            lines.append(f"  [transcripts differ] #{t.example_id} first at turn {t.turn}")
            lines.append(f"      A {t.role_a}: {t.excerpt_a!r}")
            lines.append(f"      B {t.role_b}: {t.excerpt_b!r}")
    return "\n".join(lines)
