"""`miles.utils.types` as pinned-eval serves it: miles' `Sample` (fields, `Status`, the methods
generate functions call). Token-level bookkeeping fields exist and are kept, never required."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

__all__ = ["Sample"]


@dataclass
class Sample:
    """One rollout sample with miles' field names and defaults."""

    class Status(Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    group_index: int | None = None
    index: int | None = None
    rollout_id: int | None = None
    prompt: str | list[dict[str, Any]] = ""
    tokens: list[int] = field(default_factory=list)
    multimodal_inputs: dict[str, Any] | None = None
    multimodal_train_inputs: dict[str, Any] | None = None
    response: str = ""
    response_length: int = 0
    label: Any = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    rollout_routed_experts: Any = None
    rollout_indexer_topk: Any = None
    remove_sample: bool = False
    teacher_log_probs: list[float] | None = None
    opd_reverse_kl: list[float] | None = None
    status: Sample.Status = Status.PENDING
    metadata: dict[str, Any] = field(default_factory=dict)
    generate_function_path: str | None = None
    train_metadata: dict[str, Any] | None = None
    adapter: Any = None
    reward_spec: Any = None
    routing_key: str | None = None
    non_generation_time: float = 0.0

    def update_from_meta_info(self, args: Any, meta_info: dict[str, Any]) -> None:
        """Append the reply's weight version; the finish reason sets the status (length ->
        TRUNCATED, abort -> ABORTED, stop -> COMPLETED), as miles does."""
        if "weight_version" in meta_info:
            self.weight_versions.append(meta_info["weight_version"])
        finish = (meta_info.get("finish_reason") or {}).get("type")
        status = {"length": Sample.Status.TRUNCATED, "abort": Sample.Status.ABORTED, "stop": Sample.Status.COMPLETED}
        if finish in status:
            self.status = status[finish]

    @property
    def oldest_weight_version(self) -> int | None:
        numeric = [int(v) for v in self.weight_versions if str(v).isdigit()]
        return min(numeric) if numeric else None

    def to_dict(self) -> dict[str, Any]:
        value = dict(self.__dict__)
        value["status"] = self.status.value
        return value
