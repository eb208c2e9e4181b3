"""Request bodies of the engine's SGLang-native HTTP API, validated at the edge with pydantic.

Contract (SGLang 0.5.23 semantics, see the team's protocol reference §1.3-§1.8):
- `sampling_params` accepts exactly SGLang's keys (`SAMPLING_KEYS`); any other key is rejected
  with a message naming it (`ProtocolError`, HTTP 400 `{"error": ...}`). The seed key is
  `sampling_seed`. Null values mean "default".
- Keys implemented by the CPU engine: max_new_tokens, min_new_tokens, temperature (< 1e-6 means
  greedy), top_p, top_k (-1 or >= 2**30 means all), min_p, stop, stop_token_ids, stop_regex,
  frequency/presence/repetition_penalty, logit_bias, sampling_seed, n, ignore_eos,
  skip_special_tokens, no_stop_trim. Accepted and ignored (no CPU meaning here):
  json_schema, regex, ebnf, structural_tag, choice, beam_width, watermark, custom_params,
  stream_interval, spaces_between_special_tokens.
- Top-level unknown keys of every body are ignored, as in SGLang.
- `GenerateRequest.items()` flattens a single or batch request into `PromptItem`s in request
  order; `n > 1` is expanded later by the server, copies kept next to their prompt.
- `lora_path` names a loaded adapter (SGLang's semantics): one string for every prompt, or one
  entry per prompt of a batch (null = the base model).
- Logprobs (SGLang's `GenerateReqInput`): `return_logprob`, `logprob_start_len` (-1 = output
  tokens only; 0..len(prompt) = prompt tokens from there on; more is refused naming the field),
  `top_logprobs_num` (0 = none) and `return_text_in_logprobs`; each is one value for every prompt
  or one entry per prompt of a batch. They land in `PromptItem.logprobs` (None when not asked).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

SAMPLING_KEYS = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema",
    "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
    "no_stop_trim", "stream_interval", "logit_bias", "sampling_seed", "custom_params", "beam_width",
    "watermark", "choice",
)
ALL_TOKENS = 1 << 30


class ProtocolError(ValueError):
    """A request the engine refuses; the message names the offending field (HTTP 400)."""


def describe(err: ValidationError, prefix: str = "") -> str:
    """One line per pydantic error: `<field path>: <message>`."""
    parts = []
    for e in err.errors():
        loc = ".".join(str(p) for p in (prefix, *e["loc"]) if p != "")
        parts.append(f"{loc}: {e['msg']}" if loc else e["msg"])
    return "; ".join(parts)


class SamplingParams(BaseModel):
    """SGLang's `sampling_params`, defaults resolved."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_new_tokens: int = Field(default=128, ge=0)
    min_new_tokens: int = Field(default=0, ge=0)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = ALL_TOKENS
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=2.0)
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    stop_regex: list[str] = Field(default_factory=list)
    n: int = Field(default=1, ge=1, le=1024)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    logit_bias: dict[int, float] = Field(default_factory=dict)
    sampling_seed: int | None = None
    # Accepted and ignored on CPU (constrained decoding, beam search, streaming knobs).
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    choice: Any = None
    beam_width: int | None = None
    watermark: Any = None
    custom_params: dict[str, Any] | None = None
    stream_interval: int | None = None

    @model_validator(mode="before")
    @classmethod
    def _normalise(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        out = {k: v for k, v in data.items() if v is not None}
        for key in ("stop", "stop_regex"):
            if isinstance(out.get(key), str):
                out[key] = [out[key]]
        if out.get("top_k") == -1:
            out["top_k"] = ALL_TOKENS
        return out

    @model_validator(mode="after")
    def _check(self) -> SamplingParams:
        if self.top_k < 1:
            raise ValueError(f"top_k must be -1 (all) or >= 1, got {self.top_k}")
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens ({self.min_new_tokens}) must not exceed max_new_tokens ({self.max_new_tokens})"
            )
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-6 or self.top_k == 1

    @classmethod
    def parse(cls, raw: Any, where: str = "sampling_params") -> SamplingParams:
        """Validate one raw dict; unknown keys and bad values raise `ProtocolError` naming the field."""
        if raw is None:
            return cls()
        if not isinstance(raw, dict):
            raise ProtocolError(f"{where}: expected an object, got {type(raw).__name__}")
        unknown = sorted(set(raw) - set(SAMPLING_KEYS))
        if unknown:
            raise ProtocolError(f"{where}: unknown field `{unknown[0]}`, expected one of {', '.join(SAMPLING_KEYS)}")
        try:
            return cls.model_validate(raw)
        except ValidationError as err:
            raise ProtocolError(describe(err, where)) from None


@dataclass(frozen=True)
class LogprobSpec:
    """What one prompt asked for: SGLang's `logprob_start_len` (-1: output tokens only),
    `top_logprobs_num` and `return_text_in_logprobs`."""

    start_len: int = -1
    top_n: int = 0
    with_text: bool = False


@dataclass(frozen=True)
class PromptItem:
    """One prompt of a (possibly batched) /generate request."""

    index: int
    rid: str | None
    text: str | None
    input_ids: list[int] | None
    params: SamplingParams
    lora_name: str | None = None
    logprobs: LogprobSpec | None = None


def _per_prompt(value: Any, count: int, field: str, default: Any) -> list[Any]:
    """One value per prompt: a list must have one entry per prompt, a scalar is repeated."""
    if isinstance(value, list):
        if len(value) != count:
            raise ProtocolError(f"{field}: {len(value)} entries for a batch of {count} prompts")
        return [default if v is None else v for v in value]
    return [default if value is None else value] * count


class GenerateRequest(BaseModel):
    """SGLang's `GenerateReqInput` subset the CPU engine serves; unknown top-level keys ignored."""

    model_config = ConfigDict(extra="ignore")

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    input_embeds: Any = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: str | list[str] | None = None
    lora_path: str | list[str | None] | None = None
    stream: bool = False
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] = -1
    top_logprobs_num: int | list[int] = 0
    return_text_in_logprobs: bool = False

    @model_validator(mode="after")
    def _check(self) -> GenerateRequest:
        given = [k for k in ("text", "input_ids", "input_embeds") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError("exactly one of text, input_ids or input_embeds must be given")
        if self.input_embeds is not None:
            raise ValueError("input_embeds: not supported by the CPU engine")
        if self.stream:
            raise ValueError("stream: streaming is not supported by the CPU engine; send stream=false")
        return self

    @property
    def is_batch(self) -> bool:
        if self.text is not None:
            return isinstance(self.text, list)
        ids = self.input_ids or []
        return bool(ids) and isinstance(ids[0], list)

    def items(self) -> list[PromptItem]:
        """The prompts in request order, each with its validated sampling params and rid."""
        if self.is_batch:
            prompts: list[str | list[int]] = list(self.text if self.text is not None else self.input_ids)  # type: ignore[arg-type]
        else:
            prompts = [self.text if self.text is not None else self.input_ids]  # type: ignore[list-item]
        count = len(prompts)
        if count == 0:
            raise ProtocolError("text/input_ids: the batch is empty")
        if isinstance(self.sampling_params, list):
            if len(self.sampling_params) != count:
                raise ProtocolError(
                    f"sampling_params: {len(self.sampling_params)} entries for a batch of {count} prompts"
                )
            params = [SamplingParams.parse(p, f"sampling_params.{i}") for i, p in enumerate(self.sampling_params)]
        else:
            params = [SamplingParams.parse(self.sampling_params)] * count
        if isinstance(self.rid, list):
            if len(self.rid) != count:
                raise ProtocolError(f"rid: {len(self.rid)} ids for a batch of {count} prompts")
            rids: list[str | None] = list(self.rid)
        elif self.rid is not None and self.is_batch:
            rids = [f"{self.rid}_{i}" for i in range(count)]
        else:
            rids = [self.rid] * count
        if isinstance(self.lora_path, list):
            if len(self.lora_path) != count:
                raise ProtocolError(f"lora_path: {len(self.lora_path)} entries for a batch of {count} prompts")
            loras: list[str | None] = list(self.lora_path)
        else:
            loras = [self.lora_path] * count
        specs = self._logprob_specs(count)
        out = []
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                out.append(PromptItem(i, rids[i], prompt, None, params[i], loras[i], specs[i]))
            else:
                if not prompt:
                    raise ProtocolError(f"input_ids.{i}: empty prompt" if self.is_batch else "input_ids: empty")
                out.append(PromptItem(i, rids[i], None, list(prompt), params[i], loras[i], specs[i]))
        return out

    def _logprob_specs(self, count: int) -> list[LogprobSpec | None]:
        wanted = _per_prompt(self.return_logprob, count, "return_logprob", False)
        starts = _per_prompt(self.logprob_start_len, count, "logprob_start_len", -1)
        tops = _per_prompt(self.top_logprobs_num, count, "top_logprobs_num", 0)
        specs: list[LogprobSpec | None] = []
        for i in range(count):
            where = f".{i}" if isinstance(self.logprob_start_len, list) else ""
            if starts[i] < -1:
                raise ProtocolError(f"logprob_start_len{where}: must be -1 or >= 0, got {starts[i]}")
            if tops[i] < 0:
                raise ProtocolError(f"top_logprobs_num: must be >= 0, got {tops[i]}")
            specs.append(LogprobSpec(starts[i], tops[i], self.return_text_in_logprobs) if wanted[i] else None)
        return specs


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class UpdateWeightsFromDiskRequest(_Body):
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True
    torch_empty_cache: bool = False


class UpdateWeightVersionRequest(_Body):
    new_version: str
    abort_all_requests: bool = True


class PauseGenerationRequest(_Body):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueGenerationRequest(_Body):
    torch_empty_cache: bool = True


class AbortRequest(_Body):
    rid: str = ""
    abort_all: bool = False
    abort_message: str | None = None


class LoadLoRAAdapterRequest(_Body):
    """SGLang's `LoadLoRAAdapterReqInput` (`lora_id` is assigned by the server, ignored here)."""

    lora_name: str
    lora_path: str
    pinned: bool = False


class UnloadLoRAAdapterRequest(_Body):
    lora_name: str
