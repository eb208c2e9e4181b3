"""Real SGLang (0.5.23, from its wheel) reads the keys pinned-eval's launch command hands it by
`--config` file: SGLang's own `ConfigArgumentMerger` (run by `prepare_server_args` in the server
process) turns our 0600 YAML into `--api-key K --admin-api-key A`, so the keys reach ServerArgs
while the process's command line carries only the file's path."""

from __future__ import annotations

import importlib.util
import zipfile
from pathlib import Path

import pytest

from pinned_eval.fleet.keys import FleetKeys, write_sglang_key_config
from pinned_eval.fleet.sglang_args import SGLangFleetSpec, sglang_engine_specs
from tests.e2e.test_sglang_contract import sglang_wheel  # noqa: F401  (session fixture: the wheel)

pytestmark = pytest.mark.e2e

MERGER = "sglang/srt/utils/server_args_config_parser.py"


def test_sglang_config_merger_turns_our_key_file_into_its_key_flags(sglang_wheel: Path, tmp_path: Path) -> None:  # noqa: F811
    pytest.importorskip("yaml", reason="SGLang's config merger reads YAML")
    source = tmp_path / "sglang_config_parser.py"
    with zipfile.ZipFile(sglang_wheel) as whl:
        source.write_bytes(whl.read(MERGER))  # KeyError = the merger moved: a real failure
    spec = importlib.util.spec_from_file_location("sglang_config_parser_v0523", source)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    keys = FleetKeys.resolve("sk-data-xyz", "sk-admin-xyz")
    config = write_sglang_key_config(tmp_path / "fleet" / "sglang-keys.yaml", keys)
    fleet = SGLangFleetSpec(model_path="/m", num_gpus=1, python="/py", base_args={"mem_fraction_static": 0.8})
    [engine] = sglang_engine_specs(fleet, [31000], key_config=config)
    argv = engine.command[3:]  # what `python -m sglang.launch_server` passes to prepare_server_args
    assert "sk-data-xyz" not in " ".join(engine.command) and "sk-admin-xyz" not in " ".join(engine.command)

    merged = module.ConfigArgumentMerger().merge_config_with_args(argv)
    assert merged[:4] == ["--api-key", "sk-data-xyz", "--admin-api-key", "sk-admin-xyz"]
    assert "--config" not in merged and merged[4:] == [a for a in argv if a not in ("--config", str(config))]
