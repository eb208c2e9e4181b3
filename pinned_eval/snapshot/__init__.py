"""HF snapshots: writer, completeness check, staging (local or S3), state-dict and Megatron sources.

Submodules are imported explicitly (`from pinned_eval.snapshot.writer import write_snapshot`) so that
`check` and `staging` stay importable without torch. Nothing here imports Prefect.
"""
