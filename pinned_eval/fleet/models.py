"""Typed views of the SGLang wire formats the fleet client reads and writes, and its own results.

Invariants:
- Engine responses are validated here, at the edge; a malformed one raises a pydantic
  `ValidationError` that names the offending field.
- `SamplingParams` accepts only keys that SGLang's `/generate` accepts **and** sglang-router 0.3.2
  forwards unchanged (it silently drops `seed`, `logit_bias`, `custom_params`, `stop_regex`,
  `spaces_between_special_tokens`, `stream_interval`); an unknown key is an error naming it. The
  seed key is `sampling_seed`. `n` is absent: one sample per request (ask again for more).
- URLs are compared in normal form (`normalize_url`): scheme://host:port, no trailing slash.
"""

from __future__ import annotations

import os
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


def normalize_url(url: str) -> str:
    """`http://host:port` form used for every comparison (router lists, state files, records)."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = f"http://{url}"
    return url


def normalize_path(path: str | os.PathLike[str]) -> str:
    """A model path in the form the engines are asked to load and are compared against.

    Local paths become absolute and normalised (an engine resolves a relative path against its own
    working directory); URIs such as `s3://bucket/key` are left as they are.
    """
    text = os.fspath(path)
    if "://" in text:
        return text.rstrip("/")
    return os.path.normpath(os.path.abspath(text))


class SamplingParams(BaseModel):
    """`sampling_params` of one `/generate` request (SGLang names, not OpenAI names)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_new_tokens: int = Field(default=128, ge=0, description="Most tokens to generate.")
    temperature: float = Field(default=1.0, ge=0, description="0 means greedy.")
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, description="-1 or None: all tokens.")
    min_p: float | None = Field(default=None, ge=0, le=1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = Field(default=None, gt=0)
    min_new_tokens: int | None = Field(default=None, ge=0)
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    sampling_seed: int | None = Field(default=None, description="Per-request seed (SGLang's name).")

    def to_wire(self) -> dict[str, Any]:
        """The JSON object sent as `sampling_params`; unset optional keys are left out."""
        return self.model_dump(exclude_none=True)


class FinishReason(BaseModel):
    """`meta_info.finish_reason`: stop (with `matched`), length (with `length`) or abort."""

    model_config = ConfigDict(extra="allow", frozen=True)

    type: Literal["stop", "length", "abort"]
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None
    status_code: int | None = None
    err_type: str | None = None


class WeightVersionSpan(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    version: str
    start: int = 0
    end: int = 0


class MetaInfo(BaseModel):
    """`meta_info` of a `/generate` response; unknown keys are kept (timing, logprobs...)."""

    model_config = ConfigDict(extra="allow", frozen=True)

    id: str = ""
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    weight_version: str | None = None
    weight_versions: list[WeightVersionSpan] = Field(default_factory=list)


class GenerateResult(BaseModel):
    """One completed (never aborted) sample, with how many tries it took."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    text: str
    output_ids: list[int] = Field(default_factory=list)
    meta_info: MetaInfo
    attempts: int = Field(default=1, ge=1, description="Requests sent, aborted ones included.")

    @property
    def weight_version(self) -> str | None:
        return self.meta_info.weight_version

    @property
    def finish_type(self) -> str | None:
        return self.meta_info.finish_reason.type if self.meta_info.finish_reason else None

    @property
    def truncated(self) -> bool:
        return self.finish_type == "length"


class EngineInfo(BaseModel):
    """`GET /model_info` of one engine: the live weight version and the model path it serves."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    url: str
    weight_version: str | None
    model_path: str
    served_model_name: str | None = None
    tokenizer_path: str | None = None
    load_format: str | None = None
    is_generation: bool | None = None

    @field_validator("url")
    @classmethod
    def _norm_url(cls, v: str) -> str:
        return normalize_url(v)


class ModelCard(BaseModel):
    """One `/v1/models` entry; SGLang lists each loaded LoRA adapter with `parent` = the base model."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    id: str
    root: str | None = None
    parent: str | None = None


class ModelList(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    data: list[ModelCard]


class LoRAUpdateOutput(BaseModel):
    """SGLang's reply to `/load_lora_adapter` and `/unload_lora_adapter`."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    success: bool
    error_message: str | None = None
    loaded_adapters: dict[str, Any] | None = None


class HealthState(StrEnum):
    UP = "up"  # /health answered 200
    BUSY = "busy"  # alive but not generating: loading, paused, or a 503 still within the deadline
    DEAD = "dead"  # connection refused, or 503 past the deadline with no load in flight


class EngineHealth(BaseModel):
    """One engine as the client sees it: process health plus what it knows of the weights."""

    model_config = ConfigDict(frozen=True)

    url: str
    state: HealthState
    detail: str = ""
    status_code: int | None = None
    loadable: bool = Field(default=False, description="Answers control calls: a weight load can start now.")
    weights_known: bool = Field(description="False after a failed load or a revival, until a pin verifies it.")
    verified_version: str | None = Field(default=None, description="Version the last pin verified, if any.")

    @property
    def serving(self) -> bool:
        """Fit to serve a pinned eval: up and its weights verified."""
        return self.state is HealthState.UP and self.weights_known


class LoadOutcome(BaseModel):
    """Result of `POST /update_weights_from_disk` on one engine."""

    model_config = ConfigDict(frozen=True)

    url: str
    ok: bool
    status_code: int | None = None
    message: str = ""
    error: Literal["rejected", "timeout", "connection", "http"] | None = None


class EngineCheck(BaseModel):
    """Load + read-back verdict for one engine in one pin attempt."""

    model_config = ConfigDict(frozen=True)

    url: str
    load: LoadOutcome
    weight_version: str | None = None
    model_path: str | None = None
    ok: bool
    problem: str = ""


class RouterWorker(BaseModel):
    """One entry of sglang-router's `GET /workers`."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    id: str
    url: str
    is_healthy: bool = False
    model_id: str | None = None
    load: int | None = None

    @field_validator("url")
    @classmethod
    def _norm_url(cls, v: str) -> str:
        return normalize_url(v)


class PinResult(BaseModel):
    """A fleet pinned to one weight version, verified on every engine."""

    model_config = ConfigDict(frozen=True)

    snapshot_path: str
    weight_version: str
    engines: list[EngineInfo]
    attempts: int = Field(ge=1)
    revived: list[str] = Field(default_factory=list, description="Engines revived before loading.")
    router_workers: list[str] = Field(default_factory=list, description="Router members after the pin.")
    duration_s: float = Field(ge=0)
