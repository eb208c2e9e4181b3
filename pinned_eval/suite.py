"""Eval suite configuration: datasets, sampling, rewards, and miles-compatible YAML.

Contract:
- `DatasetSpec` fields left `None` inherit. Precedence per field (miles `_resolve_eval_datasets`):
  dataset value > suite `defaults` > suite `fallbacks` (the analogue of miles' `--eval-*` /
  `--rollout-*` args). `EvalSuite.resolved()` returns `ResolvedDataset`s with every field concrete.
- Dataset paths: absolute, relative (resolved against `EvalSuite.base_dir`, else the working
  directory), or `builtin:<file>` (a file shipped in `pinned_eval/datasets/`).
- `EvalSuite.from_miles_yaml` accepts miles' eval YAML (`eval: {defaults, datasets}`; datasets a
  list or a name → mapping) and maps miles key names; keys pinned-eval does not implement are
  rejected by name rather than silently ignored.
- Dataset rows are loaded by `pinned_eval.scoring.loader.load_dataset` (re-exported here).
This module imports nothing heavy (no Prefect, no torch).
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

from pinned_eval.scoring.loader import DatasetError, EvalSample, load_dataset
from pinned_eval.scoring.rewards import check_reward_name

__all__ = [
    "DatasetError",
    "DatasetSpec",
    "EvalSample",
    "EvalSuite",
    "ResolvedDataset",
    "SamplingDefaults",
    "SamplingFallbacks",
    "default_suite",
    "load_dataset",
]

BUILTIN_PREFIX = "builtin:"
BUILTIN_DIR = Path(__file__).parent / "datasets"
DATASET_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$"

RewardName = Annotated[str, AfterValidator(check_reward_name)]
_FROZEN = ConfigDict(frozen=True, extra="forbid")


class _SamplingFields(BaseModel):
    """The inheritable fields; `None` means "inherit from the next level"."""

    model_config = _FROZEN

    input_key: str | None = Field(
        default=None, min_length=1, description="Row key of the prompt (fallback 'prompt')."
    )
    label_key: str | None = Field(
        default=None, min_length=1, description="Row key of the label (fallback 'label')."
    )
    n_samples_per_prompt: int | None = Field(
        default=None, ge=1, description="Responses generated per prompt."
    )
    temperature: float | None = Field(default=None, ge=0, description="Sampling temperature; 0 is greedy.")
    top_p: float | None = Field(default=None, gt=0, le=1, description="Nucleus sampling mass.")
    top_k: int | None = Field(
        default=None, ge=-1, description="Top-k sampling; -1 disables it (SGLang's convention)."
    )
    max_new_tokens: int | None = Field(
        default=None, ge=1, description="Max generated tokens (miles: max_response_len)."
    )
    stop: tuple[str, ...] | None = Field(default=None, description="Stop strings passed to the engine.")
    reward: RewardName | None = Field(
        default=None, description="Reward: 'exact_match' | 'math' | 'f1' | 'custom:<module:function>'."
    )
    max_prompts: int | None = Field(
        default=None, ge=1, description="Use only the first N prompts of the file."
    )
    apply_chat_template: bool | None = Field(
        default=None, description="Render prompts with the model's chat template (fallback False)."
    )


class SamplingDefaults(_SamplingFields):
    """Suite-level defaults (miles `eval.defaults`): used where a dataset leaves a field unset."""


class DatasetSpec(_SamplingFields):
    """One eval dataset; unset fields inherit from the suite."""

    name: str = Field(pattern=DATASET_NAME_PATTERN, description="Slug used in metric keys: eval/<name>.")
    path: str = Field(
        min_length=1, description="JSONL or Parquet file: absolute, relative, or builtin:<file>."
    )


class SamplingFallbacks(BaseModel):
    """Last level of precedence (miles: the `--eval-*` then `--rollout-*` args). Every field concrete."""

    model_config = _FROZEN

    input_key: str = Field(default="prompt", min_length=1, description="Row key of the prompt.")
    label_key: str = Field(default="label", min_length=1, description="Row key of the label.")
    n_samples_per_prompt: int = Field(default=1, ge=1, description="Responses per prompt (miles default 1).")
    temperature: float = Field(
        default=1.0, ge=0, description="Sampling temperature (miles rollout default 1.0)."
    )
    top_p: float = Field(default=1.0, gt=0, le=1, description="Nucleus sampling mass.")
    top_k: int = Field(default=-1, ge=-1, description="Top-k sampling; -1 disables it.")
    max_new_tokens: int = Field(default=1024, ge=1, description="Max generated tokens per response.")
    stop: tuple[str, ...] = Field(default=(), description="Stop strings.")
    reward: RewardName = Field(default="exact_match", description="Reward function name.")
    max_prompts: int | None = Field(default=None, ge=1, description="Prompt cap; None uses all prompts.")
    apply_chat_template: bool = Field(default=False, description="Render prompts with the chat template.")


class ResolvedDataset(BaseModel):
    """A dataset with every field concrete and its path absolute; what tasks consume."""

    model_config = _FROZEN

    name: str = Field(description="Slug used in metric keys.")
    path: Path = Field(description="Absolute path of the JSONL or Parquet file.")
    input_key: str = Field(description="Row key of the prompt.")
    label_key: str = Field(description="Row key of the label.")
    n_samples_per_prompt: int = Field(ge=1, description="Responses per prompt.")
    temperature: float = Field(ge=0, description="Sampling temperature.")
    top_p: float = Field(gt=0, le=1, description="Nucleus sampling mass.")
    top_k: int = Field(ge=-1, description="Top-k; -1 disables.")
    max_new_tokens: int = Field(ge=1, description="Max generated tokens.")
    stop: tuple[str, ...] = Field(description="Stop strings.")
    reward: RewardName = Field(description="Reward function name (see pinned_eval.scoring.rewards).")
    max_prompts: int | None = Field(description="Prompt cap; None uses all prompts.")
    apply_chat_template: bool = Field(description="Render prompts with the chat template.")

    def sampling_params(self) -> dict[str, Any]:
        """SGLang native `/generate` sampling_params for this dataset."""
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "max_new_tokens": self.max_new_tokens,
            "stop": list(self.stop),
        }


_INHERITED = tuple(SamplingFallbacks.model_fields)


class EvalSuite(BaseModel):
    """Datasets + defaults + fallbacks, plus suite-wide metric options."""

    model_config = _FROZEN

    datasets: tuple[DatasetSpec, ...] = Field(
        min_length=1, description="Datasets, each logged as eval/<name>."
    )
    defaults: SamplingDefaults = Field(default_factory=SamplingDefaults, description="miles eval.defaults.")
    fallbacks: SamplingFallbacks = Field(
        default_factory=SamplingFallbacks,
        description="Values used where dataset and defaults leave a field unset.",
    )
    pass_at_k: bool = Field(default=False, description="Log eval/<ds>-pass@k for datasets with n > 1.")
    pass_threshold: float = Field(
        default=1.0,
        description="A sample counts as a pass@k success when reward >= this (1.0 for binary rewards).",
    )
    base_dir: str | None = Field(
        default=None,
        description="Directory relative dataset paths resolve against; None = working directory.",
    )

    @model_validator(mode="after")
    def _unique_names(self) -> EvalSuite:
        names = [d.name for d in self.datasets]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"datasets: duplicate dataset name(s) {dupes}")
        return self

    def resolved(self) -> list[ResolvedDataset]:
        """Every dataset with precedence applied: dataset > defaults > fallbacks."""
        out = []
        for ds in self.datasets:
            values: dict[str, Any] = {}
            for field in _INHERITED:
                value = getattr(ds, field)
                if value is None:
                    value = getattr(self.defaults, field)
                if value is None:
                    value = getattr(self.fallbacks, field)
                values[field] = value
            out.append(ResolvedDataset(name=ds.name, path=self._resolve_path(ds.path), **values))
        return out

    def _resolve_path(self, raw: str) -> Path:
        if raw.startswith(BUILTIN_PREFIX):
            return BUILTIN_DIR / raw.removeprefix(BUILTIN_PREFIX)
        path = Path(raw).expanduser()
        if not path.is_absolute():
            path = Path(self.base_dir or ".").expanduser() / path
        return path.absolute()

    @classmethod
    def from_miles_yaml(
        cls,
        path_or_text: str | Path,
        *,
        fallbacks: SamplingFallbacks | None = None,
        pass_at_k: bool = False,
        base_dir: str | None = None,
    ) -> EvalSuite:
        """Load miles' eval config: a file path, YAML/JSON text, or `base64:<payload>`.

        Relative dataset paths resolve against the file's directory (or `base_dir` when given).
        """
        text, file_dir = _read_config_source(path_or_text)
        try:
            root = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ValueError(f"eval config is not valid YAML: {exc}") from exc
        if not isinstance(root, dict):
            raise ValueError("eval config: root must be a mapping")
        cfg = root.get("eval", root)
        if not isinstance(cfg, dict):
            raise ValueError("eval: must be a mapping")
        unknown = sorted(set(cfg) - {"defaults", "datasets"})
        if unknown:
            raise ValueError(f"eval: unsupported key(s) {unknown}; expected 'defaults' and 'datasets'")
        raw_defaults = cfg.get("defaults") or {}
        if not isinstance(raw_defaults, dict):
            raise ValueError("eval.defaults: must be a mapping")
        datasets = [
            _map_miles_keys(f"eval.datasets[{i}]", entry) for i, entry in enumerate(_dataset_entries(cfg))
        ]
        try:
            return cls(
                datasets=tuple(DatasetSpec(**d) for d in datasets),
                defaults=SamplingDefaults(**_map_miles_keys("eval.defaults", raw_defaults)),
                fallbacks=fallbacks or SamplingFallbacks(),
                pass_at_k=pass_at_k,
                base_dir=base_dir or file_dir,
            )
        except ValidationError as exc:
            raise ValueError(f"eval config: {exc}") from exc


# miles key -> pinned-eval field (identity keys included so our own names are accepted too).
_MILES_KEYS = {
    "name": "name",
    "path": "path",
    "input_key": "input_key",
    "label_key": "label_key",
    "n_samples_per_eval_prompt": "n_samples_per_prompt",
    "n_samples_per_prompt": "n_samples_per_prompt",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "max_response_len": "max_new_tokens",
    "max_new_tokens": "max_new_tokens",
    "stop": "stop",
    "rm_type": "reward",
    "reward": "reward",
    "max_prompts": "max_prompts",
    "apply_chat_template": "apply_chat_template",
}
# miles rm_type -> pinned-eval reward (miles' math rewards already grade the \boxed{} answer).
_MILES_RM_TYPES = {"math": "math", "boxed_math": "math", "f1": "f1", "exact_match": "exact_match"}


def _read_config_source(source: str | Path) -> tuple[str, str | None]:
    if isinstance(source, Path):
        return source.read_text(encoding="utf-8"), str(source.absolute().parent)
    if source.startswith("base64:"):
        return base64.b64decode(source.removeprefix("base64:")).decode("utf-8"), None
    path = Path(source).expanduser()
    if "\n" not in source and (source.endswith((".yaml", ".yml", ".json")) or path.is_file()):
        if not path.is_file():
            raise FileNotFoundError(f"eval config file not found: {path}")
        return path.read_text(encoding="utf-8"), str(path.absolute().parent)
    return source, None


def _dataset_entries(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    raw = cfg.get("datasets")
    if raw is None or raw == [] or raw == {}:
        raise ValueError("eval.datasets: no datasets configured")
    if isinstance(raw, dict):  # mapping name -> fields (name injected)
        entries = []
        for name, fields in raw.items():
            if not isinstance(fields, dict):
                raise ValueError(f"eval.datasets.{name}: must be a mapping")
            entries.append({**fields, "name": str(name)})
        return entries
    if not isinstance(raw, list):
        raise ValueError("eval.datasets: must be a list or a mapping")
    for i, entry in enumerate(raw):
        if not isinstance(entry, dict):
            raise ValueError(f"eval.datasets[{i}]: must be a mapping")
        if "name" not in entry:
            raise ValueError(f"eval.datasets[{i}].name: required")
    return raw


def _map_miles_keys(where: str, entry: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in entry.items():
        field = _MILES_KEYS.get(key)
        if field is None:
            raise ValueError(
                f"{where}.{key}: key not supported by pinned-eval (known: {sorted(_MILES_KEYS)})"
            )
        if field in out:
            raise ValueError(f"{where}.{key}: sets '{field}' twice")
        if key == "rm_type" and value is not None:
            if value not in _MILES_RM_TYPES:
                raise ValueError(
                    f"{where}.rm_type: {value!r} not supported (supported: {sorted(_MILES_RM_TYPES)}; "
                    "use reward: 'custom:<module:function>' for others)"
                )
            value = _MILES_RM_TYPES[value]
        if key == "stop" and isinstance(value, str):
            value = [value]
        out[field] = value
    return out


def default_suite(*, with_pass_at_k: bool = False) -> EvalSuite:
    """The demo's suite: greedy exact-match on builtin arithmetic (the tiny model learns 'a+b=c').

    `with_pass_at_k=True` adds `arith_add_sampled` (same prompts, n=4, temperature 0.8) and turns
    on eval/<ds>-pass@k logging.
    """
    datasets = [
        DatasetSpec(name="arith_add", path=f"{BUILTIN_PREFIX}arith_add.jsonl"),
        DatasetSpec(name="arith_sub", path=f"{BUILTIN_PREFIX}arith_sub.jsonl"),
    ]
    if with_pass_at_k:
        datasets.append(
            DatasetSpec(
                name="arith_add_sampled",
                path=f"{BUILTIN_PREFIX}arith_add.jsonl",
                n_samples_per_prompt=4,
                temperature=0.8,
            )
        )
    return EvalSuite(
        datasets=tuple(datasets),
        defaults=SamplingDefaults(
            n_samples_per_prompt=1, temperature=0.0, max_new_tokens=4, reward="exact_match", stop=("\n",)
        ),
        pass_at_k=with_pass_at_k,
    )
