"""The watch evaluator: a scheduled flow that turns a trainer's checkpoint directory into eval points.

Each tick lists `root` (a local directory or `s3://bucket/prefix`, through fsspec) for
checkpoint directories whose name ends in a step number (`step_120`, `iter_0000120`,
`ckpt-120`). A checkpoint is ready when it holds `.complete`, or — opt-in, for trainers that
write no marker — when its newest file is older than `quiescence_seconds` (the point then checks
it without the marker). Ready steps at or above `min_step` are requested as `hf` points (the
directory is the trainer's: read, never deleted): `catch_up="all"` requests every one,
`"latest"` only the newest.

Idempotent with no local ledger: Prefect is the ledger. A step that already has a flow run of
the run (tagged `run:<run>` or not started yet) is not requested again, and a request is the
event with id uuid5(run, step), which the server de-duplicates; so overlapping ticks, reruns
and a restarted watcher give one point per step.
"""

from __future__ import annotations

import re
import time
from typing import Any, Literal

from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact
from prefect.settings import PREFECT_API_URL
from pydantic import BaseModel, ConfigDict

from blocks import StagingBlock
from blocks._meta import load_block
from pinned_eval.events import BlockNames, point_event
from pinned_eval.points import (
    PointRequest,
    Posture,
    SnapshotSource,
    SourceKind,
    check_run_name,
    history_artifact_key,
)
from pinned_eval.settings import PrefectApiSettings
from pinned_eval.snapshot.layout import MARKER, file_mtime, join, resolve, to_url
from trainer_integration.rest import PrefectRest, api_client

_TRAILING_STEP = re.compile(r"^(?:.*?[^0-9])?(\d+)$")
WatchAction = Literal["requested", "exists", "not_ready", "below_min_step", "not_latest"]


class Checkpoint(BaseModel):
    model_config = ConfigDict(frozen=True)

    step: int
    url: str
    marked: bool  # holds `.complete`
    newest_mtime: float  # epoch seconds of its newest file (0 when empty)


class WatchDecision(BaseModel):
    model_config = ConfigDict(frozen=True)

    step: int
    url: str
    action: WatchAction


def step_of(name: str) -> int | None:
    """The trailing step number of a checkpoint directory name, or None."""
    m = _TRAILING_STEP.match(name)
    return int(m.group(1)) if m else None


def scan(root: str, storage_options: dict[str, Any] | None = None) -> list[Checkpoint]:
    """Every directory under `root` named with a trailing step, lowest step first."""
    fs, path = resolve(root, storage_options)
    try:
        entries = fs.ls(path, detail=True)
    except FileNotFoundError:
        return []
    found: dict[int, Checkpoint] = {}
    for entry in entries:
        name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
        step = step_of(name)
        if entry["type"] != "directory" or step is None:
            continue
        fs_path = join(fs, path, name)
        files = [f for f in fs.ls(fs_path, detail=True) if f["type"] == "file"]
        names = {f["name"].rstrip("/").rsplit("/", 1)[-1] for f in files}
        ckpt = Checkpoint(
            step=step,
            url=to_url(fs, fs_path),
            marked=MARKER in names,
            newest_mtime=max((file_mtime(f) for f in files), default=0.0),
        )
        # two names for one step (step_120 and iter_120): the marked, then the newest wins
        prev = found.get(step)
        if prev is None or (ckpt.marked, ckpt.newest_mtime) > (prev.marked, prev.newest_mtime):
            found[step] = ckpt
    return [found[s] for s in sorted(found)]


def decide(
    checkpoints: list[Checkpoint],
    existing_steps: set[int],
    *,
    catch_up: Literal["all", "latest"],
    min_step: int,
    quiescence_seconds: float | None,
    now: float,
) -> list[WatchDecision]:
    """What a tick does with each checkpoint (pure: the scan and Prefect's runs in, actions out)."""

    def ready(c: Checkpoint) -> bool:
        if c.marked:
            return True
        return quiescence_seconds is not None and c.newest_mtime > 0 and now - c.newest_mtime >= quiescence_seconds

    ready_steps = [c.step for c in checkpoints if ready(c) and c.step >= min_step]
    latest = max(ready_steps, default=None)
    out = []
    for c in checkpoints:
        action: WatchAction
        if c.step < min_step:
            action = "below_min_step"
        elif not ready(c):
            action = "not_ready"
        elif c.step in existing_steps:
            action = "exists"
        elif catch_up == "latest" and c.step != latest:
            action = "not_latest"
        else:
            action = "requested"
        out.append(WatchDecision(step=c.step, url=c.url, action=action))
    return out


@flow(name="watch-checkpoints", flow_run_name="watch-{run}")
def watch_checkpoints(
    run: str,
    root: str,
    catch_up: Literal["all", "latest"] = "all",
    min_step: int = 0,
    quiescence_seconds: float | None = None,
    storage_block: str | None = None,
    policy: Literal["backpressure", "skip"] = "backpressure",
    max_in_flight: int = 2,
    suite: str = "default",
    fleet: str = "default",
    staging: str = "default",
    sinks: str = "default",
) -> list[WatchDecision]:
    """One tick: request an eval point for every new ready checkpoint under `root`.

    An `s3://` root is listed with the endpoint and credentials of the StagingBlock
    `storage_block` (default: the points' `staging` block, which their checks read it with).
    """
    try:
        check_run_name(run)
    except ValueError as exc:
        raise ValueError(f"run: {exc}") from None
    if min_step < 0:
        raise ValueError(f"min_step: must be >= 0, got {min_step}")
    if quiescence_seconds is not None and quiescence_seconds <= 0:
        raise ValueError(f"quiescence_seconds: must be > 0, got {quiescence_seconds}")
    logger = get_run_logger()
    options: dict[str, Any] = {}
    if root.startswith(("s3://", "s3a://")):  # the points read it with the same block's credentials
        options = load_block(StagingBlock, storage_block or staging).s3_options()
    checkpoints = scan(root, options)
    blocks = BlockNames(suite=suite, fleet=fleet, staging=staging, sinks=sinks)

    api_url = str(PREFECT_API_URL.value())
    with api_client(PrefectApiSettings()) as http:
        rest = PrefectRest(api_url, http)
        existing = {r.step for r in rest.point_runs(run)}
        decisions = decide(
            checkpoints,
            existing,
            catch_up=catch_up,
            min_step=min_step,
            quiescence_seconds=quiescence_seconds,
            now=time.time(),
        )
        events = []
        for d, c in zip(decisions, checkpoints, strict=True):
            if d.action != "requested":
                continue
            source = SnapshotSource(kind=SourceKind.HF, path=c.url, require_marker=c.marked)
            req = PointRequest(
                run=run, step=d.step, source=source, posture=Posture.FLEET, policy=policy, max_in_flight=max_in_flight
            )
            events.append(point_event(req, blocks))
        if events:
            rest.post_events(events).raise_for_status()
    requested = [d.step for d in decisions if d.action == "requested"]
    logger.info("watch %s: %d checkpoints, requested steps %s", root, len(checkpoints), requested)
    if decisions:
        create_table_artifact(
            table=[d.model_dump() for d in decisions],
            key=f"{history_artifact_key(run)}-watch",
            description=f"watch tick over {root}",
        )
    return decisions
