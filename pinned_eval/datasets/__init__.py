"""Eval datasets shipped with pinned-eval (JSONL), referenced as `builtin:<file>` in suites."""
