"""Eval datasets: what a suite declares (`declared`), what a dataset is once resolved (`spec`), how
its rows load (`loader`), and the JSONL files shipped with pinned-eval (`builtin/`, referenced as
`builtin:<file>` in suites).

Layering (an import-linter contract): `pinned_eval.suite` imports this package, nothing here
imports the suite. Import the names from their modules (`pinned_eval.datasets.declared`,
`pinned_eval.datasets.spec`, `pinned_eval.datasets.loader`); this package re-exports them for convenience.
"""

from pinned_eval.datasets.declared import DatasetSpec, SamplingDefaults, SamplingFallbacks
from pinned_eval.datasets.loader import DatasetError, EvalSample, load_dataset
from pinned_eval.datasets.spec import BUILTIN_DIR, BUILTIN_PREFIX, DATASET_NAME_PATTERN, ResolvedDataset

__all__ = [
    "BUILTIN_DIR",
    "BUILTIN_PREFIX",
    "DATASET_NAME_PATTERN",
    "DatasetError",
    "DatasetSpec",
    "EvalSample",
    "ResolvedDataset",
    "SamplingDefaults",
    "SamplingFallbacks",
    "load_dataset",
]
