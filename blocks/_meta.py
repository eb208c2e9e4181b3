"""Metadata shared by every pinned-eval block type (docs page and logo shown in the Prefect UI)."""

DOCS_URL = "https://github.com/pinned-eval/pinned-eval/blob/main/docs/blocks.md"
# The logo is docs/assets/logo.png of this repository, served raw.
LOGO_URL = "https://raw.githubusercontent.com/pinned-eval/pinned-eval/main/docs/assets/logo.png"
