"""The trainer side of pinned-eval: what a training job imports (never Prefect).

The public API, flat::

    from trainer_integration import EvalClient, CheckpointEvalFn, EvalSkip, ProducerGate, FullyAsyncProducer

`EvalClient` dispatches eval points from the loop; `ProducerGate` and `FullyAsyncProducer` are the
reference fully-async producer and its gate (shared posture); `CheckpointEvalFn`, `EvalInput`,
`EvalResults` and `EvalSkip` are the external posture's contract (defined in the core,
`pinned_eval.external`, re-exported here). Modules: `client`, `admission` and `admission_sync`
(the client's admission view and the thread that refreshes it), `events`, `rest`, `spool`,
`results`, `gate`, `producer`, `rollout_buffer`, `sglang_backend` (the reference external
backend), `miles_adapter`.
"""

from pinned_eval.external import CheckpointEvalFn, EvalInput, EvalResults, EvalSkip
from trainer_integration.client import EvalClient
from trainer_integration.gate import ProducerGate
from trainer_integration.producer import FullyAsyncProducer, ProducerConfig

__all__ = [
    "CheckpointEvalFn",
    "EvalClient",
    "EvalInput",
    "EvalResults",
    "EvalSkip",
    "FullyAsyncProducer",
    "ProducerConfig",
    "ProducerGate",
]
