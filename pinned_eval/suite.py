"""Eval suite configuration: datasets, sampling, rewards, and miles-compatible YAML.

The suite composes datasets; what one dataset is lives in `pinned_eval.datasets` (`declared`:
`DatasetSpec`, `SamplingDefaults`, `SamplingFallbacks` and their per-dataset and per-kind checks;
`spec`: `ResolvedDataset`; `loader`: rows). Those names are importable from here too.

Contract:
- `DatasetSpec` fields left `None` inherit. Precedence per field (miles `_resolve_eval_datasets`):
  dataset value > suite `defaults` > suite `fallbacks` (the analogue of miles' `--eval-*` /
  `--rollout-*` args). `EvalSuite.resolved()` returns `ResolvedDataset`s with every field concrete.
- Dataset paths: absolute, relative (resolved against `EvalSuite.base_dir`, else the working
  directory), or `builtin:<file>` (a file shipped in `pinned_eval/datasets/builtin/`).
- `EvalSuite.from_miles_yaml` accepts miles' eval YAML (`eval: {defaults, datasets, delegate}`;
  datasets a list or a name → mapping) and maps miles key names (`pinned_eval.miles_config`);
  keys pinned-eval does not implement are rejected by key path rather than silently ignored.
  `delegate` entries become `EvalSuite.delegates` (`pinned_eval.delegate`, docs/harnesses.md).
- Prompts are rendered for the engine by `pinned_eval.prompts` (chat template, system prompt).
- `DatasetError`, `EvalSample`, `ResolvedDataset` and `load_dataset` are re-exported here for one
  release (outside code may import them from the suite); new code imports them from
  `pinned_eval.datasets`.
- Cadence (prime-rl's per-environment `interval` and `num_examples`): a dataset with
  `every_n_steps: N` is due at the steps that are multiples of N, one without it at every point;
  the final point runs every dataset (`EvalSuite.due_at`). `num_examples` is accepted as another
  name of `max_prompts` (the first N prompts); setting both is refused.
This module imports nothing heavy (no Prefect, no torch).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pinned_eval.datasets.declared import DatasetSpec, SamplingDefaults, SamplingFallbacks
from pinned_eval.datasets.loader import DatasetError, EvalSample, load_dataset
from pinned_eval.datasets.spec import BUILTIN_DIR, BUILTIN_PREFIX, ResolvedDataset
from pinned_eval.delegate.config import DelegateSpec
from pinned_eval.miles_config import MilesEvalConfig, parse_miles_eval_config
from pinned_eval.plugins import is_import_path
from pinned_eval.scoring.remote import RemoteRewardConfig
from pinned_eval.scoring.rewards import REMOTE_REWARD, check_reward_name

# DatasetSpec, SamplingDefaults and SamplingFallbacks are the suite's parts (pinned_eval.datasets.declared);
# DatasetError, EvalSample, ResolvedDataset and load_dataset stay importable from here for one release.
__all__ = [
    "DatasetError",
    "DatasetSpec",
    "EvalSample",
    "EvalSuite",
    "RemoteRewardConfig",
    "ResolvedDataset",
    "SamplingDefaults",
    "SamplingFallbacks",
    "default_suite",
    "load_dataset",
]

NO_DATASET_DUE = "no_dataset_due"  # the skip reason of a point at which no dataset is due
_FROZEN = ConfigDict(frozen=True, extra="forbid")
_INHERITED = tuple(SamplingFallbacks.model_fields)
GATEWAY_FIELDS = ("agent_max_requests", "agent_max_tokens", "agent_max_turns", "agent_max_tokens_per_sample",
                  "agent_sample_wall_s")
RUNNER_FIELDS = ("python_path", "miles_python")  # one runner per point serves every agentic dataset
_M = TypeVar("_M", bound=BaseModel)


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
    remote_reward: RemoteRewardConfig | None = Field(
        default=None, description="Scoring service of datasets whose reward is 'remote_rm' (miles --rm-url)."
    )
    delegates: tuple[DelegateSpec, ...] = Field(
        default=(), description="miles eval.delegate: outside evaluators run against the point's gateway."
    )

    @model_validator(mode="after")
    def _unique_names(self) -> EvalSuite:
        names = [d.name for d in self.datasets]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"datasets: duplicate dataset name(s) {dupes}")
        return self

    @model_validator(mode="after")
    def _one_gateway(self) -> EvalSuite:
        """Every gateway of a point (agentic datasets, lm-eval tasks) has the suite's limits, and one
        generate-function runner serves the agentic datasets: those values must agree across them."""
        agentic = [ds for ds in self.resolved() if ds.generate_function is not None]
        gated = [ds for ds in self.resolved() if ds.generate_function is not None or ds.kind == "lm_eval"]
        for field in GATEWAY_FIELDS + RUNNER_FIELDS:
            group = gated if field in GATEWAY_FIELDS else agentic
            values = {getattr(ds, field) for ds in group}
            if len(values) > 1:
                names = [ds.name for ds in group]
                what = "gateway" if field in GATEWAY_FIELDS else "generate-function runner"
                raise ValueError(f"{field}: one {what} per point serves datasets {names}; "
                                 f"they set different values {sorted(values, key=str)}; set it once in defaults")
        return self

    @model_validator(mode="after")
    def _remote_reward_configured(self) -> EvalSuite:
        remote = [ds.name for ds in self.resolved() if ds.reward == REMOTE_REWARD]
        if remote and self.remote_reward is None:
            raise ValueError(f"remote_reward: datasets {remote} use reward 'remote_rm' but no remote_reward is set")
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
            values["python_path"] = self.import_roots(values["python_path"])
            if values["miles_python"] is not None:
                values["miles_python"] = str((Path(self.base_dir or ".") / Path(values["miles_python"]).expanduser())
                                             .absolute())
            path = self._resolve_path(ds.path) if ds.path is not None else None
            task_dir = self._resolve_path(ds.task_dir) if ds.task_dir is not None else None
            out.append(
                ResolvedDataset(
                    name=ds.name, path=path, every_n_steps=ds.every_n_steps, kind=ds.kind, tasks=ds.tasks or (),
                    task_dir=task_dir, lm_eval_model=ds.lm_eval_model, num_fewshot=ds.num_fewshot, **values,
                )
            )
        return out

    def due_at(self, step: int, *, final: bool = False) -> EvalSuite | None:
        """This suite with only the datasets due at `step` (all of them at the final point); None
        when no dataset is due there."""
        due = tuple(ds for ds in self.datasets if ds.due(step, final=final))
        return self.model_copy(update={"datasets": due}) if due else None

    def import_roots(self, python_path: tuple[str, ...] | None) -> tuple[str, ...]:
        """The generate-function runner's import roots: each `python_path` entry made absolute
        against `base_dir` (else the working directory); unset: `base_dir` alone (a module beside
        the YAML imports as miles' examples do with their directory on PYTHONPATH), or none
        without a `base_dir`. The same roots serve the load check and every point."""
        if python_path is None:
            return (str(Path(self.base_dir).expanduser().absolute()),) if self.base_dir else ()
        base = Path(self.base_dir or ".").expanduser()
        return tuple(str((base / Path(p).expanduser()).absolute()) for p in python_path)

    def _resolve_path(self, raw: str) -> Path:
        if raw.startswith(BUILTIN_PREFIX):
            return BUILTIN_DIR / raw.removeprefix(BUILTIN_PREFIX)
        path = Path(raw).expanduser()
        if not path.is_absolute():
            path = Path(self.base_dir or ".").expanduser() / path
        return path.absolute()

    def miles_args(self, ds: ResolvedDataset) -> SimpleNamespace:
        """The `args` namespace a miles `async (args, sample)` reward gets for `ds` (miles' names)."""
        custom = ds.reward.removeprefix("custom:") if ds.reward.startswith("custom:") else None
        return SimpleNamespace(
            rm_type=None if custom else ds.reward,
            custom_rm_path=custom,
            reward_key=ds.reward_key,
            eval_reward_key=ds.eval_reward_key,
            rm_url=str(self.remote_reward.url) if self.remote_reward else None,
            n_samples_per_eval_prompt=ds.n_samples_per_prompt,
            eval_temperature=ds.temperature,
            eval_top_p=ds.top_p,
            eval_top_k=ds.top_k,
            eval_max_response_len=ds.max_new_tokens,
            rollout_stop=list(ds.stop),
            eval_input_key=ds.input_key,
            eval_label_key=ds.label_key,
            metadata_key=ds.metadata_key,
        )

    @classmethod
    def from_miles_yaml(
        cls,
        path_or_text: str | Path,
        *,
        fallbacks: SamplingFallbacks | None = None,
        pass_at_k: bool = False,
        base_dir: str | None = None,
        remote_reward: RemoteRewardConfig | None = None,
        variables: Mapping[str, str] | None = None,
        strict_miles: bool = False,
        rm_type: str | None = None,
        custom_rm_path: str | None = None,
        custom_generate_function_path: str | None = None,
        check_imports: bool = True,
    ) -> EvalSuite:
        """Load miles' eval config: a file path, YAML/JSON text, or `base64:<payload>`
        (`pinned_eval.miles_config` says what is accepted and what is refused, by key path).

        Relative dataset paths resolve against the file's directory (or `base_dir` when given).
        `remote_reward` is miles' `--rm-url` (+ client limits), needed by `rm_type: remote_rm`.
        `variables` resolve `${VAR}` interpolations before the environment does; `strict_miles`
        refuses pinned-eval's extension keys. `rm_type` is miles' `--rm-type`: the reward of a
        dataset that sets none (nor `eval.defaults`); with none at all the dataset is refused, as
        miles raises for it (no silent `exact_match`). `custom_rm_path` is miles' `--custom-rm-path`
        (`module.function`, e.g. an `async (args, sample)` function): it scores every dataset,
        overriding their `rm_type` as in miles. `custom_generate_function_path` is miles'
        `--custom-generate-function-path`: the generate function of every dataset that names none.
        With `check_imports` (the default), every generate function of the suite is imported in a
        throwaway subprocess (`pinned_eval.agentic.imports.check_generate_imports`); a module that
        cannot be imported, or one importing a miles module outside the compatible surface, is
        refused naming the module.
        """
        cfg = parse_miles_eval_config(path_or_text, variables=variables, strict_miles=strict_miles)
        if custom_generate_function_path is not None:
            if not is_import_path(custom_generate_function_path):
                raise ValueError(
                    f"--custom-generate-function-path: {custom_generate_function_path!r} is not 'module.function'"
                )
            fallbacks = (fallbacks or SamplingFallbacks()).model_copy(
                update={"generate_function": custom_generate_function_path}
            )
        datasets = tuple(_from_yaml(DatasetSpec, w, d) for w, d in zip(cfg.dataset_paths, cfg.datasets, strict=True))
        if custom_rm_path is not None:
            reward = check_reward_name(f"custom:{custom_rm_path}")
            datasets = tuple(ds.model_copy(update={"reward": reward}) for ds in datasets)
        elif "reward" not in cfg.defaults:
            missing = [w for w, d in zip(cfg.dataset_paths, cfg.datasets, strict=True)
                       if d.get("reward") is None and d.get("kind") != "lm_eval"]  # lm-eval scores its own
            if missing and rm_type is None:
                raise ValueError(
                    f"{missing[0]}.rm_type: required (no rm_type here, none under {cfg.defaults_path} and no "
                    "--rm-type: miles has no reward for it)"
                )
            if rm_type is not None:
                cfg.defaults["reward"] = check_reward_name(rm_type, strict_miles=strict_miles)
        try:
            suite = cls(
                datasets=datasets,
                defaults=_from_yaml(SamplingDefaults, cfg.defaults_path, cfg.defaults),
                fallbacks=fallbacks or SamplingFallbacks(),
                pass_at_k=pass_at_k,
                base_dir=base_dir or cfg.file_dir,
                remote_reward=remote_reward,
                delegates=cfg.delegates,
            )
        except ValidationError as exc:
            raise ValueError(f"eval config: {exc}") from exc
        if check_imports:
            from pinned_eval.agentic.imports import check_generate_imports

            check_generate_imports(suite.resolved())
        return suite


def _from_yaml(model: type[_M], where: str, fields: dict[str, Any]) -> _M:
    """Validate one YAML section; errors name its key path (`eval.datasets[1].top_p: ...`)."""
    try:
        return model(**fields)
    except ValidationError as exc:
        problems = "; ".join(
            f"{MilesEvalConfig.key_path(where, '.'.join(map(str, e['loc'])))}: {e['msg']} "
            f"(got {e.get('input')!r:.60})"
            for e in exc.errors()
        )
        raise ValueError(problems) from exc


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
