"""Fleet: pin SGLang-protocol engines to one verified weight version and generate through the router.

`client` (pin, health, revive, generate), `health` (up, busy or dead: one engine),
`readback` (a pin's per-engine verdict), `lora` (adapter-mode pin steps), `launcher` (start/stop
engines + sglang-router), `sglang_args` (real SGLang commands for GPU fleets). No Prefect imports here.
"""

from pinned_eval.fleet.client import FleetClient, FleetConfig, Reviver
from pinned_eval.fleet.errors import (
    EngineHTTPError,
    FleetError,
    FleetUnhealthy,
    GenerateRejected,
    GenerationAborted,
    NotPinned,
    PinViolation,
    RouterError,
    WeightVersionMismatch,
)
from pinned_eval.fleet.launcher import (
    LaunchedFleet,
    default_state_file,
    launch_cpu_fleet,
    launch_fleet,
    launch_sglang_fleet,
)
from pinned_eval.fleet.models import (
    EngineHealth,
    EngineInfo,
    GenerateResult,
    HealthState,
    PinResult,
    SamplingParams,
)
from pinned_eval.fleet.sglang_args import SGLangFleetSpec
from pinned_eval.processes import LaunchError

__all__ = [
    "EngineHTTPError",
    "EngineHealth",
    "EngineInfo",
    "FleetClient",
    "FleetConfig",
    "FleetError",
    "FleetUnhealthy",
    "GenerateRejected",
    "GenerateResult",
    "GenerationAborted",
    "HealthState",
    "LaunchError",
    "LaunchedFleet",
    "NotPinned",
    "PinResult",
    "PinViolation",
    "Reviver",
    "RouterError",
    "SGLangFleetSpec",
    "SamplingParams",
    "WeightVersionMismatch",
    "default_state_file",
    "launch_cpu_fleet",
    "launch_fleet",
    "launch_sglang_fleet",
]
