"""`judge_readback` (pinned_eval/fleet/readback.py): the exact verdict and problem text per case."""

from __future__ import annotations

from pinned_eval.fleet.models import LoadOutcome
from pinned_eval.fleet.readback import judge_readback

URL = "http://127.0.0.1:1"
OK = LoadOutcome(url=URL, ok=True, status_code=200)


def test_an_engine_that_loaded_and_reads_back_the_pin_is_accepted() -> None:
    check = judge_readback(OK, version="7", path="/s/7", got_version="7", got_path="/s/7")
    assert (check.url, check.load, check.ok, check.problem) == (URL, OK, True, "")
    assert (check.weight_version, check.model_path) == ("7", "/s/7")


def test_every_failure_is_named_in_order() -> None:
    load = LoadOutcome(url=URL, ok=False, status_code=400, message="bad shard", error="rejected")
    check = judge_readback(
        load, version="7", path="/s/7", got_version="6", got_path="/s/6", extra_problems=("lora: missing", "x")
    )
    assert not check.ok
    assert (check.weight_version, check.model_path) == ("6", "/s/6")
    assert check.problem == (
        "load failed (rejected, HTTP 400): bad shard; "
        "reads back weight_version '6', expected '7'; "
        "reads back model_path '/s/6', expected '/s/7'; lora: missing; x"
    )


def test_labels_name_the_load_and_the_path() -> None:
    load = LoadOutcome(url=URL, ok=False, status_code=None, message="", error="timeout")
    check = judge_readback(
        load,
        version="7",
        path="/base",
        got_version="7",
        got_path=None,
        load_label="adapter load",
        path_label="base model_path",
    )
    assert check.problem == (
        "adapter load failed (timeout, HTTP None): ; reads back base model_path None, expected '/base'"
    )


def test_a_failed_read_back_reports_only_that() -> None:
    check = judge_readback(
        OK, version="7", path="/s/7", read_error="ConnectError('refused')", extra_problems=("never judged",)
    )
    assert (check.ok, check.problem) == (False, "read-back failed: ConnectError('refused')")
    assert (check.weight_version, check.model_path) == (None, None)


def test_only_an_extra_problem_rejects_the_engine() -> None:
    check = judge_readback(OK, version="7", path="/s/7", got_version="7", got_path="/s/7", extra_problems=("lora",))
    assert (check.ok, check.problem) == (False, "lora")


def test_what_an_engine_reports_is_cut_in_the_message() -> None:
    load = LoadOutcome(url=URL, ok=False, status_code=500, message="m" * 301, error="http")
    check = judge_readback(load, version="7", path="/p", got_version="v" * 300, got_path="p" * 400)
    load_part, version_part, path_part = check.problem.split("; ")
    assert load_part == "load failed (http, HTTP 500): " + "m" * 300
    assert version_part == "reads back weight_version '" + "v" * 199 + ", expected '7'"
    assert path_part == "reads back model_path '" + "p" * 299 + ", expected '/p'"
    failed = judge_readback(OK, version="7", path="/p", read_error="e" * 501)
    assert failed.problem == "read-back failed: " + "e" * 500
