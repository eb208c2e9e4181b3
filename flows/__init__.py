"""Prefect flows: `eval_point` (one run per point), the watch evaluator and the janitor."""
