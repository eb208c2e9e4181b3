"""The per-engine verdict of one pin attempt: a load outcome plus what the engine read back.

Contract (`judge_readback`, shared by the full-weight and the adapter-mode read-backs):
- An engine is accepted only when its load succeeded, the read-back answered, it reports the
  expected weight version and model path, and no caller-specific check failed.
- Otherwise `EngineCheck.problem` names every failure, `; `-joined, in that order. Reported values
  are cut in the message: an engine may answer anything.
- A failed read-back reports only the failure: version, path and extra checks are not judged.
"""

from __future__ import annotations

from collections.abc import Sequence

from pinned_eval.fleet.models import EngineCheck, LoadOutcome


def judge_readback(
    load: LoadOutcome,
    *,
    version: str,
    path: str,
    got_version: str | None = None,
    got_path: str | None = None,
    read_error: str | None = None,
    load_label: str = "load",
    path_label: str = "model_path",
    extra_problems: Sequence[str] = (),
) -> EngineCheck:
    """Verdict for one engine: `read_error` (a repr) when the read-back failed, else the values it
    reported (`got_path` already normalised) and any `extra_problems` the caller found in it.

    `load_label` and `path_label` name the load and the path in the messages (adapter mode: the
    adapter load and the base model path)."""
    problems = []
    if not load.ok:
        problems.append(f"{load_label} failed ({load.error}, HTTP {load.status_code}): {load.message[:300]}")
    if read_error is not None:
        problems.append(f"read-back failed: {read_error:.500}")
    else:
        if got_version != version:
            problems.append(f"reads back weight_version {got_version!r:.200}, expected {version!r}")
        if got_path != path:
            problems.append(f"reads back {path_label} {got_path!r:.300}, expected {path!r}")
        problems.extend(extra_problems)
    return EngineCheck(
        url=load.url,
        load=load,
        weight_version=got_version,
        model_path=got_path,
        ok=not problems,
        problem="; ".join(problems),
    )
