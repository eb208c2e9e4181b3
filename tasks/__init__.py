"""Prefect tasks of an eval point, one module per family (docs/architecture.md). Side effects use NO_CACHE."""
