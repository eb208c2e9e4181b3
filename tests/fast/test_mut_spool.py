"""Placeholder: `make mutants` killers for spool (docs/testing.md)."""
