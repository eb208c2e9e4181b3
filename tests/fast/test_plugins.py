"""The one import-path loader (`pinned_eval.plugins`) and the one block-name pattern, as every
user of them sees it: custom rewards, external backends, the backend block, the CLI, the fleet
block and a point request."""

from __future__ import annotations

import itertools
import textwrap
from pathlib import Path

import pytest
from pydantic import ValidationError

from app.block_specs import SpecError, validate_name
from blocks.external import ExternalBackendBlock
from blocks.fleet import FleetBlock
from pinned_eval.external import CheckpointEvalFn, load_backend
from pinned_eval.plugins import (
    IMPORT_PATH_PATTERN,
    PluginError,
    PluginTypeError,
    is_import_path,
    load_object,
    split_import_path,
)
from pinned_eval.points import BLOCK_NAME_PATTERN, PointRequest
from pinned_eval.scoring.rewards import check_reward_name, get_reward

_ids = itertools.count()


@pytest.fixture
def module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    name = f"plugins_target_{next(_ids)}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent("""
        from pinned_eval.external import CheckpointEvalFn

        class Backend(CheckpointEvalFn):
            async def evaluate_checkpoint(self, checkpoint_dir, input):
                raise AssertionError("never called here")

        def reward(response, label):
            return 1.0

        NOT_CALLABLE = 3
        NOTHING = None
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


GOOD = ["m:f", "m.f", "pkg.sub:Cls", "pkg.sub.Cls", "_m:_f", "a1.b2:c3"]
BAD = ["", "m", "m:", ":f", "m:f:g", "m:f.g", "1m:f", "m f", "m:f\n", "m.f\n", "../m:f", "m:-f", "m;f"]


@pytest.mark.parametrize("text", GOOD)
def test_good_paths_pass_every_check(text: str) -> None:
    assert is_import_path(text)
    assert check_reward_name(f"custom:{text}") == f"custom:{text}"
    assert ExternalBackendBlock(backend=text).backend == text


@pytest.mark.parametrize("text", BAD)
def test_bad_paths_fail_every_check(text: str) -> None:
    assert not is_import_path(text)
    with pytest.raises(ValueError, match=r"expected 'custom:<module:function>' or 'custom:<module.function>'"):
        check_reward_name(f"custom:{text}")
    with pytest.raises(ValidationError, match="String should match pattern"):
        ExternalBackendBlock(backend=text)
    with pytest.raises(PluginError, match=r"^backend: .* is not 'module:Class' or 'module.Class'$"):
        load_backend(text)


def test_the_block_field_carries_the_one_pattern() -> None:
    assert ExternalBackendBlock.model_json_schema()["properties"]["backend"]["pattern"] == IMPORT_PATH_PATTERN


def test_split_at_the_colon_else_at_the_last_dot() -> None:
    assert split_import_path("a.b.c:D") == ("a.b.c", "D")
    assert split_import_path("a.b.c.D") == ("a.b.c", "D")
    with pytest.raises(ValueError, match=r"^'a' is not 'module:attr' or 'module.attr'$"):
        split_import_path("a")


def test_load_object_by_either_form(module: str) -> None:
    cls = load_object(f"{module}:Backend", expect=CheckpointEvalFn, what="backend")
    assert cls.__name__ == "Backend" and issubclass(cls, CheckpointEvalFn)
    assert load_object(f"{module}.Backend", expect=CheckpointEvalFn, what="backend") is cls
    assert load_object(f"{module}:reward", expect=callable, what="x")("a", "b") == 1.0


def test_every_failure_is_one_error_naming_the_thing(module: str) -> None:
    with pytest.raises(PluginError, match=r"^reward 'r': cannot import module 'no_such_mod_q' \(No module named") as e:
        load_object("no_such_mod_q:f", expect=callable, what="reward 'r'")
    assert isinstance(e.value.__cause__, ModuleNotFoundError)
    with pytest.raises(PluginError, match=rf"^backend: module '{module}' has no attribute 'Nope'$"):
        load_object(f"{module}:Nope", expect=CheckpointEvalFn, what="backend")
    with pytest.raises(PluginError, match=rf"^reward 'r': module '{module}' has no callable 'Nope'$"):
        load_object(f"{module}:Nope", expect=callable, what="reward 'r'")
    with pytest.raises(PluginTypeError, match=rf"^reward 'r': module '{module}' has no callable 'NOT_CALLABLE'$"):
        load_object(f"{module}:NOT_CALLABLE", expect=callable, what="reward 'r'")
    for attr in ("reward", "NOTHING"):
        with pytest.raises(PluginTypeError, match=rf"^backend: '{module}:{attr}' is not a CheckpointEvalFn subclass$"):
            load_object(f"{module}:{attr}", expect=CheckpointEvalFn, what="backend")
    assert issubclass(PluginTypeError, TypeError) and issubclass(PluginTypeError, PluginError)
    assert issubclass(PluginError, ValueError)


def test_rewards_and_backends_load_through_it(module: str) -> None:
    assert load_backend(f"{module}:Backend").__name__ == "Backend"
    with pytest.raises(PluginError, match=rf"^backend: module '{module}' has no attribute 'Gone'$"):
        load_backend(f"{module}:Gone")
    assert get_reward(f"custom:{module}:reward")("x", "y") == 1.0
    with pytest.raises(PluginTypeError, match=rf"^reward 'custom:{module}.NOT_CALLABLE': module '{module}' has no"):
        get_reward(f"custom:{module}.NOT_CALLABLE")


# ---------------------------------------------------------------------------- block names

LONGEST = "a" + "b" * 99  # 100 characters: the widest name the project ever accepted (a request's)


@pytest.mark.parametrize("name", ["a", "default", "exp-42", "0", LONGEST])
def test_one_block_name_rule_accepts(name: str) -> None:
    assert validate_name(name) == name  # the CLI creating a block
    assert FleetBlock(name=name, mode="attach", engine_urls=["http://127.0.0.1:1"],
                      router_url="http://127.0.0.1:2").lock_name == f"fleet-{name}"
    req = PointRequest(run="r", step=1, source={"kind": "hf", "path": "/x"}, posture="external", backend_block=name)
    assert req.backend_block == name


@pytest.mark.parametrize("name", ["", "-a", "A", "a_b", "a.b", "a b", LONGEST + "c", "default\n"])
def test_one_block_name_rule_refuses(name: str) -> None:
    with pytest.raises(SpecError, match="is not a block name"):
        validate_name(name)
    with pytest.raises(ValidationError, match="name"):
        FleetBlock(name=name, mode="attach", engine_urls=["http://127.0.0.1:1"], router_url="http://127.0.0.1:2")
    with pytest.raises(ValidationError, match="backend_block"):
        PointRequest(run="r", step=1, source={"kind": "hf", "path": "/x"}, posture="external", backend_block=name)


def test_the_fleet_block_carries_the_one_pattern() -> None:
    assert FleetBlock.model_json_schema()["properties"]["name"]["pattern"] == BLOCK_NAME_PATTERN
