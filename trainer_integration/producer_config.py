"""Configuration and caller-facing contracts of `FullyAsyncProducer` (trainer_integration.producer).

- `ProducerConfig`: validated at construction (pydantic, frozen); errors name the field.
  `max_in_flight_groups` is `rollout_batch_size`, or `max(1, max_concurrent_samples // n)` when a
  sample budget is set; `buffer_capacity` is `int(buffer_factor * rollout_batch_size)` and must be >= 1.
- `GenerateGroup`, `DataSource`, `SampleDone`: the callables the caller supplies (see the producer's
  module docstring for their contract).
- `RolloutBatch`: what one `get_batch()` returns.

Re-exported by `trainer_integration.producer`, where callers import them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, model_validator

from trainer_integration.rollout_buffer import Group

SampleDone = Callable[[], None]


class GenerateGroup(Protocol):
    def __call__(self, prompt_group: Group, sample_done: SampleDone | None) -> Awaitable[Group]: ...


class DataSource(Protocol):
    def get_group(self) -> Group | Awaitable[Group]: ...

    def recycle(self, group: Group) -> Awaitable[None] | None: ...


class ProducerConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    rollout_batch_size: PositiveInt
    n_samples_per_prompt: PositiveInt = 1
    max_concurrent_samples: PositiveInt | None = None
    submission_granularity: Literal["sample", "group"] = "sample"
    buffer_factor: float = Field(default=2.0, gt=0)
    max_weight_staleness: int | None = Field(default=None, ge=0)
    unused_handler: Literal["drop", "retry"] = "drop"
    stall_warning_s: float = Field(default=30.0, gt=0)

    @model_validator(mode="after")
    def _check(self) -> ProducerConfig:
        if self.max_concurrent_samples is not None and self.max_concurrent_samples < self.n_samples_per_prompt:
            raise ValueError(
                f"max_concurrent_samples ({self.max_concurrent_samples}) must be >= "
                f"n_samples_per_prompt ({self.n_samples_per_prompt})"
            )
        if self.buffer_capacity < 1:
            raise ValueError(
                f"buffer_factor ({self.buffer_factor}) * rollout_batch_size ({self.rollout_batch_size}) "
                "must give a buffer capacity of at least 1 group"
            )
        return self

    @property
    def max_in_flight_groups(self) -> int:
        if self.max_concurrent_samples is not None:
            return max(1, self.max_concurrent_samples // self.n_samples_per_prompt)
        return self.rollout_batch_size

    @property
    def buffer_capacity(self) -> int:
        return int(self.buffer_factor * self.rollout_batch_size)


@dataclass
class RolloutBatch:
    groups: list[Group]
    metrics: dict[str, float]
