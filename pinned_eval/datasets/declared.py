"""A dataset as a suite declares it: the inheritable fields at their three levels, and one dataset.

Contract:
- `SamplingDefaults` (miles `eval.defaults`) and `DatasetSpec` carry the same inheritable fields;
  a field left `None` inherits. `SamplingFallbacks` is the last level, where nothing inherits (miles'
  `--eval-*` / `--rollout-*` args). `pinned_eval.suite.EvalSuite.resolved()` applies the precedence
  dataset > defaults > fallbacks and builds `ResolvedDataset`s (`pinned_eval.datasets.spec`).
- `num_examples` (prime-rl's name) is another name of `max_prompts` (the first N prompts) on a
  dataset and in the defaults; setting both is refused.
- Per kind (`DatasetSpec.kind`): `rows` (the default) needs `path` and refuses `tasks`, `task_dir`
  and `num_fewshot`; `lm_eval` needs `tasks`, refuses `path` and `generate_function`, and needs the
  `harness` extra installed (`pinned_eval.harness.extra.require_lm_eval`) when the spec is built.
- Cadence: `DatasetSpec.due(step)` is true at multiples of `every_n_steps` (every step when unset)
  and always at the final point.
This module imports nothing of the suite (the suite imports it) and nothing heavy.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pinned_eval.datasets.spec import (
    DATASET_NAME_PATTERN,
    DatasetKind,
    LmEvalModel,
    LmEvalTaskName,
    RewardName,
    ToolCallParser,
)
from pinned_eval.harness.extra import require_lm_eval
from pinned_eval.plugins import ImportPath

__all__ = ["DatasetSpec", "SamplingDefaults", "SamplingFallbacks"]

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
        default=None,
        description="Reward: exact_match | math | f1 | deepscaler | dapo | gpqa | remote_rm | custom:<mod:fn>.",
    )
    max_prompts: int | None = Field(
        default=None, ge=1, description="Use only the first N prompts of the file."
    )
    apply_chat_template: bool | None = Field(
        default=None, description="Render prompts with the model's chat template (fallback False)."
    )
    apply_chat_template_kwargs: dict[str, Any] | None = Field(
        default=None, description="Extra keywords of the chat template (e.g. enable_thinking: false)."
    )
    system_prompt: str | None = Field(
        default=None, description="System message put first in templated prompts that have none."
    )
    metadata_key: str | None = Field(
        default=None,
        min_length=1,
        description="Row key of a metadata object (fallback: every column but prompt and label).",
    )
    metadata_overrides: dict[str, Any] | None = Field(
        default=None, description="Keys set on every row's metadata (miles metadata_overrides)."
    )
    generate_function: ImportPath | None = Field(
        default=None, description="miles custom_generate_function_path (module.function); unset: single turn."
    )
    tool_key: str | None = Field(
        default=None, min_length=1, description="Row key of the tool specs (miles tool_key; fallback 'tools')."
    )
    generate_max_turns: int | None = Field(default=None, ge=1, description="miles --generate-max-turns.")
    generate_tool_specs_path: ImportPath | None = Field(default=None, description="miles --generate-tool-specs-path.")
    generate_execute_tool_function_path: ImportPath | None = Field(
        default=None, description="miles --generate-execute-tool-function-path."
    )
    generate_tool_call_parser: ToolCallParser | None = Field(
        default=None, description="miles --generate-tool-call-parser (qwen25 | hermes)."
    )
    custom_agent_function_path: ImportPath | None = Field(
        default=None, description="miles --custom-agent-function-path."
    )
    # the point gateway's limits (docs/agentic.md): one gateway serves every agentic dataset of a point
    agent_max_requests: int | None = Field(default=None, ge=1, description="Model calls per point (gateway budget).")
    agent_max_tokens: int | None = Field(default=None, ge=1, description="Prompt + completion tokens per point.")
    agent_max_turns: int | None = Field(default=None, ge=1, description="Model calls per agentic sample.")
    agent_max_tokens_per_sample: int | None = Field(default=None, ge=1, description="Tokens per agentic sample.")
    agent_sample_wall_s: float | None = Field(default=None, gt=0, description="Seconds of model calls per sample.")
    agent_sample_timeout_s: float | None = Field(
        default=None, gt=0, description="Seconds a generate function may take per sample (then agent_error)."
    )
    python_path: tuple[str, ...] | None = Field(
        default=None,
        description="Import roots of generate functions (relative: against the YAML's directory); "
        "unset: the YAML's directory.",
    )
    miles_python: str | None = Field(
        default=None, min_length=1, description="Python interpreter that runs generate functions (a miles venv's)."
    )
    reward_key: str | None = Field(
        default=None, min_length=1, description="miles --reward-key: the scalar of a dict reward."
    )
    eval_reward_key: str | None = Field(
        default=None, min_length=1, description="miles --eval-reward-key (default: reward_key)."
    )

    @model_validator(mode="before")
    @classmethod
    def _num_examples(cls, data: Any) -> Any:
        """`num_examples` (prime-rl's name) is `max_prompts`."""
        if isinstance(data, dict) and "num_examples" in data:
            data = dict(data)
            if data.get("max_prompts") is not None:
                raise ValueError("num_examples: another name of max_prompts; set one of them")
            data["max_prompts"] = data.pop("num_examples")
        return data


class SamplingDefaults(_SamplingFields):
    """Suite-level defaults (miles `eval.defaults`): used where a dataset leaves a field unset."""


class DatasetSpec(_SamplingFields):
    """One eval dataset; unset fields inherit from the suite. `kind: lm_eval` names lm-eval tasks
    instead of a file (`pinned_eval.harness`, docs/harnesses.md)."""

    name: str = Field(pattern=DATASET_NAME_PATTERN, description="Slug used in metric keys: eval/<name>.")
    path: str | None = Field(
        default=None, min_length=1,
        description="JSONL or Parquet file: absolute, relative, or builtin:<file> (required unless kind: lm_eval).",
    )
    every_n_steps: int | None = Field(
        default=None,
        ge=1,
        description="Measure at steps that are multiples of N (and the final point); None: every point.",
    )
    kind: DatasetKind = Field(default="rows", description="rows: a JSONL/Parquet file; lm_eval: lm-eval tasks.")
    tasks: tuple[LmEvalTaskName, ...] | None = Field(default=None, min_length=1, description="lm-eval task names.")
    task_dir: str | None = Field(
        default=None, min_length=1, description="Directory of local lm-eval task YAMLs (only these are looked up)."
    )
    lm_eval_model: LmEvalModel = Field(
        default="local-completions",
        description="lm-eval's OpenAI-compatible model (local-chat-completions: generation only).",
    )
    num_fewshot: int | None = Field(default=None, ge=0, description="lm-eval --num_fewshot; None: the task's.")

    @model_validator(mode="after")
    def _kind_fields(self) -> DatasetSpec:
        if self.kind == "rows":
            if self.path is None:
                raise ValueError("path: required (a JSONL or Parquet file)")
            extra = [f for f in ("tasks", "task_dir", "num_fewshot") if getattr(self, f) is not None]
            if extra:
                raise ValueError(f"{extra[0]}: only for kind: lm_eval")
            return self
        if self.tasks is None:
            raise ValueError("tasks: required for kind: lm_eval (lm-eval task names)")
        if self.path is not None:
            raise ValueError("path: not used by kind: lm_eval (local task YAMLs go in task_dir)")
        if self.generate_function is not None:
            raise ValueError("generate_function: not used by kind: lm_eval (lm-eval produces its own requests)")
        require_lm_eval(f"dataset {self.name!r} (kind: lm_eval)")
        return self

    def due(self, step: int, *, final: bool = False) -> bool:
        """Whether this dataset is measured at `step` (always at the final point)."""
        return final or self.every_n_steps is None or step % self.every_n_steps == 0


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
    apply_chat_template_kwargs: dict[str, Any] = Field(default_factory=dict, description="Chat template keywords.")
    system_prompt: str | None = Field(default=None, description="System message of templated prompts.")
    metadata_key: str | None = Field(
        default=None, description="Row key of a metadata object; None: every other column is metadata."
    )
    metadata_overrides: dict[str, Any] = Field(default_factory=dict, description="Keys set on every row's metadata.")
    generate_function: ImportPath | None = Field(
        default=None, description="miles --custom-generate-function-path: every dataset naming none uses it."
    )
    tool_key: str = Field(default="tools", min_length=1, description="miles --tool-key (default 'tools').")
    generate_max_turns: int | None = Field(default=None, ge=1, description="miles --generate-max-turns.")
    generate_tool_specs_path: ImportPath | None = Field(default=None, description="miles --generate-tool-specs-path.")
    generate_execute_tool_function_path: ImportPath | None = Field(
        default=None, description="miles --generate-execute-tool-function-path."
    )
    generate_tool_call_parser: ToolCallParser | None = Field(
        default=None, description="miles --generate-tool-call-parser."
    )
    custom_agent_function_path: ImportPath | None = Field(
        default=None, description="miles --custom-agent-function-path."
    )
    # the point gateway's limits (docs/agentic.md): one gateway serves every agentic dataset of a point
    agent_max_requests: int | None = Field(default=None, ge=1, description="Model calls per point (gateway budget).")
    agent_max_tokens: int | None = Field(default=None, ge=1, description="Prompt + completion tokens per point.")
    agent_max_turns: int | None = Field(default=None, ge=1, description="Model calls per agentic sample.")
    agent_max_tokens_per_sample: int | None = Field(default=None, ge=1, description="Tokens per agentic sample.")
    agent_sample_wall_s: float | None = Field(default=None, gt=0, description="Seconds of model calls per sample.")
    agent_sample_timeout_s: float = Field(
        default=600.0, gt=0, description="Seconds a generate function may take per sample (then agent_error)."
    )
    python_path: tuple[str, ...] | None = Field(
        default=None, description="Import roots of generate functions; None: the suite's base_dir (the YAML's)."
    )
    miles_python: str | None = Field(default=None, description="Interpreter that runs generate functions.")
    reward_key: str | None = Field(
        default=None, min_length=1, description="miles --reward-key: the scalar of a dict reward."
    )
    eval_reward_key: str | None = Field(
        default=None, min_length=1, description="miles --eval-reward-key (default: reward_key)."
    )
