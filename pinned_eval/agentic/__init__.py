"""Agentic evals: miles generate functions, unchanged, run against the pinned fleet.

- `pinned_eval.agentic.compat`: the miles import surface served (inside the runner subprocess
  only) when real miles is not importable;
- `pinned_eval.agentic.runner`: `python -m pinned_eval.agentic.runner`, the subprocess that loads
  the user's generate function and runs one sample per request (JSONL over its pipes);
- `pinned_eval.agentic.imports`: the suite-load dry import of every generate function.
User code never runs in the calling process. This package imports no Prefect.
"""
