"""`PointSession`: one eval point's pin contract as an object; every model call of every rollout
kind goes through `session.generate(...)`.

Contract:
- built around the router client of the point (`pinned_eval.fleet.generate.RouterGenerator`),
  which bounds the requests in flight (`max_concurrency`), retries `abort` finishes with fresh
  rids (`abort_retries`) and refuses any reply whose weight version is not the expected one
  (`WeightVersionMismatch`); the session adds nothing to the wire: one `generate` is one
  `RouterGenerator.generate` of the body `build_generate_body` builds;
- `expected_version` is the pinned step's `pinned_eval.points.weight_version(step)`; every reply
  is checked against it;
- `lora` (adapter mode) is named in every request (`lora_path`);
- `rid` is per point: the request id sent is `<rid_prefix>-<rid>` (a rollout passes a suffix
  unique within the point, e.g. `<dataset>-<prompt>-<j>`);
- `tokenizer_dir`: where prompts' chat templates come from (the pinned snapshot's tokenizer);
- accounting: `counters` counts calls started (`requests`), results returned (`completed`, each
  version-checked) and their prompt and completion tokens, for the whole point.
- `forward(method, path, body, rid=)`: a caller's own body (the point gateway's `/generate` and
  `/v1/...` requests) through `RouterGenerator.forward` — same bound, abort retries, version check
  (none for GETs); a single-prompt `/generate` body gets the rid `<rid_prefix>-<rid>` and, in adapter
  mode, `lora_path`; a POST is counted like `generate` (a request, and a 200 reply's tokens from
  `meta_info` or `usage`); a GET counts nothing. `send=` carries the exchange (the gateway's lean
  client, `RouterGenerator.forward`'s `send`).
This module imports no Prefect.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pinned_eval.fleet.generate import RouterGenerator, Sender, build_generate_body
from pinned_eval.fleet.models import GenerateResult, SamplingParams

__all__ = ["PointSession", "SessionCounters", "reply_tokens"]


@dataclass
class SessionCounters:
    """Per-point accounting (every model call of every rollout kind)."""

    requests: int = 0  # session.generate calls started
    completed: int = 0  # results returned (version-checked)
    prompt_tokens: int = 0
    completion_tokens: int = 0


class PointSession:
    """The point's model access: pinned version, adapter, rid prefix, the router client's bounds."""

    def __init__(
        self,
        generator: RouterGenerator,
        *,
        expected_version: str,
        rid_prefix: str,
        lora: str | None = None,
        tokenizer_dir: str | None = None,
    ) -> None:
        self._generator = generator
        self.expected_version = expected_version
        self.rid_prefix = rid_prefix
        self.lora = lora
        self.tokenizer_dir = tokenizer_dir
        self.counters = SessionCounters()

    @property
    def max_concurrency(self) -> int:
        """Most model calls in flight (the router client's bound)."""
        return self._generator.max_concurrency

    @property
    def request_timeout_s(self) -> float | None:
        """The router client's read timeout (the gateway's own client to the router uses it too)."""
        return self._generator.request_timeout_s

    @property
    def abort_retries(self) -> int:
        """How often an aborted request is sent again (fresh rid) before `GenerationAborted`."""
        return self._generator.abort_retries

    async def generate(
        self,
        prompt: str | None = None,
        *,
        input_ids: list[int] | None = None,
        sampling_params: SamplingParams | dict[str, Any] | None = None,
        rid: str,
    ) -> GenerateResult:
        """One model call as the point's pin contract says (see the module docstring)."""
        body = build_generate_body(
            prompt,
            input_ids=input_ids,
            sampling_params=sampling_params,
            rid=f"{self.rid_prefix}-{rid}",
            lora_path=self.lora,
        )
        self.counters.requests += 1
        result = await self._generator.generate(body, self.expected_version)
        self.counters.completed += 1
        self.counters.prompt_tokens += result.meta_info.prompt_tokens
        self.counters.completion_tokens += result.meta_info.completion_tokens
        return result

    async def forward(
        self, method: str, path: str, body: dict[str, Any] | None, *, rid: str, send: Sender | None = None
    ) -> tuple[int, Any]:
        """A caller's own request as the pin contract says (see the module docstring): (status, reply)."""
        if body is not None and path == "/generate":
            body = dict(body)
            if isinstance(body.get("text"), str) or _flat_ids(body.get("input_ids")):
                body["rid"] = f"{self.rid_prefix}-{rid}"
            if self.lora is not None:
                body["lora_path"] = self.lora
        if method == "POST":  # a model call; `GET /v1/models` is not one
            self.counters.requests += 1
        status, payload = await self._generator.forward(
            method, path, body, self.expected_version if method == "POST" else None, send=send
        )
        if status == 200 and method == "POST":
            prompt, completion = reply_tokens(payload)
            self.counters.completed += 1
            self.counters.prompt_tokens += prompt
            self.counters.completion_tokens += completion
        return status, payload


def _flat_ids(ids: Any) -> bool:
    return isinstance(ids, list) and all(isinstance(t, int) for t in ids)


def reply_tokens(payload: Any) -> tuple[int, int]:
    """(prompt, completion) tokens of a raw reply: `meta_info` per `/generate` result, `usage` on `/v1`."""
    prompt = completion = 0
    for item in payload if isinstance(payload, list) else [payload]:
        if not isinstance(item, dict):
            continue
        info = item.get("meta_info") if isinstance(item.get("meta_info"), dict) else item.get("usage")
        if isinstance(info, dict):
            p, c = info.get("prompt_tokens"), info.get("completion_tokens")
            prompt += p if isinstance(p, int) else 0
            completion += c if isinstance(c, int) else 0
    return prompt, completion
