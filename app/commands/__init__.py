"""CLI verb families; each module exposes a typer `app` (and top-level verbs where noted)."""
