"""miles' `eval.delegate` entries, as miles reads them, and the request body miles posts.

Contract (miles' `examples/experimental/eval/eval_delegate.py` and its NeMo-Skills client):
- `eval.delegate` is a list of mappings `{name, url, timeout_secs=3600, max_retries=1,
  headers={}, defaults={}, datasets=[...]}`; each dataset a mapping `{name, n_samples_per_eval_prompt,
  temperature, top_p, top_k, max_response_len}`. Any other key is refused naming its key path
  (miles' structured config refuses it too). pinned-eval also refuses what miles would only fail
  on later or silently drop: a missing or non-http(s) `url`, no datasets, a header value that is
  not a string, two delegates of one name. Under `strict_miles` the name must be `skills`, the
  only delegate miles registers.
- dataset names are stripped; an empty one or one with `:` is refused (miles' rule).
- a dataset field resolves as miles resolves it: the dataset's value, else the delegate's own
  `defaults` (not `eval.defaults`: miles does not apply those to delegate datasets), else the
  suite's fallbacks (miles' `--eval-*` / `--rollout-*` flags: `n_samples_per_prompt`,
  `temperature`, `top_p`, `top_k`, `max_new_tokens`). A value set to null stays unset and is left
  out of the request, as in miles.
- `request_body(...)` is the exact bytes miles' client posts: `{"rollout_id", "router_url",
  "benchmarks"}` as `json.dumps` writes it (tested byte for byte against miles' own client).
This module imports nothing heavy.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

__all__ = ["DELEGATE_KEYS", "DelegateDataset", "DelegateSpec", "parse_delegates", "request_body"]

DELEGATE_KEYS = ("name", "url", "timeout_secs", "max_retries", "headers", "defaults", "datasets")
_RUNTIME = ("n_samples_per_eval_prompt", "temperature", "top_p", "top_k", "max_response_len")
# miles' field -> the pinned-eval fallback (SamplingFallbacks) that plays miles' CLI flag
FALLBACK_OF = {"n_samples_per_eval_prompt": "n_samples_per_prompt", "temperature": "temperature",
               "top_p": "top_p", "top_k": "top_k", "max_response_len": "max_new_tokens"}
_FROZEN = ConfigDict(frozen=True, extra="forbid")


class _Runtime(BaseModel):
    """The generation fields miles sends per benchmark. `unset`: the fields the YAML did not name
    (they inherit; one named with null stays null and is left out of the request, as in miles)."""

    model_config = _FROZEN

    n_samples_per_eval_prompt: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)
    max_response_len: int | None = Field(default=None, ge=1)
    unset: tuple[str, ...] = _RUNTIME


class DelegateDataset(_Runtime):
    """One benchmark of a delegate."""

    name: str = Field(min_length=1)

    @field_validator("name", mode="before")
    @classmethod
    def _strip(cls, value: Any) -> Any:
        return value.strip() if isinstance(value, str) else value

    @field_validator("name")
    @classmethod
    def _no_colon(cls, value: str) -> str:
        if ":" in value:
            raise ValueError("a ':' is not allowed (use n_samples_per_eval_prompt for samples per prompt)")
        return value


class DelegateSpec(BaseModel):
    """One `eval.delegate` entry (see the module docstring)."""

    model_config = _FROZEN

    name: str = Field(min_length=1, description="The delegate's name (skip messages, records).")
    url: str = Field(description="Where the evaluation request is posted (http or https).")
    timeout_secs: float = Field(default=3600, gt=0, description="Deadline of one attempt, in seconds.")
    max_retries: int = Field(default=1, description="Attempts (miles: at least 1).")
    headers: dict[str, str] = Field(default_factory=dict, description="Extra request headers.")
    defaults: _Runtime = Field(default_factory=_Runtime, description="The delegate's own dataset defaults.")
    datasets: tuple[DelegateDataset, ...] = Field(min_length=1, description="Benchmarks the delegate runs.")

    @field_validator("url")
    @classmethod
    def _http_only(cls, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"must be an http(s) URL with a host, got {shown_url(value)!r}")
        return value.rstrip("/")  # miles strips a trailing '/'

    @property
    def attempts(self) -> int:
        return max(1, self.max_retries)

    def benchmarks(self, fallbacks: Any) -> list[dict[str, Any]]:
        """miles' `benchmarks` payloads: dataset > delegate defaults > `fallbacks` (SamplingFallbacks)."""
        out = []
        for ds in self.datasets:
            payload: dict[str, Any] = {"name": ds.name}
            for field in _RUNTIME:
                if field not in ds.unset:
                    value = getattr(ds, field)
                elif field not in self.defaults.unset:
                    value = getattr(self.defaults, field)
                else:
                    value = getattr(fallbacks, FALLBACK_OF[field])
                if value is not None:
                    payload[field] = float(value) if field in ("temperature", "top_p") else value
            out.append(payload)
        return out


def shown_url(url: str) -> str:
    """`url` without credentials, query or fragment (for messages and records)."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        return "<unparsable URL>"
    return f"{parts.scheme}://{host}{port}{parts.path}"


def request_body(spec: DelegateSpec, fallbacks: Any, rollout_id: int, router_url: str) -> bytes:
    """The bytes miles' client posts to `spec.url` (`requests`' `json=`: `json.dumps`, UTF-8)."""
    payload = {"rollout_id": rollout_id, "router_url": router_url.rstrip("/"), "benchmarks": spec.benchmarks(fallbacks)}
    return json.dumps(payload, allow_nan=False).encode("utf-8")


def parse_delegates(where: str, raw: Any, *, strict_miles: bool = False) -> tuple[DelegateSpec, ...]:
    """`eval.delegate` as `DelegateSpec`s; a bad entry raises ValueError naming its key path."""
    if raw is None or raw == []:
        return ()
    if not isinstance(raw, list):
        raise ValueError(f"{where}: must be a list of delegates (name, url, datasets, ...)")
    specs: list[DelegateSpec] = []
    for i, entry in enumerate(raw):
        at = f"{where}[{i}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{at}: must be a mapping (name, url, datasets, ...)")
        unknown = [str(k) for k in entry if k not in DELEGATE_KEYS]
        if unknown:
            raise ValueError(f"{at}.{unknown[0]}: not supported (a delegate has {list(DELEGATE_KEYS)})")
        for key in ("name", "url", "datasets"):
            if entry.get(key) in (None, "", []):
                raise ValueError(f"{at}.{key}: required")
        name = entry["name"].strip() if isinstance(entry["name"], str) else entry["name"]
        if strict_miles and name != "skills":
            raise ValueError(f"{at}.name: miles registers only the delegate 'skills' (strict_miles), got {name!r}")
        datasets = entry["datasets"]
        if not isinstance(datasets, list):
            raise ValueError(f"{at}.datasets: must be a list of mappings with a name")
        parsed = [_dataset(f"{at}.datasets[{j}]", d) for j, d in enumerate(datasets)]
        defaults = entry.get("defaults") or {}
        if not isinstance(defaults, Mapping):
            raise ValueError(f"{at}.defaults: must be a mapping")
        extra = [str(k) for k in defaults if k not in _RUNTIME]
        if extra:
            raise ValueError(f"{at}.defaults.{extra[0]}: not supported (delegate defaults set {list(_RUNTIME)})")
        unset = tuple(f for f in _RUNTIME if f not in defaults)
        runtime = _model(_Runtime, f"{at}.defaults", {**defaults, "unset": unset})
        fields = {**entry, "name": name, "datasets": parsed, "defaults": runtime,
                  "headers": entry.get("headers") or {}}
        spec = _model(DelegateSpec, at, fields)
        if any(s.name == spec.name for s in specs):
            raise ValueError(f"{at}.name: {spec.name!r} names two delegates")
        specs.append(spec)
    return tuple(specs)


def _dataset(at: str, entry: Any) -> DelegateDataset:
    if not isinstance(entry, dict):
        raise ValueError(f"{at}: must be a mapping with a name, got {entry!r:.60}")
    unknown = [str(k) for k in entry if k != "name" and k not in _RUNTIME]
    if unknown:
        raise ValueError(f"{at}.{unknown[0]}: not supported (a delegate dataset has {['name', *_RUNTIME]})")
    if entry.get("name") is None:
        raise ValueError(f"{at}.name: required")
    unset = tuple(f for f in _RUNTIME if f not in entry)
    return _model(DelegateDataset, at, {**entry, "unset": unset})


def _model(model: Any, at: str, fields: Mapping[str, Any]) -> Any:
    try:
        return model(**fields)
    except ValidationError as exc:
        problems = "; ".join(
            f"{at}.{'.'.join(map(str, e['loc']))}: {e['msg']} (got {e.get('input')!r:.60})" for e in exc.errors()
        )
        raise ValueError(problems) from None
