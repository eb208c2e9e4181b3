"""miles' eval config (YAML/JSON, a file, text, or `base64:<payload>`) mapped to suite fields.

Contract of `parse_miles_eval_config(source) -> MilesEvalConfig` (plain dicts, validated later
by `EvalSuite`):
- root: a mapping; `eval:` is used when present (then no other root key is allowed), else the
  root itself. Under it: `defaults` (mapping, optional), `datasets` (a list of mappings with
  `name`, or a mapping name -> fields), `delegate` (only empty: delegating a dataset to an
  outside evaluator is pinned-eval's external posture, a `CheckpointEvalFn` backend).
- dataset and defaults keys map miles' names onto pinned-eval's (`n_samples_per_eval_prompt`,
  `max_response_len`, `rm_type`, ...; pinned-eval's own names are accepted too). miles keys
  pinned-eval does not implement (`tool_key`, `stop_token_ids`, `min_new_tokens`,
  `custom_generate_function_path`) are accepted only when null/empty, so nothing set is lost.
- every refusal is a `ValueError` naming the key path, e.g. `eval.delegate[0].url: not supported`
  or `eval.datasets[1].rm_type: 'ifbench' not supported`.
- `rm_type`s: `math`, `boxed_math` (= math: it grades the `\\boxed{}` answer already), `f1`,
  `exact_match`, `deepscaler`, `dapo`, `gpqa`, `remote_rm` (needs the suite's `remote_reward`).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

# miles key -> pinned-eval field (identity keys included so our own names are accepted too)
MILES_KEYS = {
    "name": "name",
    "path": "path",
    "input_key": "input_key",
    "label_key": "label_key",
    "metadata_key": "metadata_key",
    "metadata_overrides": "metadata_overrides",
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
    "apply_chat_template_kwargs": "apply_chat_template_kwargs",
    "system_prompt": "system_prompt",
}
# miles dataset keys pinned-eval does not implement: allowed only when unset (null or empty)
UNSUPPORTED_UNLESS_EMPTY = ("tool_key", "stop_token_ids", "min_new_tokens", "custom_generate_function_path")
# miles rm_type -> pinned-eval reward
MILES_RM_TYPES = {
    "math": "math",
    "boxed_math": "math",
    "f1": "f1",
    "exact_match": "exact_match",
    "deepscaler": "deepscaler",
    "dapo": "dapo",
    "gpqa": "gpqa",
    "remote_rm": "remote_rm",
}
_EVAL_KEYS = ("defaults", "datasets", "delegate")


@dataclass(frozen=True)
class MilesEvalConfig:
    """The config as suite fields: `datasets` and `defaults` use pinned-eval field names."""

    datasets: list[dict[str, Any]]
    defaults: dict[str, Any]
    file_dir: str | None
    dataset_paths: list[str]  # key path of each dataset, e.g. "eval.datasets[1]"
    defaults_path: str = "eval.defaults"

    @staticmethod
    def key_path(where: str, field: str) -> str:
        """`where.<key>` with the miles key that sets pinned-eval's `field` (for error messages)."""
        miles = [k for k, f in MILES_KEYS.items() if f == field and k != field]
        return f"{where}.{'/'.join([*miles, field]) if miles else field}"


def parse_miles_eval_config(source: str | Path) -> MilesEvalConfig:
    """Read and map a miles eval config (see the module docstring)."""
    text, file_dir = _read_source(source)
    try:
        root = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"eval config is not valid YAML: {exc}") from exc
    if not isinstance(root, dict):
        raise ValueError("eval config: root must be a mapping")
    if "eval" in root:
        extra = sorted(str(k) for k in root if k != "eval")
        if extra:
            raise ValueError(f"{extra[0]}: not supported next to 'eval' (an eval config holds only 'eval:')")
        cfg, where = root["eval"], "eval"
    else:
        cfg, where = root, "eval"
    if not isinstance(cfg, dict):
        raise ValueError(f"{where}: must be a mapping")
    unknown = [str(k) for k in cfg if k not in _EVAL_KEYS]
    if unknown:
        raise ValueError(f"{where}.{unknown[0]}: not supported (an eval config has {list(_EVAL_KEYS)})")
    _refuse_delegate(f"{where}.delegate", cfg.get("delegate"))
    raw_defaults = cfg.get("defaults") or {}
    if not isinstance(raw_defaults, dict):
        raise ValueError(f"{where}.defaults: must be a mapping")
    entries = _dataset_entries(where, cfg)
    datasets = [map_miles_keys(w, entry) for w, entry in entries]
    return MilesEvalConfig(
        datasets, map_miles_keys(f"{where}.defaults", raw_defaults), file_dir, [w for w, _ in entries]
    )


def map_miles_keys(where: str, entry: dict[str, Any]) -> dict[str, Any]:
    """One dataset (or the defaults) with miles key names mapped to pinned-eval fields."""
    out: dict[str, Any] = {}
    for key, value in entry.items():
        if key in UNSUPPORTED_UNLESS_EMPTY:
            if value not in (None, [], "", {}):
                raise ValueError(f"{where}.{key}: not supported by pinned-eval (set it to null or remove it)")
            continue
        field = MILES_KEYS.get(key)
        if field is None:
            raise ValueError(f"{where}.{key}: not supported (known keys: {sorted(MILES_KEYS)})")
        if field in out:
            raise ValueError(f"{where}.{key}: sets '{field}' twice")
        if key == "rm_type" and value is not None:
            if value not in MILES_RM_TYPES:
                raise ValueError(
                    f"{where}.rm_type: {value!r} not supported (supported: {sorted(MILES_RM_TYPES)}; "
                    "use reward: 'custom:<module:function>' for others)"
                )
            value = MILES_RM_TYPES[value]
        if key == "stop" and isinstance(value, str):
            value = [value]
        out[field] = value
    return out


def _refuse_delegate(where: str, delegate: Any) -> None:
    if delegate in (None, [], {}):
        return
    first = where
    if isinstance(delegate, list):
        first = f"{where}[0]"
        if isinstance(delegate[0], dict) and delegate[0]:
            first = f"{first}.{next(iter(delegate[0]))}"
    elif isinstance(delegate, dict):
        first = f"{where}.{next(iter(delegate))}"
    raise ValueError(
        f"{first}: not supported (pinned-eval delegates evaluation through the external posture: "
        "a CheckpointEvalFn backend, e.g. trainer_integration.sglang_backend:SGLangCheckpointEval)"
    )


def _read_source(source: str | Path) -> tuple[str, str | None]:
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


def _dataset_entries(where: str, cfg: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    raw = cfg.get("datasets")
    if raw is None or raw == [] or raw == {}:
        raise ValueError(f"{where}.datasets: no datasets configured")
    if isinstance(raw, dict):  # mapping name -> fields (name injected)
        entries = []
        for name, fields in raw.items():
            if not isinstance(fields, dict):
                raise ValueError(f"{where}.datasets.{name}: must be a mapping")
            entries.append((f"{where}.datasets.{name}", {**fields, "name": str(name)}))
        return entries
    if not isinstance(raw, list):
        raise ValueError(f"{where}.datasets: must be a list or a mapping")
    out = []
    for i, entry in enumerate(raw):
        if not isinstance(entry, dict):
            raise ValueError(f"{where}.datasets[{i}]: must be a mapping")
        if "name" not in entry:
            raise ValueError(f"{where}.datasets[{i}].name: required")
        out.append((f"{where}.datasets[{i}]", entry))
    return out
