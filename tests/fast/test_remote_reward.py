"""Remote reward (miles remote_rm) against real HTTP scoring services on 127.0.0.1."""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Iterator

import pytest

from pinned_eval.scoring.remote import (
    RemoteRewardConfig,
    RemoteRewardError,
    RewardItem,
    score_responses,
)
from pinned_eval.suite import DatasetSpec, EvalSuite
from tests.reliability.netfaults import Responder, ScriptedServer

JSON = {"Content-Type": "application/json"}
ITEMS = [RewardItem(f"p{i}", f"r{i}", "r0" if i % 2 else f"r{i}", {"i": i}) for i in range(6)]


def _exact(body: bytes) -> tuple[int, dict[str, str], bytes]:
    sample = json.loads(body)
    return 200, JSON, json.dumps(float(sample["response"] == sample["label"])).encode()


@pytest.fixture
def serve() -> Iterator[callable]:  # type: ignore[valid-type]
    servers: list[ScriptedServer] = []

    def start(responder: Responder) -> ScriptedServer:
        server = ScriptedServer({("POST", "/score"): responder})
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.close()


def _config(server: ScriptedServer, **kw: object) -> RemoteRewardConfig:
    return RemoteRewardConfig(url=f"{server.url}/score", backoff_s=0, **kw)  # type: ignore[arg-type]


async def test_rewards_come_back_in_order_and_the_service_sees_prompt_label_metadata(serve) -> None:
    seen: list[dict] = []

    def record(body: bytes) -> tuple[int, dict[str, str], bytes]:
        seen.append(json.loads(body))
        return _exact(body)

    server = serve(record)
    rewards = await score_responses("remote_rm", ITEMS, _config(server))
    assert rewards == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    assert sorted(seen, key=lambda s: s["metadata"]["i"])[3] == {
        "prompt": "p3", "response": "r3", "label": "r0", "metadata": {"i": 3}
    }


@pytest.mark.parametrize(
    ("answer", "expected"),
    [(b'{"reward": 0.25}', 0.25), (b'{"score": -1.0, "acc": false}', -1.0), (b"null", None), (b"1", 1.0)],
)
async def test_answer_shapes(serve, answer: bytes, expected: float | None) -> None:
    server = serve(lambda body: (200, JSON, answer))
    assert await score_responses("remote_rm", ITEMS[:1], _config(server)) == [expected]


async def test_a_service_failing_twice_then_answering_is_retried(serve) -> None:
    calls: Counter[str] = Counter()
    lock = threading.Lock()

    def flaky(body: bytes) -> tuple[int, dict[str, str], bytes]:
        with lock:
            calls[json.loads(body)["prompt"]] += 1
            n = calls[json.loads(body)["prompt"]]
        return (503, JSON, b'{"detail":"busy"}') if n <= 2 else _exact(body)

    server = serve(flaky)
    rewards = await score_responses("remote_rm", ITEMS, _config(server, max_attempts=3))
    assert rewards == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    assert set(calls.values()) == {3}, "every sample: two failures, then the answer"


async def test_a_service_that_always_500s_is_a_named_error_never_a_zero(serve) -> None:
    server = serve(lambda body: (500, JSON, b'{"detail":"boom"}'))
    message = r"remote reward http://127\.0\.0\.1:\d+/score: sample \d: no answer after 4"
    with pytest.raises(RemoteRewardError, match=message):
        await score_responses("remote_rm", ITEMS[:2], _config(server, max_attempts=4))
    assert len(server.requests) == 8, "4 attempts for each of the 2 samples"


async def test_a_service_hanging_past_the_timeout_is_retried_then_named(serve) -> None:
    release = threading.Event()

    def hang(body: bytes) -> tuple[int, dict[str, str], bytes]:
        release.wait(30)
        return _exact(body)

    server = serve(hang)
    try:
        with pytest.raises(RemoteRewardError, match=r"no answer after 2 attempt\(s\): ReadTimeout"):
            await score_responses("remote_rm", ITEMS[:1], _config(server, timeout_s=0.3, max_attempts=2))
        assert len(server.requests) == 2
    finally:
        release.set()


async def test_client_errors_and_bad_bodies_are_not_retried(serve) -> None:
    server = serve(lambda body: (422, JSON, b'{"detail":"label missing"}'))
    with pytest.raises(RemoteRewardError, match=r"sample 0: HTTP 422: .*label missing"):
        await score_responses("remote_rm", ITEMS[:1], _config(server))
    assert len(server.requests) == 1
    for body in (b'"great"', b"not json", b'{"reward": "1"}', b"true"):
        bad = serve(lambda _b, body=body: (200, JSON, body))
        with pytest.raises(RemoteRewardError, match=r"sample 0: (expected a number|answer is not JSON)"):
            await score_responses("remote_rm", ITEMS[:1], _config(bad))


async def test_requests_in_flight_stay_within_max_concurrency(serve) -> None:
    """The service holds each request until 3 are in flight at once (or every request arrived),
    and the first 3 then give a 4th up to 0.5 s to show up (proving its absence costs that wait
    once), so a client that sends fewer in parallel, or more, shows a peak other than exactly 3."""
    items = ITEMS * 4
    cond = threading.Condition()
    state = {"now": 0, "max": 0, "arrived": 0, "full": False}

    def counted(body: bytes) -> tuple[int, dict[str, str], bytes]:
        with cond:
            state["now"] += 1
            state["arrived"] += 1
            state["max"] = max(state["max"], state["now"])
            first_wave = not state["full"]
            state["full"] = state["full"] or state["now"] == 3
            cond.notify_all()
            # fallback timeout: only a broken client (fewer than 3 at once) ever waits it out
            cond.wait_for(lambda: state["full"] or state["arrived"] == len(items), timeout=2)
            if first_wave:  # a 4th at once would arrive now (the correct client never sends it)
                cond.wait_for(lambda: state["now"] > 3, timeout=0.5)
            state["now"] -= 1
        return _exact(body)

    server = serve(counted)
    rewards = await score_responses("remote_rm", items, _config(server, max_concurrency=3))
    assert len(rewards) == len(items) and len(server.requests) == len(items)
    assert state["max"] == 3


async def test_in_process_rewards_get_metadata_through_the_same_entry_point() -> None:
    items = [RewardItem("q", "The answer is (B)", "B", {}), RewardItem("q", "x", "C", {"correct_letter": "C"})]
    assert await score_responses("gpqa", items) == [1.0, 0.0]


def test_remote_rm_needs_a_remote_reward_in_the_suite() -> None:
    spec = DatasetSpec(name="judge", path="/j.jsonl", reward="remote_rm")
    with pytest.raises(ValueError, match=r"remote_reward: datasets \['judge'\] use reward 'remote_rm'"):
        EvalSuite(datasets=(spec,))
    suite = EvalSuite(datasets=(spec,), remote_reward=RemoteRewardConfig(url="http://127.0.0.1:9/score"))
    assert suite.resolved()[0].reward == "remote_rm"
    with pytest.raises(ValueError, match="url"):
        RemoteRewardConfig(url="not a url")
