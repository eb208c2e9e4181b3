"""Metadata shared by every pinned-eval block type (docs page and logo shown in the Prefect UI)."""

from typing import TypeVar, cast

from prefect import get_client
from prefect.blocks.core import Block
from pydantic import HttpUrl, ValidationError

DOCS_URL = HttpUrl("https://github.com/pinned-eval/pinned-eval/blob/main/docs/blocks.md")
# The logo is docs/assets/logo.png of this repository, served raw.
LOGO_URL = HttpUrl("https://raw.githubusercontent.com/pinned-eval/pinned-eval/main/docs/assets/logo.png")

B = TypeVar("B", bound=Block)


def load_block(cls: type[B], name: str) -> B:
    """`cls.load(name)` from sync code, typed (Prefect types `load` as sync-or-async).

    A saved document that no longer validates raises a ValueError naming the block and the
    offending field (Prefect's own error drops pydantic's message).
    """
    try:
        return cast(B, cls.load(name))
    except RuntimeError:
        slug = cls.get_block_type_slug()
        with get_client(sync_client=True) as client:
            doc = client.read_block_document_by_name(name, slug, include_secrets=True)
        try:
            cls.model_validate(doc.data)
        except ValidationError as exc:
            raise ValueError(f"block {slug}/{name} is invalid: {exc}") from exc
        raise
