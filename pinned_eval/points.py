"""The eval point's vocabulary, shared by the trainer side and the orchestrator (no Prefect import).

An eval point is (run, step, snapshot source, final?). A request names registered configuration
only (block names), never code or options: whoever can send an event chooses neither the code the
worker runs nor, past the staging block's `source_roots`, the files it reads. Its weight version is `str(step)`; its
flow run is named `<run>/step-<step>`; the event that requests it has the deterministic id
uuid5(run, step), so a retried send is one point.
"""

from __future__ import annotations

import re
import uuid
from enum import StrEnum
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

RUN_NAME_MAX = 63
RUN_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"  # pydantic (Rust regex): `$` is the end of the text
# Python's `re` lets `$` match before a trailing newline: every Python check uses RUN_RE (`\Z`)
RUN_RE = re.compile(RUN_PATTERN.removesuffix("$") + r"\Z")
RUN_RULE = (
    f"a run name is 1 to {RUN_NAME_MAX} letters, digits, '.', '_' or '-', starting with a letter or a "
    "digit, without '..' (e.g. `Exp42`, `qwen3-8b-v1.2`)"
)
# A saved block document's name (Prefect: lowercase letters, digits, dashes; no length bound) as
# pinned-eval accepts it everywhere: the CLI creating a block, a fleet's lock name, a request naming
# a block. The one pattern, the widest the project ever accepted, so every saved document stays nameable.
BLOCK_NAME_PATTERN = r"^[a-z0-9][a-z0-9-]{0,99}$"
BLOCK_NAME_RE = re.compile(BLOCK_NAME_PATTERN.removesuffix("$") + r"\Z")  # Python checks (`$` allows a final \n)
EVENT_REQUESTED = "pinned-eval.point.requested"
_EVENT_NAMESPACE = uuid.UUID("6f1c1f4e-6a43-4a8e-9d0e-7d8f3c1b2a90")


def check_run_name(run: str) -> str:
    """`run` if it is a valid run name, else `ValueError` with `RUN_RULE` (a sentence, not a regex)."""
    if not RUN_RE.match(run) or ".." in run:
        raise ValueError(f"run {run!r} is refused: {RUN_RULE}")
    return run


RunName = Annotated[str, AfterValidator(check_run_name)]


def run_key(run: str) -> str:
    """`run` as a path segment or limit-name part that differs from every other run's, even where
    case is folded (a case-insensitive filesystem): lowercase letters, digits, '-' and '_' stay
    as they are (so a lowercase name is its own key), a capital `X` becomes `x.` and a '.' `_.`.

    Injective: the code is suffix-free ('.' only ever ends a two-character code), so a key decodes
    from the right to exactly one name. A key has no capital, never starts with '.', never holds
    '..' or a separator, and is at most twice the name's length."""
    check_run_name(run)
    return "".join(f"{c.lower()}." if c.isupper() else "_." if c == "." else c for c in run)


def run_of_key(key: str) -> str | None:
    """The run whose `run_key` is `key` (decoded from the right), or None when `key` is no run's key."""
    out: list[str] = []
    i = len(key) - 1
    while i >= 0:
        c = key[i]
        if c == ".":
            prev = key[i - 1] if i > 0 else ""
            if prev == "_":
                out.append(".")
            elif "a" <= prev <= "z":
                out.append(prev.upper())
            else:
                return None
            i -= 2
        else:
            out.append(c)
            i -= 1
    run = "".join(reversed(out))
    return run if RUN_RE.match(run) and ".." not in run and run_key(run) == key else None


class SourceKind(StrEnum):
    HF = "hf"  # an HF directory the trainer saved; reused, never deleted
    STAGED = "staged"  # exported in-loop into staging; owned by the point
    MEGATRON = "megatron"  # a torch_dist checkpoint converted by the point; owned
    STATE_DICT = "state_dict"  # a safetensors/torch file + base HF dir; owned
    LORA = "lora"  # a PEFT LoRA adapter dir + base HF dir; exported into staging (adapter or merged); owned


LoraMode = Literal["adapter", "merged"]  # how a fleet serves a `lora` source (FleetBlock.lora_mode)


class Posture(StrEnum):
    FLEET = "fleet"
    SHARED = "shared"
    EXTERNAL = "external"


class SnapshotSource(BaseModel):
    """Where a point's weights come from."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: SourceKind = Field(description="Source kind: hf, staged, megatron, state_dict or lora.")
    path: str = Field(min_length=1, description="Directory, file or URL of the weights.")
    hf_base: str | None = Field(
        default=None, description="Base HF dir for config/tokenizer (megatron, state_dict); the LoRA base (lora)."
    )
    require_marker: bool = Field(
        default=True, description="Require the `.complete` marker (False only for a base checkpoint)."
    )

    @model_validator(mode="after")
    def _base_needed(self) -> SnapshotSource:
        if self.kind in (SourceKind.STATE_DICT, SourceKind.MEGATRON, SourceKind.LORA) and not self.hf_base:
            raise ValueError(f"source kind {self.kind.value!r} needs `hf_base` (config and tokenizer)")
        return self

    @property
    def owned(self) -> bool:
        """Whether the point that uses this source owns (and so retires) the snapshot."""
        return self.kind is not SourceKind.HF


class PointRequest(BaseModel):
    """One requested eval point: the event payload and the flow's per-point parameters."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    run: RunName = Field(description="Training run name, e.g. `exp42`, `Exp42` or `qwen3-8b-v1.2`.")
    step: int = Field(ge=0, description="Training step whose weights are measured.")
    source: SnapshotSource | None = Field(
        default=None, description="Snapshot source of the step's weights (None only for the shared posture)."
    )
    final: bool = Field(default=False, description="The run's final point: never skipped as busy.")
    posture: Posture = Field(default=Posture.FLEET, description="fleet, shared or external.")
    policy: Literal["backpressure", "skip"] = Field(
        default="backpressure", description="At the in-flight bound: wait, or skip as busy."
    )
    max_in_flight: int = Field(default=2, ge=1, le=64, description="In-flight bound of the run.")
    export_time_seconds: float | None = Field(
        default=None, ge=0, description="Seconds an in-loop export took, when the trainer exported."
    )
    backend_block: str | None = Field(
        default=None,
        pattern=BLOCK_NAME_PATTERN,
        description=(
            "External posture: name of the saved `pinned-eval-external-backend` block (class path and "
            "options set by an operator). A request never names code or options itself."
        ),
    )

    @model_validator(mode="after")
    def _source_needed(self) -> PointRequest:
        if self.source is None and self.posture is not Posture.SHARED:
            raise ValueError(f"source: the {self.posture.value!r} posture needs a snapshot source")
        if self.posture is Posture.EXTERNAL and not self.backend_block:
            raise ValueError("backend_block: the external posture needs a saved external-backend block's name")
        return self

    @property
    def weight_version(self) -> str:
        return weight_version(self.step)

    @property
    def event_id(self) -> uuid.UUID:
        return point_event_id(self.run, self.step)


def weight_version(step: int) -> str:
    """The weight version of `step`'s weights: what every pin loads and every reply must carry."""
    return str(step)


def flow_run_name(run: str, step: int) -> str:
    return f"{run}/step-{step}"


def point_event_id(run: str, step: int) -> uuid.UUID:
    """Deterministic event id: the same (run, step) is the same event, however often it is sent."""
    return uuid.uuid5(_EVENT_NAMESPACE, f"{run}:{step}")


def run_resource_id(run: str) -> str:
    return f"pinned-eval.run.{run}"


def inflight_limit_name(run: str) -> str:
    """The run's in-flight concurrency limit: one per run (`run_key`: never another run's)."""
    return f"eval-inflight-{run_key(run)}"


def progress_variable_name(run: str) -> str:
    """Prefect Variable holding the trainer's latest reported step (for `eval/lag_steps`); variable
    names allow lowercase letters, digits, '-' and '_': `run_key` with '_' written `__`, '.' `_d`."""
    return f"pinned_eval_progress_{_escape(run_key(run), '_', {'_': '_', '.': 'd'})}"


def history_artifact_key(run: str) -> str:
    """Artifact keys allow lowercase letters, digits and dashes only: `run_key` with '-' written
    `--`, '_' `-u` and '.' `-d` (a prefix code: two runs never share a key)."""
    return f"eval-{_escape(run_key(run), '-', {'-': '-', '_': 'u', '.': 'd'})}"


def _escape(key: str, escape: str, codes: dict[str, str]) -> str:
    """`key` with each character of `codes` written as `escape` + its code (injective: a prefix code)."""
    return "".join(escape + codes[c] if c in codes else c for c in key)


Outcome = Literal["measured", "skipped", "failed", "crashed", "cancelled", "running", "pending", "scheduled"]


def outcome_of(state_type: str, state_name: str | None) -> Outcome:
    """The eval outcome a flow run's Prefect state stands for (Completed named "Skipped" is a skip)."""
    match state_type:
        case "COMPLETED":
            return "skipped" if state_name == "Skipped" else "measured"
        case "FAILED":
            return "failed"
        case "CRASHED":
            return "crashed"
        case "CANCELLED" | "CANCELLING":
            return "cancelled"
        case "RUNNING":
            return "running"
        case "SCHEDULED":
            return "scheduled"
        case _:  # PENDING, PAUSED
            return "pending"


def reason_of(outcome: Outcome, message: str | None) -> str | None:
    """Skip reason: `"<reason>: ..."` messages of skips; `crashed` for failed and crashed points."""
    if outcome == "skipped" and message:
        return message.split(":", 1)[0].strip() or None
    if outcome in ("failed", "crashed"):
        return "crashed"
    return None
