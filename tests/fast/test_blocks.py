"""Our blocks pass Prefect's own BlockStandardTestSuite, and their fields validate at the edge."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from pathlib import Path
from urllib.request import urlopen

import pytest
from PIL import Image
from prefect.blocks.core import Block
from prefect.testing.standard_test_suites import BlockStandardTestSuite
from pydantic import ValidationError

from blocks import EvalSuiteBlock, FleetBlock, SinksBlock, StagingBlock
from blocks._meta import LOGO_URL

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def logo_server() -> Iterator[str]:
    """Serve the repository's docs/ on loopback: the logo URL's file, without the internet."""

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a, **kw):  # type: ignore[no-untyped-def]
            super().__init__(*a, directory=str(REPO / "docs"), **kw)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.mark.parametrize("block_cls", [FleetBlock, StagingBlock, EvalSuiteBlock, SinksBlock])
class TestAllBlocksAdhereToStandards(BlockStandardTestSuite):
    @pytest.fixture
    def block(self, block_cls: type[Block]) -> type[Block]:
        return block_cls

    def test_has_a_valid_image(self, block: type[Block], logo_server: str) -> None:  # type: ignore[override]
        # The suite fetches `_logo_url` from the internet; fetch the same file (the URL's path
        # below /main/docs/) from loopback instead, and apply the suite's own checks.
        assert block._logo_url == LOGO_URL
        relative = str(block._logo_url).split("/main/docs/", 1)[1]
        img = Image.open(urlopen(f"{logo_server}/{relative}"))
        assert img.width == img.height, "Logo should be a square image"
        assert 1000 > img.width > 45


def test_slugs_are_explicit_and_stable() -> None:
    assert [b.get_block_type_slug() for b in (FleetBlock, StagingBlock, EvalSuiteBlock, SinksBlock)] == [
        "pinned-eval-fleet",
        "pinned-eval-staging",
        "pinned-eval-suite",
        "pinned-eval-sinks",
    ]


def test_attach_mode_needs_urls_and_names_the_field() -> None:
    with pytest.raises(ValidationError, match="engine_urls"):
        FleetBlock(mode="attach", router_url="http://127.0.0.1:1")
    with pytest.raises(ValidationError, match="name"):
        FleetBlock(name="Bad Name!", mode="launch", state_file="x.json")


def test_secrets_are_secret_fields() -> None:
    assert set(FleetBlock.model_json_schema()["secret_fields"]) == {"api_key", "admin_api_key"}
    assert set(StagingBlock.model_json_schema()["secret_fields"]) == {"aws_access_key_id", "aws_secret_access_key"}
    s = StagingBlock(root="s3://b/p", endpoint_url="http://127.0.0.1:9", aws_secret_access_key="sek")
    assert "sek" not in repr(s) and s.storage_options()["secret"] == "sek"
