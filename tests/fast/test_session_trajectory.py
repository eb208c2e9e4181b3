"""miles' merged session response of an agent function, rebuilt from a gateway transcript
(`pinned_eval.rollout.trajectory`), and the logged fallback to the last reply."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from pinned_eval.datasets.loader import EvalSample
from pinned_eval.prompts import load_tokenizer
from pinned_eval.rollout.function import _sample
from pinned_eval.rollout.trajectory import TrajectoryError, output_text, session_response
from pinned_eval.suite import DatasetSpec, EvalSuite

ROUTE = "/sessions/{id}/v1/chat/completions"
TOOLS = [{"type": "function", "function": {"name": "code_interpreter", "parameters": {"type": "object"}}}]
CALL = '<tool_call>\n{"name": "code_interpreter", "arguments": {"code": "print(2+2)"}}\n</tool_call>'
TOOL_CALL = {"id": "call_0", "type": "function",
             "function": {"name": "code_interpreter", "arguments": json.dumps({"code": "print(2+2)"})}}
USER = {"role": "user", "content": "What is 2+2?"}
ASSISTANT = {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL]}
TOOL = {"role": "tool", "tool_call_id": "call_0", "content": "4"}
# miles' own response for this transcript (tests/data/miles_generate_golden.jsonl, the agent line)
MILES = (CALL + "</s><|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>\n"
         "<|im_start|>assistant\nThe answer is 4.</s>")


@pytest.fixture(scope="module")
def chatml(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("traj") / "m", arch="llama", seed=0, chat_template="chatml")


def _calls(second_finish: str = "stop") -> list[dict[str, Any]]:
    return [
        {"route": ROUTE, "status": 200, "messages": [USER], "tools": TOOLS, "text": "", "tool_calls": [TOOL_CALL],
         "finish_reason": "tool_calls", "weight_version": "5", "prompt_tokens": 10, "completion_tokens": 7},
        {"route": ROUTE, "status": 200, "messages": [USER, ASSISTANT, TOOL], "tools": TOOLS,
         "text": "The answer is 4.", "tool_calls": [], "finish_reason": second_finish, "weight_version": "6",
         "prompt_tokens": 30, "completion_tokens": 5},
    ]


def _ds():  # type: ignore[no-untyped-def]
    spec = DatasetSpec(name="agent", path="/agent.jsonl", generate_function="m.generate", reward="exact_match")
    [ds] = EvalSuite(datasets=(spec,)).resolved()
    return ds


def test_two_turns_merge_into_miles_response(chatml: Path) -> None:
    tok = load_tokenizer(chatml)
    response, length, merged = session_response(_calls(), tok)
    assert response == MILES
    delta = "<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert length == 7 + len(tok.encode(delta, add_special_tokens=False)) + 5
    assert [c["weight_version"] for c in merged] == ["5", "6"]


def test_turn_output_text() -> None:
    assert output_text({"text": "", "tool_calls": [TOOL_CALL], "finish_reason": "tool_calls"}, "</s>") == CALL + "</s>"
    assert output_text({"text": "Let me run it.", "tool_calls": [TOOL_CALL], "finish_reason": "tool_calls"},
                       "<eos>") == "Let me run it.\n" + CALL + "<eos>"
    assert output_text({"text": "cut", "tool_calls": [], "finish_reason": "length"}, "</s>") == "cut"
    with pytest.raises(TrajectoryError, match="arguments are not JSON"):
        output_text({"tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}, "</s>")


def test_a_truncated_turn_ends_the_trajectory(chatml: Path) -> None:
    calls = _calls()
    calls[0] = {**calls[0], "finish_reason": "length", "tool_calls": [], "text": "2+2"}
    response, length, merged = session_response(calls, load_tokenizer(chatml))
    assert (response, length, merged) == ("2+2", 7, calls[:1])


@pytest.mark.parametrize(("change", "why"), [
    (lambda c: c[1].update(messages=[USER, TOOL]), "do not extend call 0's"),
    (lambda c: c[1].update(route="/sessions/{id}/generate"), "call 1 is not an answered chat completion"),
    (lambda c: c[0].update(status=400), "call 0 is not an answered chat completion"),
])
def test_unmergeable_transcripts_are_refused(chatml: Path, change: Any, why: str) -> None:
    calls = _calls()
    change(calls)
    with pytest.raises(TrajectoryError, match=why):
        session_response(calls, load_tokenizer(chatml))
    with pytest.raises(TrajectoryError, match="no call"):
        session_response([], load_tokenizer(chatml))


def test_a_template_not_prefix_stable_is_refused(tmp_path: Path) -> None:
    class Unstable:
        eos_token = "</s>"

        def apply_chat_template(self, messages: list[Any], **kw: Any) -> str:
            return f"{len(messages)}|" + "".join(str(m.get("content")) for m in messages)

        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            return list(range(len(text)))

    with pytest.raises(TrajectoryError, match=r"not prefix-stable for \['tool'\]"):
        session_response(_calls(), Unstable())


def test_sample_takes_the_merged_response_and_falls_back_logged(chatml: Path, caplog: pytest.LogCaptureFixture) -> None:
    rec = {"response": "agent says", "status": "completed", "metadata": {"from_transcript": True}, "reward": 1.0}
    s = _sample(_ds(), EvalSample(0, "What is 2+2?", "4"), 0, rec, _calls(), str(chatml))
    assert (s.response, s.status, s.finish_reason, s.weight_version, s.turns) == (MILES, "completed", "stop", "6", 2)
    assert not caplog.records
    # a rewritten history: logged, and the response is the last reply's content
    bad = _calls()
    bad[1]["messages"] = [USER, TOOL]
    with caplog.at_level(logging.WARNING, logger="pinned_eval.rollout.function"):
        s = _sample(_ds(), EvalSample(0, "What is 2+2?", "4"), 0, rec, bad, str(chatml))
    assert (s.response, s.response_len, s.weight_version) == ("The answer is 4.", 5, "6")
    [line] = [r.getMessage() for r in caplog.records]
    assert line.startswith("dataset 'agent' sample 0 (j=0): miles' session trajectory not rebuilt (call 1's messages")
    assert line.endswith("the response is the last reply")
    # no tokenizer at all: the same fallback, named
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pinned_eval.rollout.function"):
        s = _sample(_ds(), EvalSample(0, "What is 2+2?", "4"), 0, rec, _calls("length"), None)
    assert (s.response, s.status, s.finish_reason) == ("The answer is 4.", "truncated", "length")
    assert "(the point has no tokenizer)" in caplog.records[0].getMessage()
