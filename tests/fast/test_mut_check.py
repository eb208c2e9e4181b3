"""Placeholder: `make mutants` killers for check (docs/testing.md)."""
