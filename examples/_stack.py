"""Plumbing the examples share: reach a pinned-eval stack, save the blocks of one run, print points.

Two ways to run an example (`python examples/<name>.py --help`):
- against a running stack, started once with
      pinned-eval tiny-model --out .pinned-eval/tiny
      pinned-eval server up && export PREFECT_API_URL=...   # the URL it prints
      pinned-eval deploy && pinned-eval worker               # the worker stays in the foreground
      pinned-eval fleet up --model-path .pinned-eval/tiny    # in another terminal
  then `python examples/<name>.py --model-path .pinned-eval/tiny` (the API URL comes from
  `--api-url`, `PREFECT_API_URL` or the stack's state; the fleet from `fleet up`'s state file);
- `--self-contained`: starts a Prefect server, the deployments, a process worker and 2 CPU engines
  behind sglang-router under `--work-dir`, and stops them (by PID) when the example ends.
Every run gets its own run name and saves its own blocks (named after the run, fleet lock
`fleet-default`), so it never touches your `default` blocks and can be run again and again.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pinned_eval.events import BlockNames
from trainer_integration.results import PointOutcome

DATASETS = ("arith_add", "arith_sub")


@dataclass(frozen=True)
class Stack:
    api_url: str
    run: str  # the training run's name: every point is `<run>/step-<N>`
    work: Path  # this run's scratch directory (staging, spool, metrics, checkpoints)
    model_path: Path  # the HF model the fleet serves (the trainer's base model)
    blocks: BlockNames  # saved block documents every point of this run uses
    fleet_state: Path  # the fleet's state file (engine and router URLs, PIDs)

    def fleet_urls(self) -> tuple[list[str], str]:
        """The fleet's engine URLs and its router URL."""
        from pinned_eval.fleet.launcher import LaunchedFleet

        fleet = LaunchedFleet.load(self.fleet_state)
        return fleet.engine_urls, str(fleet.router_url)

    def fleet_headers(self) -> tuple[dict[str, str], dict[str, str]]:
        """Bearer headers for the fleet's data plane and control plane (keys from the 0600 state file)."""
        from pinned_eval.fleet.launcher import LaunchedFleet

        keys = LaunchedFleet.load(self.fleet_state).keys
        if keys is None:
            return {}, {}
        return {"Authorization": f"Bearer {keys.api}"}, {"Authorization": f"Bearer {keys.admin}"}


def parser(doc: str | None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--self-contained", action="store_true", help="Start (and stop) a whole stack here.")
    p.add_argument("--api-url", help="Prefect API URL (default: PREFECT_API_URL, else the local stack's).")
    p.add_argument("--model-path", type=Path, help="The model `pinned-eval fleet up` serves.")
    p.add_argument("--fleet-state", type=Path, help="`fleet up`'s state file (default: its default).")
    p.add_argument("--work-dir", type=Path, default=Path(".pinned-eval/examples"), help="Scratch root.")
    p.add_argument("--run", help="Training run name (default: <example>-<random>).")
    return p


@contextlib.contextmanager
def stack(args: argparse.Namespace, example: str) -> Iterator[Stack]:
    """This process pointed at a stack (started here with `--self-contained`), blocks saved."""
    from app.prefect_server import free_port, use_server

    run = args.run or f"{example}-{uuid.uuid4().hex[:6]}"
    work = (args.work_dir / run).resolve()
    with contextlib.ExitStack() as stop:
        if args.self_contained:
            from app.stack import LocalStack
            from engine.tiny_model import make_tiny_model
            from pinned_eval.fleet.launcher import launch_cpu_fleet

            local = LocalStack(work / "stack")
            stop.callback(local.down)
            server = local.server_up(free_port())
            stop.enter_context(use_server(server.api_url, server.home, auth_string=server.auth_string))
            api_url, model, state = server.api_url, make_tiny_model(work / "model"), work / "fleet" / "fleet.json"
            print(f"self-contained stack: Prefect UI {server.ui_url}; starting 2 CPU engines ...", flush=True)
            stop.callback(launch_cpu_fleet(model, 2, state_file=state, ready_timeout_s=300).stop)
            local.deploy()
            local.worker_up(query_seconds=1)
        else:
            from app.stack import LocalStack
            from pinned_eval.fleet.launcher import default_state_file
            from pinned_eval.settings import PrefectApiSettings, get_settings

            home_stack = LocalStack(get_settings().home)
            recorded = home_stack.state().api_url  # `pinned-eval server up`'s
            api_url = args.api_url or os.environ.get("PREFECT_API_URL") or recorded
            if not api_url or not args.model_path:
                raise SystemExit("need a running stack (--api-url or PREFECT_API_URL, and --model-path), "
                                 "or --self-contained")
            model, state = args.model_path.resolve(), (args.fleet_state or default_state_file()).resolve()
            # the credential: PREFECT_API_AUTH_STRING or PINNED_EVAL_API_AUTH_FILE, else the home's (its server only)
            given = PrefectApiSettings().api_auth_string
            auth = given.get_secret_value() if given else None
            if auth is None and api_url == recorded and home_stack.auth_file.exists():
                auth = home_stack.auth_string()
            stop.enter_context(use_server(api_url, auth_string=auth))
        yield Stack(api_url, run, work, model, save_blocks(run, work, state), state)


def save_blocks(run: str, work: Path, fleet_state: Path) -> BlockNames:
    """A small suite (8 greedy prompts per dataset), the fleet, local staging, a JSONL sink."""
    from blocks import EvalSuiteBlock, FleetBlock, SinksBlock, StagingBlock
    from pinned_eval.suite import DatasetSpec, EvalSuite, SamplingDefaults

    suite = EvalSuite(
        datasets=tuple(DatasetSpec(name=ds, path=f"builtin:{ds}.jsonl", max_prompts=8) for ds in DATASETS),
        defaults=SamplingDefaults(temperature=0.0, max_new_tokens=3, stop=("\n",), reward="exact_match"),
    )
    EvalSuiteBlock(suite=suite).save(run, overwrite=True)
    FleetBlock(mode="launch", state_file=str(fleet_state)).save(run, overwrite=True)
    # the examples' checkpoints live under `work`: an operator declares it as a source root
    StagingBlock(root=str(work / "staging"), keep_snapshots=1, source_roots=[str(work)]).save(run, overwrite=True)
    SinksBlock(jsonl_path=str(work / "metrics.jsonl")).save(run, overwrite=True)
    return BlockNames(suite=run, fleet=run, staging=run, sinks=run)


def save_checkpoint(base: Path, dest: Path, seed: int) -> Path:
    """What a trainer's HF save does: the base weights (perturbed by `seed`) written with
    `write_snapshot` (shards, index, config and tokenizer from `base`, `.complete` last)."""
    import torch
    from safetensors.torch import load_file

    from pinned_eval.snapshot.writer import write_snapshot

    gen = torch.Generator().manual_seed(seed)
    tensors = {n: t for shard in sorted(base.glob("*.safetensors")) for n, t in load_file(shard).items()}
    noisy = [(n, t + 0.01 * torch.randn(t.shape, generator=gen)) for n, t in sorted(tensors.items())]
    write_snapshot(noisy, str(dest), base_hf_dir=str(base))
    return dest


def describe(outcome: PointOutcome) -> str:
    """One line per point: `point step=N state=S [reason=R] [weight_version=V mixed=M ds=score ...]`."""
    line = f"point step={outcome.step} state={outcome.state}"
    if outcome.reason:
        line += f" reason={outcome.reason}"
    if outcome.metrics:
        m = outcome.metrics
        versions = sorted({f"{m[ds][f'eval/{ds}/weight_version/mean']:g}" for ds in m})
        mixed = max(m[ds][f"eval/{ds}/weight_version/mixed_version_ratio"] for ds in m)
        line += f" weight_version={','.join(versions)} mixed={mixed:g}"
        line += "".join(f" {ds}={m[ds][f'eval/{ds}']:.3f}" for ds in sorted(m))
    return line
