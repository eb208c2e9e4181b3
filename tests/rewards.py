"""Reward functions used by tests through `custom:tests.rewards:<name>`."""


def explode(response: str, label: str) -> float:
    raise RuntimeError("reward function failed on purpose")


def explode_once(response: str, label: str) -> float:
    """Raise on the first call inside a flow run, score exact match on every later attempt of it.

    The marker is one file per flow-run id, so a run retried in place (same id) passes. Markers
    live in `$PINNED_EVAL_TEST_MARKER_DIR`, else `$PREFECT_HOME/test-markers` (shared by the test
    process and the workers it starts).
    """
    import os
    from pathlib import Path

    from prefect.runtime import flow_run

    root = os.environ.get("PINNED_EVAL_TEST_MARKER_DIR") or os.path.join(os.environ["PREFECT_HOME"], "test-markers")
    marker = Path(root) / f"explode-once-{flow_run.id}"
    marker.parent.mkdir(parents=True, exist_ok=True)
    try:
        marker.touch(exist_ok=False)
    except FileExistsError:
        return float(response.strip() == label.strip())
    raise RuntimeError(f"reward failed on purpose (first attempt of flow run {flow_run.id})")


def slow(response: str, label: str) -> float:
    """Exact match, a second per sample: holds a point in its score phase so a test can kill it there."""
    import time

    time.sleep(1.0)
    return float(response.strip() == label.strip())


def text_parity(response: str, label: str) -> float:
    """1.0 when the response's sha256 starts with an even byte: a reward that two different
    snapshots' generations flip both ways (the comparison tests), deterministic across processes."""
    import hashlib

    return float(hashlib.sha256(response.encode()).digest()[0] % 2 == 0)


async def dapo_dict(args, sample) -> dict:  # type: ignore[no-untyped-def]
    """A miles `async (args, sample)` reward in the shape of miles' dapo: a dict, the scalar under
    `--reward-key score`; reads a search-r1-style object label (`ground_truth`)."""
    truth = sample.label["ground_truth"] if isinstance(sample.label, dict) else sample.label
    acc = sample.response.strip() == str(truth)
    return {"score": 1.0 if acc else -1.0, "acc": acc, "pred": sample.response.strip()}
