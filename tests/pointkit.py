"""Fixtures for eval-point tests: a tiny model, a CPU fleet behind sglang-router, saved blocks.

Import into a test module: `from tests.pointkit import *` (fixtures only). The fleet and the
model are session-scoped; every test gets its own run name, staging root and JSONL file.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from pydantic import SecretStr
from safetensors.torch import load_file

from blocks import EvalSuiteBlock, FleetBlock, SinksBlock, StagingBlock
from pinned_eval.fleet.launcher import LaunchedFleet
from pinned_eval.snapshot.writer import write_snapshot
from pinned_eval.suite import DatasetSpec, EvalSuite, SamplingDefaults

SMALL_SUITE = EvalSuite(
    datasets=(
        DatasetSpec(name="arith_add", path="builtin:arith_add.jsonl", max_prompts=6),
        DatasetSpec(name="arith_sub", path="builtin:arith_sub.jsonl", max_prompts=6),
    ),
    defaults=SamplingDefaults(temperature=0.0, max_new_tokens=3, n_samples_per_prompt=1, reward="exact_match"),
)

# a reward that takes a second per sample holds a point in its score phase (12 samples), so a
# test can kill or stall it there and the kill always lands mid-point
SLOW_SUITE = SMALL_SUITE.model_copy(
    update={"defaults": SMALL_SUITE.defaults.model_copy(update={"reward": "custom:tests.rewards:slow"})}
)


# where this session's test files live (the tiny model's, every test's tmp_path): the staging
# blocks `save_point_blocks` saves declare it as a source root (StagingBlock.source_roots)
SESSION_ROOTS: list[str] = []


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine.tiny_model import make_tiny_model

    SESSION_ROOTS.append(str(tmp_path_factory.getbasetemp()))
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@dataclass(frozen=True)
class CpuFleet:
    """A launched fleet; its keys were generated at launch (the state file holds them too)."""

    state_file: Path
    engine_urls: list[str]
    router_url: str
    api_key: str = field(repr=False)
    admin_api_key: str = field(repr=False)

    def headers(self, *, admin: bool = False) -> dict[str, str]:
        """Bearer header with the API key (data plane) or the admin key (control plane)."""
        return {"Authorization": f"Bearer {self.admin_api_key if admin else self.api_key}"}

    def block_keys(self) -> dict[str, SecretStr]:
        """The keys as `FleetBlock` fields, for blocks that attach to this fleet."""
        return {"api_key": SecretStr(self.api_key), "admin_api_key": SecretStr(self.admin_api_key)}

    @classmethod
    def of(cls, fleet: LaunchedFleet) -> CpuFleet:
        assert fleet.state_file is not None and fleet.router_url is not None and fleet.keys is not None
        return cls(fleet.state_file, fleet.engine_urls, fleet.router_url, fleet.keys.api, fleet.keys.admin)


@pytest.fixture(scope="session")
def cpu_fleet(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[CpuFleet]:
    from pinned_eval.fleet.launcher import launch_cpu_fleet

    state = tmp_path_factory.mktemp("fleet") / "fleet.json"
    fleet = launch_cpu_fleet(tiny_model, 2, state_file=state, ready_timeout_s=180)
    try:
        yield CpuFleet.of(fleet)
    finally:
        fleet.stop()


@contextmanager
def scripted_fleet(model: Path, rules: list[dict[str, str]], *, engines: int = 2, weight_version: str = "0",
                   **engine_kw: object) -> Iterator[LaunchedFleet]:
    """`engines` CPU engines answering by `rules` (`--scripted-completions`) behind a router,
    launched from `model`'s directory (logs, state file beside it) and stopped on exit."""
    from pinned_eval.fleet.cpu_engine import CpuEngineArgs, engine_spec
    from pinned_eval.fleet.keys import FleetKeys
    from pinned_eval.fleet.launcher import launch_fleet
    from tests.conftest import free_port

    (model.parent / "rules.json").write_text(json.dumps(rules))
    keys = FleetKeys.resolve()
    specs = [
        engine_spec(CpuEngineArgs(model_path=str(model), port=free_port(), weight_version=weight_version,
                                  api_key=keys.api, admin_api_key=keys.admin,
                                  scripted_completions=str(model.parent / "rules.json"), **engine_kw),  # type: ignore[arg-type]
                    env={"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})
        for _ in range(engines)
    ]
    launched = launch_fleet(specs, log_dir=model.parent / "logs", state_file=model.parent / "fleet.json", keys=keys,
                            ready_timeout_s=120)
    try:
        yield launched
    finally:
        launched.stop()


def write_step_snapshot(base: Path, dest: str, *, scale: float = 0.0, seed: int = 0) -> str:
    """Write the base model's weights (optionally perturbed) as a complete snapshot at `dest`."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for shard in sorted(base.glob("*.safetensors")):
        tensors.update(load_file(shard))
    named = [(n, t + scale * torch.randn(t.shape, generator=gen)) for n, t in sorted(tensors.items())]
    write_snapshot(named, dest, base_hf_dir=str(base), max_shard_bytes=64 * 1024)
    return dest


@dataclass(frozen=True)
class PointEnv:
    run: str
    staging_root: Path
    jsonl: Path
    blocks: dict[str, str]  # parameter name -> saved block name

    def params(self, step: int, **extra: object) -> dict[str, object]:
        return {"run": self.run, "step": step, **self.blocks, **extra}


def save_point_blocks(
    tmp_path: Path,
    fleet: FleetBlock,
    *,
    suite: EvalSuite = SMALL_SUITE,
    keep_snapshots: int = 2,
    wandb: bool = False,
    point_timeout_seconds: float | None = None,
) -> PointEnv:
    tag = uuid.uuid4().hex[:8]
    run = f"t{tag}"
    staging_root = tmp_path / "staging"
    staging_root.mkdir()
    jsonl = tmp_path / "metrics.jsonl"
    names = {"suite": f"suite-{tag}", "fleet": f"fleet-{tag}", "staging": f"staging-{tag}", "sinks": f"sinks-{tag}"}
    deadline = {"point_timeout_seconds": point_timeout_seconds} if point_timeout_seconds else {}
    EvalSuiteBlock(suite=suite, **deadline).save(names["suite"])
    fleet.save(names["fleet"])
    roots = [str(tmp_path), *SESSION_ROOTS]
    StagingBlock(root=str(staging_root), keep_snapshots=keep_snapshots, source_roots=roots).save(names["staging"])
    wandb_opts = (
        {"wandb_project": "pinned-eval-tests", "wandb_mode": "offline", "wandb_dir": str(tmp_path)} if wandb else {}
    )
    SinksBlock(jsonl_path=str(jsonl), **wandb_opts).save(names["sinks"])
    return PointEnv(run, staging_root, jsonl, names)


@pytest.fixture
def point_env(prefect_server: str, cpu_fleet: CpuFleet, tmp_path: Path) -> PointEnv:
    fleet = FleetBlock(name=f"f{uuid.uuid4().hex[:6]}", mode="launch", state_file=str(cpu_fleet.state_file))
    return save_point_blocks(tmp_path, fleet)


@pytest.fixture
def slow_point_env(prefect_server: str, cpu_fleet: CpuFleet, tmp_path: Path) -> PointEnv:
    """Like `point_env`, with `SLOW_SUITE`: the point stays in its score phase for ~12 s."""
    fleet = FleetBlock(name=f"f{uuid.uuid4().hex[:6]}", mode="launch", state_file=str(cpu_fleet.state_file))
    return save_point_blocks(tmp_path, fleet, suite=SLOW_SUITE)


def launched_point_env(tmp_path: Path, fleet: LaunchedFleet, suite: EvalSuite) -> PointEnv:
    """Blocks for points on a fleet launched by `scripted_fleet`, with a JSONL ledger and a results root."""
    assert fleet.state_file is not None
    block = FleetBlock(name=f"f{uuid.uuid4().hex[:6]}", mode="launch", state_file=str(fleet.state_file))
    env = save_point_blocks(tmp_path, block, suite=suite, keep_snapshots=0)
    SinksBlock(jsonl_path=str(env.jsonl), results_root=str(tmp_path / "results")).save(env.blocks["sinks"],
                                                                                       overwrite=True)
    return env


def run_staged_point(env: PointEnv, step: int, model: Path):  # type: ignore[no-untyped-def]
    """Stage `model`'s weights as the snapshot of `step`, then run the point's flow (its final state)."""
    from flows.eval_point import eval_point

    dest = StagingBlock.load(env.blocks["staging"]).staging().path_for(env.run, step)
    write_step_snapshot(model, dest)
    return eval_point(**env.params(step, source={"kind": "staged", "path": dest}), return_state=True)
