"""A dataset as the tasks consume it: every field concrete, its path absolute.

`ResolvedDataset` is what `pinned_eval.suite.EvalSuite.resolved()` builds (precedence applied:
dataset > suite defaults > fallbacks); its `reward` is checked against the reward registry
(`pinned_eval.scoring.rewards.check_reward_name`) like the suite's own fields. `builtin:<file>`
dataset paths resolve to `BUILTIN_DIR/<file>`, the JSONL files shipped in `builtin/`.
This module imports nothing of the suite (no circle: the suite imports it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from pinned_eval.plugins import ImportPath
from pinned_eval.scoring.rewards import check_reward_name

__all__ = [
    "BUILTIN_DIR",
    "BUILTIN_PREFIX",
    "DATASET_NAME_PATTERN",
    "LM_EVAL_TASK_PATTERN",
    "TOOL_CALL_PARSERS",
    "DatasetKind",
    "LmEvalModel",
    "LmEvalTaskName",
    "ResolvedDataset",
    "RewardName",
    "ToolCallParser",
]

BUILTIN_PREFIX = "builtin:"
BUILTIN_DIR = Path(__file__).parent / "builtin"
DATASET_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$"

RewardName = Annotated[str, AfterValidator(check_reward_name)]
DatasetKind = Literal["rows", "lm_eval"]
LmEvalModel = Literal["local-completions", "local-chat-completions"]
# lm-eval task names become metric keys (eval/<task>/<metric>): a slug
LM_EVAL_TASK_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$"
LmEvalTaskName = Annotated[str, Field(pattern=LM_EVAL_TASK_PATTERN)]
TOOL_CALL_PARSERS = ("qwen25", "hermes")
ToolCallParser = Literal["qwen25", "hermes"]
_FROZEN = ConfigDict(frozen=True, extra="forbid")


class ResolvedDataset(BaseModel):
    """A dataset with every field concrete and its path absolute; what tasks consume."""

    model_config = _FROZEN

    name: str = Field(description="Slug used in metric keys.")
    path: Path | None = Field(description="Absolute path of the JSONL or Parquet file (None: kind lm_eval).")
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
    apply_chat_template_kwargs: dict[str, Any] = Field(description="Chat template keywords.")
    system_prompt: str | None = Field(description="System message of templated prompts.")
    metadata_key: str | None = Field(description="Row key of a metadata object, or None (other columns).")
    metadata_overrides: dict[str, Any] = Field(description="Keys set on every row's metadata.")
    every_n_steps: int | None = Field(default=None, ge=1, description="Cadence; None: every point.")
    # agentic (miles generate functions); defaults keep a plain single-turn dataset unchanged
    generate_function: ImportPath | None = Field(
        default=None, description="miles custom_generate_function_path; None: single turn."
    )
    tool_key: str = Field(default="tools", min_length=1, description="Row key of the tool specs (miles tool_key).")
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
    agent_max_requests: int | None = Field(default=None, ge=1, description="Model calls per point (gateway).")
    agent_max_tokens: int | None = Field(default=None, ge=1, description="Tokens per point (gateway).")
    agent_max_turns: int | None = Field(default=None, ge=1, description="Model calls per agentic sample.")
    agent_max_tokens_per_sample: int | None = Field(default=None, ge=1, description="Tokens per agentic sample.")
    agent_sample_wall_s: float | None = Field(default=None, gt=0, description="Seconds of model calls per sample.")
    agent_sample_timeout_s: float = Field(default=600.0, gt=0, description="Seconds per generate-function call.")
    # lm-eval tasks (pinned_eval.harness); defaults keep a rows dataset unchanged
    kind: DatasetKind = Field(default="rows", description="rows: a JSONL/Parquet file; lm_eval: lm-eval tasks.")
    tasks: tuple[str, ...] = Field(default=(), description="lm-eval task names (kind lm_eval).")
    task_dir: Path | None = Field(default=None, description="Absolute directory of local lm-eval task YAMLs.")
    lm_eval_model: LmEvalModel = Field(default="local-completions", description="lm-eval's API model.")
    num_fewshot: int | None = Field(default=None, ge=0, description="lm-eval --num_fewshot; None: the task's.")
    python_path: tuple[str, ...] = Field(
        default=(), description="Absolute import roots of the generate-function runner (docs/agentic.md)."
    )
    miles_python: str | None = Field(
        default=None, description="Interpreter of the generate-function runner (a miles venv's python); None: ours."
    )
    reward_key: str | None = Field(default=None, description="miles --reward-key: the scalar of a dict reward.")
    eval_reward_key: str | None = Field(default=None, description="miles --eval-reward-key (default: reward_key).")

    @property
    def rollout(self) -> str:
        """The rollout kind that produces this dataset's samples: `lm_eval` for lm-eval tasks,
        `function` when it names a generate function, else `single_turn`."""
        if self.kind == "lm_eval":
            return "lm_eval"
        return "function" if self.generate_function is not None else "single_turn"

    def sampling_params(self) -> dict[str, Any]:
        """SGLang native `/generate` sampling_params for this dataset."""
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "max_new_tokens": self.max_new_tokens,
            "stop": list(self.stop),
        }
