"""pinned-eval: one Prefect flow run per pinned, verified evaluation point."""
