"""Remote reward credentials: a `SecretStr` token sent as `Authorization: Bearer`, never in the URL,
never in an error. Against a real HTTP scoring service on 127.0.0.1 that requires the header and,
like a careless service, echoes the header it got into its error bodies."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from pydantic import ValidationError

from blocks import EvalSuiteBlock
from pinned_eval.scoring.remote import RemoteRewardConfig, RemoteRewardError, RewardItem, score_responses
from pinned_eval.skip_mapping import fleet_skips
from pinned_eval.skips import EvalSkipped, SkipReason
from tests.bearer_judge import BearerJudge

TOKEN = "rm-tok-5f1c9e0d7b2a4c68"
ITEMS = [RewardItem("1+1=", "2", "2"), RewardItem("2+2=", "5", "4")]


@pytest.fixture
def judge() -> Iterator[BearerJudge]:
    server = BearerJudge(TOKEN)
    try:
        yield server
    finally:
        server.close()


async def test_token_is_sent_as_a_bearer_header(judge: BearerJudge) -> None:
    config = RemoteRewardConfig(url=judge.url, token=TOKEN, backoff_s=0)  # type: ignore[arg-type]
    assert await score_responses("remote_rm", ITEMS, config) == [1.0, 0.0]
    assert judge.seen == [f"Bearer {TOKEN}"] * 2
    assert TOKEN not in repr(config) and TOKEN not in config.model_dump_json()


@pytest.mark.parametrize("echo_ok", [False, True], ids=["401-echoing-the-header", "200-not-a-reward-echoing-it"])
async def test_reward_errors_and_skip_messages_never_print_the_token(judge: BearerJudge, echo_ok: bool) -> None:
    judge.echo_ok = echo_ok
    wrong = "rm-wrong-0a9b8c7d6e5f" if not echo_ok else TOKEN
    config = RemoteRewardConfig(url=judge.url, token=wrong, backoff_s=0)  # type: ignore[arg-type]
    with pytest.raises(EvalSkipped) as info, fleet_skips("dataset 'judged'"):
        await score_responses("remote_rm", ITEMS[:1], config)
    assert judge.seen == [f"Bearer {wrong}"], "the service did get (and echo) the secret"
    skip, cause = info.value, info.value.__cause__
    assert skip.reason == SkipReason.REWARD_UNAVAILABLE and isinstance(cause, RemoteRewardError)
    for text in (str(skip), skip.message, str(cause), repr(cause)):
        assert wrong not in text and "Bearer ***" in text, text
    assert ("HTTP 401" in skip.message) is not echo_ok


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("http://judge:{s}@127.0.0.1:9/score", "credentials in the URL (user info) are refused"),
        ("http://{s}@127.0.0.1:9/score", "credentials in the URL (user info) are refused"),
        ("http://127.0.0.1:9/score?token={s}", "query parameter 'token' looks like a credential"),
        ("http://127.0.0.1:9/score?model=m&api_key={s}", "query parameter 'api_key' looks like a credential"),
        ("https://127.0.0.1:9/score?X-Amz-Signature={s}", "query parameter 'X-Amz-Signature' looks like a credential"),
        ("https://127.0.0.1:9/score?access-token={s}", "query parameter 'access-token' looks like a credential"),
        ("https://127.0.0.1:9/score#access_token={s}", "a fragment is refused"),
    ],
)
def test_credentials_in_the_url_are_refused_naming_the_field_without_echoing_them(url: str, problem: str) -> None:
    suite = {"datasets": [{"name": "judged", "path": "j.jsonl", "reward": "remote_rm"}]}
    with pytest.raises(ValidationError) as info:
        EvalSuiteBlock(suite={**suite, "remote_reward": {"url": url.format(s=TOKEN)}})
    [error] = info.value.errors()
    assert error["loc"] == ("suite", "remote_reward", "url") and problem in error["msg"]
    assert TOKEN not in str(info.value) and TOKEN not in repr(info.value.errors())


def test_a_plain_query_is_still_accepted() -> None:
    config = RemoteRewardConfig(url="http://127.0.0.1:9/score?model=judge-7b&k=1")  # type: ignore[arg-type]
    assert str(config.url) == "http://127.0.0.1:9/score?model=judge-7b&k=1"
