"""Prefect tasks of an eval point, one module per family (DESIGN §3). Side effects use NO_CACHE."""
