"""Metadata shared by every pinned-eval block type (docs page and logo shown in the Prefect UI)."""

from typing import TypeVar, cast

from prefect.blocks.core import Block
from pydantic import HttpUrl

DOCS_URL = HttpUrl("https://github.com/pinned-eval/pinned-eval/blob/main/docs/blocks.md")
# The logo is docs/assets/logo.png of this repository, served raw.
LOGO_URL = HttpUrl("https://raw.githubusercontent.com/pinned-eval/pinned-eval/main/docs/assets/logo.png")

B = TypeVar("B", bound=Block)


def load_block(cls: type[B], name: str) -> B:
    """`cls.load(name)` from sync code, typed (Prefect types `load` as sync-or-async)."""
    return cast(B, cls.load(name))
