"""Prefect Blocks: what is shared across eval points (fleet, staging, eval suite, sinks, external backend).

Register them with `prefect block register -m blocks`. Per-point values (run, step, snapshot
source) are flow parameters, never block fields. Slugs are explicit and stable: renaming one
orphans saved documents.
"""

from blocks.external import ExternalBackendBlock
from blocks.fleet import FleetBlock
from blocks.sinks import SinksBlock
from blocks.staging import StagingBlock
from blocks.suite import EvalSuiteBlock

__all__ = ["EvalSuiteBlock", "ExternalBackendBlock", "FleetBlock", "SinksBlock", "StagingBlock"]
