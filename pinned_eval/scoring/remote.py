"""Remote reward (miles `remote_rm`) and the one entry point that scores a dataset's responses.

Remote reward contract (`RemoteReward`):
- one `POST <url>` per sample with JSON `{"prompt", "response", "label", "metadata"}` (miles sends
  the first three; extra keys are ignored by its services); the answer is a JSON number, or an
  object with a numeric `reward` or `score` (miles' `dapo`-style dicts), or `null` (no reward);
- each request has its own timeout (`timeout_s`); at most `max_concurrency` requests are in
  flight; connection errors, timeouts and HTTP 5xx/429 are retried with exponential backoff up to
  `max_attempts` attempts in total;
- when a sample still has no answer, or the service answers 4xx or a body that is not a reward,
  `RemoteRewardError` is raised naming the URL, the sample and the last problem. It is never
  turned into a score: the eval point records `eval/skipped_reward_unavailable`.

Credentials: `token` (a `SecretStr`, a secret field of the suite block that holds the config) is
sent as `Authorization: Bearer <token>` on every request. A URL that may carry credentials (user
info, a token-like query parameter such as `token`, `api_key`, `sig`, or a fragment) is refused
at validation, naming `url`, and validation errors never echo it (the URL is masked first).
Every error text (the service's answer included) has the token replaced by `***`, so reward
errors, skip messages and logs never print it. JSON dumps mask it, except with the context
`{"include_secrets": True}` (Prefect's block save, or a trusted hop such as the backend host's
socket).

`score_responses(reward, items, remote)` returns one reward per item (in order) for any reward
name: built-in and custom rewards run in-process, `remote_rm` goes to the service.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import httpx
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    FieldSerializationInfo,
    HttpUrl,
    SecretStr,
    field_serializer,
    field_validator,
    model_validator,
)
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from pinned_eval.scoring.answers import Label
from pinned_eval.scoring.miles_custom import score_with_sample
from pinned_eval.scoring.rewards import REMOTE_REWARD, get_reward

_RETRY_STATUS = frozenset({429, 500, 502, 503, 504})
_SECRET_PARAMS = frozenset({"key", "sig", "pwd", "pass", "code"})
_SECRET_PARAM_PARTS = ("token", "secret", "passw", "apikey", "api_key", "auth", "signature", "credential", "session")


class RemoteRewardError(RuntimeError):
    """The scoring service gave no usable reward for a sample (after retries, where retryable)."""


class _Retryable(Exception):
    """A transport error or retryable status; kept distinct so 4xx is never retried."""


class RemoteRewardConfig(BaseModel):
    """Where and how to call a scoring service (miles `--rm-url`)."""

    model_config = ConfigDict(frozen=True, extra="forbid", hide_input_in_errors=True)

    url: HttpUrl = Field(
        description="Scoring endpoint; POSTed one JSON sample per request. No credentials in it (use `token`)."
    )
    token: SecretStr | None = Field(
        default=None, description="Bearer token of the service (sent as `Authorization: Bearer`); a block secret."
    )
    timeout_s: float = Field(default=30.0, gt=0, description="Timeout of one request.")
    max_concurrency: int = Field(default=16, ge=1, le=4096, description="Most requests in flight.")
    max_attempts: int = Field(default=3, ge=1, le=20, description="Attempts per sample, first included.")
    backoff_s: float = Field(default=0.5, ge=0, description="First retry wait; doubles, capped at 10 s.")

    @model_validator(mode="before")
    @classmethod
    def _redact_url(cls, data: Any) -> Any:
        """Mask credentials in the raw URL before anything validates it: pydantic's errors echo
        their input (and an enclosing model's config decides that), so the input is made safe."""
        if isinstance(data, dict) and isinstance(data.get("url"), str):
            data = {**data, "url": _redacted(data["url"])}
        return data

    @field_validator("url")
    @classmethod
    def _no_credentials(cls, url: HttpUrl) -> HttpUrl:
        if url.username or url.password:
            raise ValueError("credentials in the URL (user info) are refused; put the token in `token`")
        for name, _ in url.query_params():
            if _secret_param(name):
                raise ValueError(f"query parameter {name!r} looks like a credential; put the token in `token`")
        if url.fragment:  # never sent, only printed (e.g. `#access_token=...`)
            raise ValueError("a fragment is refused (it is never sent; credentials go in `token`)")
        return url

    @field_serializer("token", when_used="json")
    def _mask(self, token: SecretStr | None, info: FieldSerializationInfo) -> str | None:
        if token is None:
            return None
        return token.get_secret_value() if (info.context or {}).get("include_secrets") is True else str(token)


def _secret_param(name: str) -> bool:
    norm = name.lower().replace("-", "_")
    return norm in _SECRET_PARAMS or any(part in norm for part in _SECRET_PARAM_PARTS)


def _redacted(url: str) -> str:
    """`url` with its user info, token-like query values and fragment replaced by `***`."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        netloc = "***@" + netloc.rsplit("@", 1)[1]
    query = parse_qsl(parts.query, keep_blank_values=True)
    if any(_secret_param(k) for k, _ in query):
        masked = urlencode([(k, "***" if _secret_param(k) else v) for k, v in query], safe="*")
    else:
        masked = parts.query
    fragment = "***" if parts.fragment else ""
    if (netloc, masked, fragment) == (parts.netloc, parts.query, parts.fragment):
        return url
    return urlunsplit(parts._replace(netloc=netloc, query=masked, fragment=fragment))


@dataclass(frozen=True, slots=True)
class RewardItem:
    """One response to score."""

    prompt: str
    response: str
    label: Label
    metadata: Mapping[str, Any] = field(default_factory=dict)


class RemoteReward:
    """Scores items against a remote service (see the module docstring)."""

    def __init__(self, config: RemoteRewardConfig) -> None:
        self.config = config
        self.url = str(config.url)
        self._token = config.token.get_secret_value() if config.token is not None else None

    def _scrub(self, text: str) -> str:
        """`text` with the token replaced (a service may echo the request's headers back)."""
        return text.replace(self._token, "***") if self._token else text

    async def score(self, items: Sequence[RewardItem]) -> list[float | None]:
        sem = asyncio.Semaphore(self.config.max_concurrency)
        headers = {"Authorization": f"Bearer {self._token}"} if self._token else {}
        async with httpx.AsyncClient(timeout=httpx.Timeout(self.config.timeout_s), headers=headers) as http:

            async def one(i: int, item: RewardItem) -> float | None:
                async with sem:
                    return await self._one(http, i, item)

            return list(await asyncio.gather(*(one(i, it) for i, it in enumerate(items))))

    async def _one(self, http: httpx.AsyncClient, i: int, item: RewardItem) -> float | None:
        payload = {
            "prompt": item.prompt,
            "response": item.response,
            "label": item.label,
            "metadata": dict(item.metadata),
        }
        retrying = AsyncRetrying(
            stop=stop_after_attempt(self.config.max_attempts),
            wait=wait_exponential(multiplier=self.config.backoff_s, max=10.0),
            retry=retry_if_exception_type(_Retryable),
            reraise=True,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    resp = await self._post(http, payload)
        except _Retryable as exc:
            raise self._error(i, f"no answer after {self.config.max_attempts} attempt(s): {exc}") from None
        if resp.status_code >= 400:
            raise self._error(i, f"HTTP {resp.status_code}: {resp.text[:200]}")
        return self._parse(i, resp)

    def _error(self, i: int, problem: str) -> RemoteRewardError:
        return RemoteRewardError(self._scrub(f"remote reward {self.url}: sample {i}: {problem}"))

    async def _post(self, http: httpx.AsyncClient, payload: dict[str, Any]) -> httpx.Response:
        try:
            resp = await http.post(self.url, json=payload)
        except httpx.TransportError as exc:  # connect errors, timeouts, resets
            raise _Retryable(f"{type(exc).__name__}: {exc}") from exc
        if resp.status_code in _RETRY_STATUS:
            raise _Retryable(f"HTTP {resp.status_code}: {resp.text[:200]}")
        return resp

    def _parse(self, i: int, resp: httpx.Response) -> float | None:
        try:
            body = resp.json()
        except ValueError:
            raise self._error(i, f"answer is not JSON: {resp.text[:200]!r}") from None
        value = body
        if isinstance(body, dict):
            value = body.get("reward", body.get("score", _MISSING))
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise self._error(i, f"expected a number, null, or {{'reward'|'score': number}}, got {body!r:.200}")
        return float(value)


_MISSING = object()


async def score_responses(
    reward: str, items: Sequence[RewardItem], remote: RemoteRewardConfig | None = None, args: Any = None
) -> list[float | None]:
    """One reward per item, in order: `reward` names a built-in/custom reward or `remote_rm`;
    `args` is the namespace a miles `async (args, sample)` reward gets (`EvalSuite.miles_args`)."""
    if reward == REMOTE_REWARD:
        if remote is None:
            raise ValueError("remote_reward: reward 'remote_rm' needs the suite's remote_reward (url, ...)")
        return await RemoteReward(remote).score(items)
    fn = get_reward(reward)
    if getattr(fn, "takes_sample", False):  # miles' async (args, sample): also gets the prompt and args
        return [score_with_sample(fn, it.response, it.label, it.metadata, prompt=it.prompt, args=args) for it in items]
    return [fn(it.response, it.label, it.metadata) for it in items]
