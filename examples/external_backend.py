"""External posture: a black-box `CheckpointEvalFn` measures a checkpoint directory instead of the fleet.

Two points of one run, requested with the trainer's event (`pinned-eval.point.requested`):
- step 10 uses the reference backend `SGLangCheckpointEval` with `launch="cpu"`: in the worker's
  backend host it launches its own CPU engine, pins it to the checkpoint as version "10" (read
  back from `/model_info`), generates and scores the suite; the engine stays up for the next point
  of that configuration and `dispose()` stops it when the host stops (a backend is built once per
  worker and configuration);
- step 11 uses `QuotaBackend` below, a custom backend for a metered eval service: without credits
  it raises `EvalSkip("quota")`, recorded as `eval/skipped_quota: 1` at step 11.
Each backend is an `ExternalBackendBlock` the operator saves (class path and options); the request
names the block only. The worker imports the block's `module:Class`, so it must be importable there
(this file is, as `examples.external_backend`, from the project directory the worker runs in).

    python examples/external_backend.py --model-path M     # a running stack (see _stack.py)
    python examples/external_backend.py --self-contained
"""

from __future__ import annotations

from typing import Any

from trainer_integration import CheckpointEvalFn, EvalInput, EvalResults, EvalSkip


class QuotaBackend(CheckpointEvalFn):
    """The reference backend behind a quota: each point costs one credit; none left → skipped `quota`."""

    def __init__(self, credits: int = 0, **sglang_options: Any) -> None:
        self.credits, self.options = credits, sglang_options
        self.inner: CheckpointEvalFn | None = None  # the reference backend, launched on first use

    async def evaluate_checkpoint(self, checkpoint_dir: str, input: EvalInput) -> EvalResults:
        if self.credits < 1:
            raise EvalSkip("quota", f"no eval credits left for {input.run}/step-{input.step}")
        from trainer_integration.sglang_backend import SGLangCheckpointEval

        self.credits -= 1
        if self.inner is None:
            self.inner = SGLangCheckpointEval(**self.options)
        return await self.inner.evaluate_checkpoint(checkpoint_dir, input)

    def dispose(self) -> None:
        if self.inner is not None:
            self.inner.dispose()


def main() -> None:
    import _stack  # the examples' plumbing (not needed by the worker that imports QuotaBackend)

    from blocks import ExternalBackendBlock
    from pinned_eval.events import point_event, post_events
    from pinned_eval.points import PointRequest, SnapshotSource
    from trainer_integration import EvalClient

    args = _stack.parser(__doc__).parse_args()
    with _stack.stack(args, "external") as st:
        backends = {
            10: ("trainer_integration.sglang_backend:SGLangCheckpointEval",
                 {"launch": "cpu", "model_path": str(st.model_path), "log_dir": str(st.work / "logs")}),
            11: ("examples.external_backend:QuotaBackend", {"credits": 0}),
        }
        for step, (backend, options) in backends.items():
            # the operator saves each backend as a block; a request names the block, never the class
            block = f"{st.run}-backend-{step}"
            ExternalBackendBlock(backend=backend, options=options).save(block, overwrite=True)
            ckpt = _stack.save_checkpoint(st.model_path, st.work / "checkpoints" / f"step_{step}", seed=step)
            request = PointRequest(
                run=st.run, step=step, posture="external", source=SnapshotSource(kind="hf", path=str(ckpt)),
                backend_block=block,
            )
            post_events(st.api_url, [point_event(request, st.blocks)])  # what EvalClient.dispatch sends
            print(f"requested {st.run}/step-{step} with {backend}", flush=True)
        with EvalClient(st.run, st.api_url, blocks=st.blocks, spool_dir=st.work / "spool") as client:
            for step in backends:
                print(_stack.describe(client.wait_for(step, timeout=600)))


if __name__ == "__main__":
    main()
