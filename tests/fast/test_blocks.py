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

from blocks import EvalSuiteBlock, ExternalBackendBlock, FleetBlock, SinksBlock, StagingBlock
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


@pytest.mark.parametrize("block_cls", [FleetBlock, StagingBlock, EvalSuiteBlock, SinksBlock, ExternalBackendBlock])
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
    blocks = (FleetBlock, StagingBlock, EvalSuiteBlock, SinksBlock, ExternalBackendBlock)
    assert [b.get_block_type_slug() for b in blocks] == [
        "pinned-eval-fleet",
        "pinned-eval-staging",
        "pinned-eval-suite",
        "pinned-eval-sinks",
        "pinned-eval-external-backend",
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
    assert ExternalBackendBlock.model_json_schema()["secret_fields"] == ["secret_options.*"]
    b = ExternalBackendBlock(backend="m:C", options={"url": "http://127.0.0.1:9"}, secret_options={"api_key": "k3y"})
    assert "k3y" not in repr(b) and "k3y" not in b.model_dump_json()
    assert b.configuration() == ("m:C", {"url": "http://127.0.0.1:9", "api_key": "k3y"})


def test_external_backend_and_source_roots_validate_naming_the_field() -> None:
    with pytest.raises(ValidationError, match="backend"):
        ExternalBackendBlock(backend="os.system(1)")
    with pytest.raises(ValidationError, match=r"secret_options: keys \['k'\]"):
        ExternalBackendBlock(backend="m:C", options={"k": 1}, secret_options={"k": "s"})
    with pytest.raises(ValidationError, match=r"source_roots\[1\]: 'rel/dir'"):
        StagingBlock(root="/stage", source_roots=["/ckpts", "rel/dir"])
    s = StagingBlock(root="/stage", source_roots=["/ckpts", "s3://b/p"])
    assert s.all_source_roots() == ["/stage", "/ckpts", "s3://b/p"]
    assert StagingBlock(root="/stage").all_source_roots() == ["/stage"]


@pytest.mark.parametrize("backend", ["cpu", "sglang"])
def test_fleet_block_launch_passes_the_tool_call_parser(
    backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import blocks.fleet as fleet_module

    calls: list[tuple[str, tuple, dict]] = []
    monkeypatch.setattr(fleet_module, "launch_cpu_fleet", lambda *a, **kw: calls.append(("cpu", a, kw)))
    monkeypatch.setattr(fleet_module, "launch_sglang_fleet", lambda *a, **kw: calls.append(("sglang", a, kw)))
    block = FleetBlock(mode="launch", state_file=str(tmp_path / "fleet.json"), model_path="/m",
                       backend=backend, tool_call_parser="qwen25")
    block.launch()
    ((kind, args, kwargs),) = calls
    assert kind == backend
    parser = kwargs["tool_call_parser"] if backend == "cpu" else args[0].tool_call_parser
    assert parser == "qwen25"
