"""Watch evaluator: evaluation fully decoupled from the training job, driven by its checkpoint directory.

The trainer only saves HF checkpoints named `step_N` (`.complete` written last) and knows nothing
of pinned-eval. Each tick of the `watch-checkpoints` flow lists the directory (or S3 prefix) and
requests one eval point per ready step (source `hf`: never deleted). Prefect is the ledger: a step
that already has a point is not requested again, so overlapping or restarted watchers are safe.
In production the `watch` deployment (prefect.yaml) runs the ticks: set its `run`, `root` and block
parameters and activate its schedule. Here the example fills a directory (step_10 and step_20
complete, step_30 still being written), runs one tick in-process, waits for the points, and runs a
second tick, which requests nothing new.

    python examples/watch_checkpoints.py --model-path M     # a running stack (see _stack.py)
    python examples/watch_checkpoints.py --self-contained
"""

from __future__ import annotations

import _stack


def main() -> None:
    args = _stack.parser(__doc__).parse_args()
    from flows.watch import watch_checkpoints
    from trainer_integration import EvalClient

    with _stack.stack(args, "watch") as st:
        root = st.work / "checkpoints"
        for step in (10, 20, 30):
            _stack.save_checkpoint(st.model_path, root / f"step_{step}", seed=step)
        (root / "step_30" / ".complete").unlink()  # the trainer is still writing it

        def tick(n: int) -> None:
            decisions = watch_checkpoints(run=st.run, root=str(root), **st.blocks.model_dump())
            print(f"tick {n}: " + " ".join(f"step_{d.step}={d.action}" for d in decisions), flush=True)

        tick(1)
        with EvalClient(st.run, st.api_url, blocks=st.blocks, spool_dir=st.work / "spool") as client:
            outcomes = [client.wait_for(step, timeout=600) for step in (10, 20)]
        tick(2)
        for outcome in outcomes:
            print(_stack.describe(outcome))


if __name__ == "__main__":
    main()
