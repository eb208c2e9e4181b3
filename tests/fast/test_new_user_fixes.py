"""New-user fixes that need no server: a fleet that is not up is a typed skip naming `fleet up`;
`--wait` on a point no worker takes names `pinned-eval worker`; a relative source is made absolute
where it was typed."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from app.commands.points import absolute, no_worker_hint, parse_source
from blocks import FleetBlock
from pinned_eval.fleet.errors import FleetUnhealthy


def test_a_fleet_that_is_not_up_is_an_unhealthy_skip_naming_fleet_up(tmp_path: Path) -> None:
    state = tmp_path / "fleet" / "fleet.json"
    block = FleetBlock(mode="launch", state_file=str(state), name="mine")
    with pytest.raises(FleetUnhealthy) as info:
        block.client()
    assert (info.value.reason, info.value.message) == (
        "unhealthy", f"fleet 'mine' is not up: no state file {state}; start it with `pinned-eval fleet up "
                     f"--model-path DIR --state-file {state}`")


class _Workers:
    def __init__(self, statuses: list[str]) -> None:
        self.statuses = statuses
        self.asked: list[str] = []

    def read_workers_for_work_pool(self, pool: str) -> list[SimpleNamespace]:
        self.asked.append(pool)
        return [SimpleNamespace(status=SimpleNamespace(value=s)) for s in self.statuses]


def test_wait_on_a_point_no_worker_takes_names_pinned_eval_worker() -> None:
    client = _Workers(["OFFLINE"])
    assert no_worker_hint(client, "pinned-eval") == (  # type: ignore[arg-type]
        "no worker is polling the work pool 'pinned-eval': start one with `pinned-eval worker` (in another "
        "terminal, in this project's directory)")
    assert client.asked == ["pinned-eval"]
    busy = _Workers(["ONLINE"])
    assert no_worker_hint(busy, "p") == (  # type: ignore[arg-type]
        "a worker polls 'p': it may be busy with other points (`pinned-eval status --run RUN`)")


def test_a_relative_source_is_absolute_before_it_is_sent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    src = parse_source("lora:ckpt/adapter", "base")
    assert (src.path, src.hf_base) == (str(tmp_path / "ckpt" / "adapter"), str(tmp_path / "base"))
    assert absolute("s3://b/p") == "s3://b/p" and absolute(None) is None
    assert absolute("~/x") == os.path.expanduser("~/x")
