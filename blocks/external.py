"""External-backend block: the external posture's `CheckpointEvalFn`, configured by an operator.

A point request names this block (`backend_block`), never a class path or options, so whoever can
send a request (event, webhook, REST, miles) chooses no code. Invariants: `backend` is imported
only when a point of this block runs (never when the block is saved or loaded); `secret_options`
are masked in the UI and API and never enter flow parameters; `options` and `secret_options`
share no key. `configuration()` is what the backend cache keys on (class path + all options).
"""

from __future__ import annotations

from typing import Any

from prefect.blocks.core import Block
from prefect.types import SecretDict
from pydantic import Field, model_validator

from blocks._meta import DOCS_URL, LOGO_URL
from pinned_eval.plugins import ImportPath


class ExternalBackendBlock(Block):
    """A `CheckpointEvalFn` class and its constructor options, for external-posture points."""

    _block_type_name = "pinned-eval External Backend"
    _block_type_slug = "pinned-eval-external-backend"
    _logo_url = LOGO_URL
    _documentation_url = DOCS_URL
    _description = "The external posture's CheckpointEvalFn (class path and options), named by points."
    _code_example = """
    from blocks import ExternalBackendBlock

    backend = ExternalBackendBlock.load("BLOCK_NAME")
    print(backend.backend)
    """

    backend: ImportPath = Field(
        description="The CheckpointEvalFn subclass as `module:Class`, e.g. "
        "`trainer_integration.sglang_backend:SGLangCheckpointEval`.",
    )
    options: dict[str, Any] = Field(
        default_factory=dict, description="Constructor keywords (JSON values), shown in the UI."
    )
    secret_options: SecretDict | None = Field(
        default=None, description="Constructor keywords that are secrets (API keys): masked in the UI and API."
    )

    @model_validator(mode="after")
    def _disjoint(self) -> ExternalBackendBlock:
        both = sorted(set(self.options) & set(self._secret()))
        if both:
            raise ValueError(f"secret_options: keys {both} are also in `options`; give each keyword once")
        return self

    def _secret(self) -> dict[str, Any]:
        return dict(self.secret_options.get_secret_value()) if self.secret_options is not None else {}

    def configuration(self) -> tuple[str, dict[str, Any]]:
        """(class path, every constructor keyword): the backend's identity in the backend cache."""
        return self.backend, {**self.options, **self._secret()}
