"""Placeholder: `make mutants` killers for staging (docs/testing.md)."""
