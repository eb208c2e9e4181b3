"""Eval suite block: the datasets, sampling and rewards every point of a run is measured on.

The suite is validated by `pinned_eval.suite.EvalSuite` (precedence dataset > defaults >
fallbacks, as miles); `regression` is the rule of `pinned-eval.point.regressed` (docs/alerts.md);
`from_miles_yaml` takes miles' eval YAML (`eval.defaults`, `eval.datasets`;
what it cannot honour is refused by key path, see `pinned_eval.miles_config`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect.blocks.core import Block
from pydantic import Field

from blocks._meta import DOCS_URL, LOGO_URL
from pinned_eval.datasets.spec import ResolvedDataset
from pinned_eval.scoring.regression import RegressionRule
from pinned_eval.suite import EvalSuite


class EvalSuiteBlock(Block):
    """Eval datasets with sampling parameters and reward functions, as one named suite."""

    _block_type_name = "pinned-eval Eval Suite"
    _block_type_slug = "pinned-eval-suite"
    _logo_url = LOGO_URL
    _documentation_url = DOCS_URL
    _description = "Eval datasets (JSONL/Parquet), sampling per dataset, rewards, pass@k."
    _code_example = """
    from blocks import EvalSuiteBlock

    suite = EvalSuiteBlock.load("BLOCK_NAME")
    print([d.name for d in suite.resolved()])
    """

    suite: EvalSuite = Field(description="Datasets, defaults and fallbacks with miles' precedence.")
    # the deadline lives with the suite: a point's duration is set by what it measures (datasets,
    # samples, tokens), while the fleet block's load timeout already bounds the pin on its own
    point_timeout_seconds: float = Field(
        default=3 * 3600.0,
        gt=0,
        le=7 * 24 * 3600.0,
        description="Deadline of a point once admitted (export to score); past it: `skipped_timed_out`.",
    )
    regression: RegressionRule | None = Field(
        default=None,
        description="When a measured dataset counts as regressed (event pinned-eval.point.regressed); None: never.",
    )

    @classmethod
    def from_miles_yaml(cls, path: str | Path, **options: Any) -> EvalSuiteBlock:
        """miles' eval YAML file; `options` are `EvalSuite.from_miles_yaml`'s keywords
        (`fallbacks`, `pass_at_k`, `base_dir`, `remote_reward`)."""
        return cls(suite=EvalSuite.from_miles_yaml(Path(path), **options))

    def resolved(self) -> list[ResolvedDataset]:
        return list(self.suite.resolved())
