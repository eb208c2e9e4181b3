"""miles: `--eval-function-path trainer_integration.miles_adapter.PinnedEvalFn` hands each checkpoint
miles saves (`--save-hf`) to pinned-eval and gets miles-shaped results back.

miles builds the class with its `RolloutFnConstructorInput` and awaits it with a
`RolloutFnEvalInput` (`rollout_id`, `evaluation=True`, `hf_dir`) at every eval step. Here plain
objects stand in for miles' (no miles install needed); the configuration comes from
`PINNED_EVAL_MILES_*` variables (or `args.pinned_eval_<field>`) and Prefect's `PREFECT_API_URL`:

    PINNED_EVAL_MILES_RUN=exp42 PREFECT_API_URL=http://127.0.0.1:4200/api \\
    python train_async.py ... --save-hf /ckpt/exp42/hf \\
        --eval-function-path trainer_integration.miles_adapter.PinnedEvalFn

Each call is one eval point of the `eval-point` deployment (source `hf`: the directory stays
miles'). A measured point returns `RolloutFnEvalOutput(data={ds: {"rewards", "truncated",
"weight_versions", "response_lens"}}, metrics)`; a skipped one raises miles' `EvalSkip(reason)`,
here for step 8, whose checkpoint lacks its `.complete` marker (miles died mid-save).

    python examples/miles_adapter.py --model-path M     # a running stack (see _stack.py)
    python examples/miles_adapter.py --self-contained
"""

from __future__ import annotations

import asyncio
import os
from types import SimpleNamespace

import _stack


def main() -> None:
    args = _stack.parser(__doc__).parse_args()
    from trainer_integration.miles_adapter import MilesEvalSkip, PinnedEvalFn

    with _stack.stack(args, "miles") as st:
        os.environ.update(
            PINNED_EVAL_MILES_RUN=st.run,
            PINNED_EVAL_MILES_BLOCKS=st.blocks.model_dump_json(),  # JSON; default: the `default` blocks
            PINNED_EVAL_MILES_POLL_INTERVAL_S="1",
        )
        miles_args = SimpleNamespace()  # miles' parsed args: `pinned_eval_<field>` attributes would override
        eval_fn = PinnedEvalFn(SimpleNamespace(args=miles_args, data_source=None))
        try:
            for step in (4, 8):
                hf_dir = _stack.save_checkpoint(st.model_path, st.work / "hf" / f"iter_{step:07d}", seed=step)
                if step == 8:
                    (hf_dir / ".complete").unlink()  # miles died before finishing this save
                miles_input = SimpleNamespace(rollout_id=step, evaluation=True, hf_dir=str(hf_dir))
                try:
                    out = asyncio.run(eval_fn(miles_input))
                except MilesEvalSkip as skip:
                    print(f"point step={step} state=skipped reason={skip.reason}")
                    continue
                versions = sorted({v for d in out.data.values() for v in d["weight_versions"]})
                mixed = max(out.metrics[f"eval/{ds}/weight_version/mixed_version_ratio"] for ds in out.data)
                scores = " ".join(f"{ds}={out.metrics[f'eval/{ds}']:.3f}" for ds in sorted(out.data))
                samples = sum(len(d["rewards"]) for d in out.data.values())
                print(f"point step={step} state=measured weight_version={','.join(versions)} mixed={mixed:g} "
                      f"{scores} samples={samples}")
        finally:
            eval_fn.dispose()


if __name__ == "__main__":
    main()
