"""miles' eval config (YAML/JSON, a file, text, or `base64:<payload>`) mapped to suite fields.

Contract of `parse_miles_eval_config(source) -> MilesEvalConfig` (plain dicts, validated later
by `EvalSuite`):
- root: a mapping; `eval:` is used when present (then no other root key is allowed), else the
  root itself. Under it: `defaults` (mapping, optional), `datasets` (a list of mappings with
  `name`, or a mapping name -> fields), `delegate` (miles' outside evaluators, e.g. NeMo-Skills:
  `pinned_eval.delegate.config.parse_delegates`, refusals named by key path, e.g.
  `eval.delegate[0].url: required`).
- dataset and defaults keys map miles' names onto pinned-eval's (`n_samples_per_eval_prompt`,
  `max_response_len`, `rm_type`, `custom_generate_function_path` -> `generate_function`,
  `tool_key`, ...; pinned-eval's own names are accepted too). miles keys pinned-eval does not
  implement (`stop_token_ids`, `min_new_tokens`) are accepted only when null/empty, so nothing
  set is lost.
- every refusal is a `ValueError` naming the key path, e.g. `eval.delegate[0].bogus: not supported`
  or `eval.datasets[1].rm_type: reward 'ifbench': not supported: ...`; a file that is not UTF-8
  names the file and line, a YAML syntax error names the file (and line).
- interpolations, as miles reads its config with OmegaConf: `${VAR}` takes `variables[VAR]` (the
  caller's values, e.g. the CLI's `--set VAR=VALUE`), else the environment variable `VAR`, else a
  root key `VAR` of the config itself; `${oc.env:VAR}` (and `${oc.env:VAR,default}`) takes the
  caller's value first, else the environment. One that resolves to nothing is refused naming its
  key path (`eval.datasets[0].path: cannot resolve ${DATA_DIR} ...`).
- `rm_type`s: miles' `math`, `deepscaler`, `gemma_math`, `dapo`, `gpqa`, `f1`, `boxed_*`,
  `remote_rm` (needs the suite's `remote_reward`); `ifbench` is refused naming why.
  `boxed_math` loads with a `MilesDivergenceWarning` (miles scores it 0 on every row).
- pinned-eval's extension keys (`EXTENSION_KEYS`: `n_samples_per_prompt`, `max_new_tokens`,
  `reward`, `max_prompts`, `apply_chat_template`, `apply_chat_template_kwargs`, `system_prompt`,
  `generate_function`, miles' generate-function flags set per dataset (`generate_max_turns`,
  `generate_tool_specs_path`, `generate_tool_call_parser`, `generate_execute_tool_function_path`,
  `custom_agent_function_path`: on the
  miles CLI they are flags, not eval-config keys), the runner's `python_path` / `miles_python`
  and `rm_type: exact_match`) are refused with
  `strict_miles=True`, so a config that loads strictly means the same to miles.
"""

from __future__ import annotations

import base64
import os
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from pinned_eval.delegate.config import DelegateSpec, parse_delegates
from pinned_eval.scoring.rewards import MILES_DIVERGENCES, check_reward_name
from pinned_eval.yaml_files import parse_yaml, read_config_file, shown_key

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
    "num_examples": "num_examples",  # prime-rl's name of max_prompts (DatasetSpec maps it)
    "every_n_steps": "every_n_steps",  # cadence (DatasetSpec)
    "apply_chat_template": "apply_chat_template",
    "apply_chat_template_kwargs": "apply_chat_template_kwargs",
    "system_prompt": "system_prompt",
    "custom_generate_function_path": "generate_function",  # miles' per-dataset generate function
    "generate_function": "generate_function",
    "tool_key": "tool_key",
    # miles' generate-function CLI flags, accepted per dataset (pinned-eval extension keys)
    "generate_max_turns": "generate_max_turns",
    "generate_tool_specs_path": "generate_tool_specs_path",
    "generate_tool_call_parser": "generate_tool_call_parser",
    "custom_agent_function_path": "custom_agent_function_path",
    "generate_execute_tool_function_path": "generate_execute_tool_function_path",
    # the point gateway's limits (pinned-eval extension keys, docs/agentic.md)
    **{k: k for k in ("agent_max_requests", "agent_max_tokens", "agent_max_turns", "agent_max_tokens_per_sample",
                      "agent_sample_wall_s", "agent_sample_timeout_s")},
    # lm-eval tasks as a dataset (pinned-eval extension keys, docs/harnesses.md)
    **{k: k for k in ("kind", "tasks", "task_dir", "lm_eval_model", "num_fewshot")},
    # the generate-function runner's import roots and interpreter (pinned-eval extension keys)
    "python_path": "python_path",
    "miles_python": "miles_python",
    # miles' --reward-key / --eval-reward-key (CLI flags there: pinned-eval extension keys here)
    "reward_key": "reward_key",
    "eval_reward_key": "eval_reward_key",
}
# miles dataset keys pinned-eval does not implement: allowed only when unset (null or empty)
UNSUPPORTED_UNLESS_EMPTY = ("stop_token_ids", "min_new_tokens")
# pinned-eval's own keys (miles does not read them): refused under strict_miles
EXTENSION_KEYS = tuple(k for k, f in MILES_KEYS.items() if k not in (
    "name", "path", "input_key", "label_key", "metadata_key", "metadata_overrides", "n_samples_per_eval_prompt",
    "temperature", "top_p", "top_k", "max_response_len", "stop", "rm_type", "custom_generate_function_path",
    "tool_key"))
_ENV_REF = re.compile(r"\$\{oc\.env:([A-Za-z_]\w*)(?:,[^}]*)?\}")
_PLAIN_REF = re.compile(r"\$\{([A-Za-z_]\w*)\}")


class MilesDivergenceWarning(UserWarning):
    """A config uses an rm type whose miles result pinned-eval deliberately does not reproduce."""


_EVAL_KEYS = ("defaults", "datasets", "delegate")


@dataclass(frozen=True)
class MilesEvalConfig:
    """The config as suite fields: `datasets` and `defaults` use pinned-eval field names."""

    datasets: list[dict[str, Any]]
    defaults: dict[str, Any]
    file_dir: str | None
    dataset_paths: list[str]  # key path of each dataset, e.g. "eval.datasets[1]"
    defaults_path: str = "eval.defaults"
    delegates: tuple[DelegateSpec, ...] = ()  # eval.delegate

    @staticmethod
    def key_path(where: str, field: str) -> str:
        """`where.<key>` with the miles key that sets pinned-eval's `field` (for error messages)."""
        miles = [k for k, f in MILES_KEYS.items() if f == field and k != field]
        return f"{where}.{'/'.join([*miles, field]) if miles else field}"


def parse_miles_eval_config(
    source: str | Path, *, variables: Mapping[str, str] | None = None, strict_miles: bool = False
) -> MilesEvalConfig:
    """Read and map a miles eval config (see the module docstring)."""
    text, file_dir, name = _read_source(source)
    root = load_yaml(text, f"eval config {name}")
    if not isinstance(root, dict):
        raise ValueError("eval config: root must be a mapping")
    root = resolve_interpolations(root, variables or {})
    if "eval" in root:
        extra = sorted(str(k) for k in root if k != "eval")
        if extra:
            raise ValueError(f"{shown_key(extra[0])}: not supported next to 'eval' (an eval config holds only 'eval:')")
        cfg, where = root["eval"], "eval"
    else:
        cfg, where = root, "eval"
    if not isinstance(cfg, dict):
        raise ValueError(f"{where}: must be a mapping")
    unknown = [str(k) for k in cfg if k not in _EVAL_KEYS]
    if unknown:
        raise ValueError(f"{where}.{shown_key(unknown[0])}: not supported (an eval config has {list(_EVAL_KEYS)})")
    delegates = parse_delegates(f"{where}.delegate", cfg.get("delegate"), strict_miles=strict_miles)
    raw_defaults = cfg.get("defaults") or {}
    if not isinstance(raw_defaults, dict):
        raise ValueError(f"{where}.defaults: must be a mapping")
    entries = _dataset_entries(where, cfg)
    datasets = [map_miles_keys(w, entry, strict_miles=strict_miles) for w, entry in entries]
    return MilesEvalConfig(
        datasets,
        map_miles_keys(f"{where}.defaults", raw_defaults, strict_miles=strict_miles),
        file_dir,
        [w for w, _ in entries],
        delegates=delegates,
    )


def load_yaml(text: str, name: str) -> Any:
    """`pinned_eval.yaml_files.parse_yaml`: safe YAML, bounded nesting, duplicate keys refused; a
    syntax error raises a ValueError that starts with `name` (e.g. the file) and gives the line and
    column, never PyYAML's `<unicode string>`."""
    return parse_yaml(text, name)


def resolve_interpolations(root: dict[str, Any], variables: Mapping[str, str]) -> dict[str, Any]:
    """`root` with every `${...}` resolved by OmegaConf (see the module docstring for the sources)."""
    names: set[str] = set()

    def rewrite(node: Any) -> Any:
        if isinstance(node, str):
            node = _ENV_REF.sub(lambda m: f"${{{m.group(1)}}}" if m.group(1) in variables else m.group(0), node)
            names.update(_PLAIN_REF.findall(node))
            return node
        if isinstance(node, dict):
            return {k: rewrite(v) for k, v in node.items()}
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        return node

    rewritten = rewrite(root)
    if "${" not in repr(rewritten):
        return root
    supplied = {n: variables[n] if n in variables else os.environ[n]
                for n in names if n not in rewritten and (n in variables or n in os.environ)}
    conf = OmegaConf.create({**supplied, **rewritten})
    try:
        resolved = OmegaConf.to_container(conf, resolve=True)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "eval"
        raise ValueError(
            f"{key}: cannot resolve an interpolation ({str(exc).splitlines()[0]}); set the variable in the "
            "environment or pass it (CLI: --set NAME=VALUE)"
        ) from exc
    assert isinstance(resolved, dict)
    return {str(k): v for k, v in resolved.items() if k not in supplied}


def map_miles_keys(where: str, entry: dict[str, Any], *, strict_miles: bool = False) -> dict[str, Any]:
    """One dataset (or the defaults) with miles key names mapped to pinned-eval fields."""
    out: dict[str, Any] = {}
    for key, value in entry.items():
        if strict_miles and key in EXTENSION_KEYS:
            raise ValueError(f"{where}.{key}: a pinned-eval extension miles does not read (strict_miles)")
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
            try:
                if not isinstance(value, str) or value.startswith("custom:"):
                    raise ValueError(f"{value!r} is not an rm_type (use reward: 'custom:<module:function>')")
                check_reward_name(value, strict_miles=strict_miles)
            except ValueError as exc:
                raise ValueError(f"{where}.rm_type: {exc}") from exc
            if value in MILES_DIVERGENCES:
                warnings.warn(f"{where}.rm_type: {MILES_DIVERGENCES[value]}", MilesDivergenceWarning, stacklevel=2)
        if key == "stop" and isinstance(value, str):
            value = [value]
        out[field] = value
    return out


def _read_source(source: str | Path) -> tuple[str, str | None, str]:
    """(text, directory of the file or None, a name for messages); files through the one reader
    (`pinned_eval.yaml_files.read_config_file`: regular files only, bounded size, UTF-8)."""
    if isinstance(source, Path):
        return read_config_file(source, f"eval config {source}"), str(source.absolute().parent), str(source)
    if source.startswith("base64:"):
        data = base64.b64decode(source.removeprefix("base64:"))
        try:
            return data.decode("utf-8"), None, "base64:..."
        except UnicodeDecodeError as exc:
            line = data[: exc.start].count(b"\n") + 1
            why = f"line {line}, byte {exc.start}: {exc.reason}"
            raise ValueError(f"eval config base64:...: not UTF-8 ({why})") from exc
    path = Path(source).expanduser()
    if "\n" not in source and (source.endswith((".yaml", ".yml", ".json")) or _names_a_file(path)):
        if not _names_a_file(path):
            raise FileNotFoundError(f"eval config file not found: {path}")
        return read_config_file(path, f"eval config {path}"), str(path.absolute().parent), str(path)
    return source, None, "(text)"


def _names_a_file(path: Path) -> bool:
    """Something other than a directory exists at `path` (a FIFO too: the reader refuses it)."""
    try:
        return path.exists() and not path.is_dir()
    except (OSError, ValueError):  # a name too long, a NUL: YAML text, not a path
        return False


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
