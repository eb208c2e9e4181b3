"""SGLang's OpenAI-compatible routes: `/v1/completions` and `/v1/chat/completions` (non-streaming).

Wire format of SGLang 0.5.23 (`serving_completions.py`, `serving_chat.py`, `protocol.py`; see
docs/engine.md, "OpenAI-compatible API"):
- Replies: `{id, object, created, model (echoed from the request, default "default"), choices,
  usage {prompt_tokens, completion_tokens, total_tokens, reasoning_tokens, ...}, metadata}`;
  `metadata.weight_version` is the weight version of the first choice, plus `weight_versions`
  when the weights changed under it (SGLang's `build_endpoint_weight_version_metadata`). No
  header is needed: every reply names its version in the body, as SGLang's does.
- Choices: `finish_reason` as a string (`stop` / `length` / `abort`, chat also `tool_calls`) and
  `matched_stop` (the stop token id or string, else null).
- `/v1/completions`: `prompt` is a string, a list of strings, token ids, or a list of token-id
  lists (ids are used as given, no BOS added). `logprobs: k` returns OpenAI `LogProbs` with top-k;
  `echo: true` prefixes the prompt text (ids: decoded without special tokens) and, with
  `logprobs`, the prompt tokens' logprobs (the first one null) before the output's, which is what
  lm-eval's `local-completions` loglikelihood reads (`max_tokens` 0 or 1).
- `/v1/chat/completions`: `messages` rendered with the model's chat template (generation prompt
  added, `chat_template_kwargs` passed) and encoded without adding special tokens; `tools` (as
  given) reach the template unless `tool_choice` is "none". Content null becomes "", text parts
  of a list content are joined, and an assistant tool call's JSON `arguments` string is parsed
  into an object for the template (as SGLang does). Tool calls are parsed from the output by
  `--tool-call-parser` (engine/tool_calls.py). `logprobs` / `top_logprobs` give
  `{"content": [...]}`; `return_meta_info` adds the choice's `/generate` `meta_info`;
  `input_ids` (SGLang's pre-computed prompt) skips the template; `return_prompt_token_ids` /
  `return_token_ids` add `prompt_token_ids` / `response_token_ids` to each choice (completions:
  `return_token_ids` adds `token_ids` and `prompt_token_ids`).
- Defaults: completions `max_tokens` 16, chat unlimited up to SGLang's 128 (`max_completion_tokens`
  or `max_tokens`), `temperature` 1.0, `top_p` 1.0. `stream: true` is refused.
- Errors: SGLang's `ErrorResponse` `{"object": "error", "message": "<field>: <why>", "type":
  "BadRequestError", "param": null, "code": 400}` (503 while the weights are unknown).
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine import tool_calls
from engine.batch import SeqResult
from engine.logprobs import chat_logprobs, completion_logprobs
from engine.protocol import LogprobSpec, PromptItem, ProtocolError, SamplingParams, describe
from engine.serving import execute, meta_info
from engine.state import EngineState, Refused, engine_state, normal_auth


class _Sampling(BaseModel):
    """OpenAI sampling fields shared by both routes, plus SGLang's extras."""

    model_config = ConfigDict(extra="ignore")

    model: str = "default"
    n: int = Field(default=1, ge=1, le=1024)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    logit_bias: dict[int, float] | None = None
    stream: bool = False
    rid: str | None = None
    lora_path: str | None = None

    def params(self, max_new_tokens: int | None) -> SamplingParams:
        raw = {
            "max_new_tokens": max_new_tokens, "min_new_tokens": self.min_tokens,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p, "stop": self.stop,
            "stop_token_ids": self.stop_token_ids, "sampling_seed": self.seed, "n": self.n,
            "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty, "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens, "no_stop_trim": self.no_stop_trim,
            "logit_bias": self.logit_bias,
        }
        return SamplingParams.parse(raw)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = Field(default=16, ge=0)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0)
    return_token_ids: bool = False


class ChatRequest(_Sampling):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=0)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_meta_info: bool = False
    input_ids: list[int] | None = None  # SGLang: a pre-computed prompt, the template is skipped
    return_prompt_token_ids: bool = False
    return_token_ids: bool = False


def _error(status: int, message: str) -> Refused:
    err_type = "BadRequestError" if status == 400 else "ServiceUnavailableError"
    return Refused(status, {"object": "error", "message": message, "type": err_type, "param": None, "code": status})


async def _parse(request: Request, model: type[_Sampling]) -> Any:
    raw = await request.body()
    try:
        body = model.model_validate(json.loads(raw) if raw.strip() else {})
    except json.JSONDecodeError as err:
        raise _error(400, f"body: invalid JSON ({err})") from None
    except ValidationError as err:
        raise _error(400, describe(err)) from None
    if body.stream:
        raise _error(400, "stream: streaming is not supported by the CPU engine; send stream=false")
    return body


async def _run(request: Request, st: EngineState, items: list[PromptItem], route: str, batch: bool) -> list[SeqResult]:
    try:
        return await execute(request, st, items, route, batch)
    except Refused as err:  # re-shaped as SGLang's OpenAI ErrorResponse
        raise _error(err.status, str(err.body.get("error", err.body))) from None


def _usage(results: list[SeqResult], n: int) -> dict[str, Any]:
    prompt = sum(results[i].prompt_tokens for i in range(0, len(results), n))
    completion = sum(r.completion_tokens for r in results)
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion,
            "prompt_tokens_details": None, "reasoning_tokens": 0, "completion_tokens_details": None}


def _metadata(first: SeqResult) -> dict[str, Any]:
    meta: dict[str, Any] = {"weight_version": first.weight_version}
    if first.weight_versions is not None:
        meta["weight_versions"] = first.weight_versions
    return meta


def _finish(finish: dict) -> tuple[str | None, Any]:
    return finish.get("type"), finish.get("matched")


def _completion_prompts(body: CompletionRequest) -> tuple[list[str | list[int]], bool]:
    prompt = body.prompt
    if isinstance(prompt, str):
        return [prompt], False
    if not prompt:
        raise _error(400, "prompt: Prompt cannot be empty")
    if isinstance(prompt[0], int):
        return [list(prompt)], False
    return list(prompt), True


def add_openai_routes(app: FastAPI) -> None:
    @app.post("/v1/completions", dependencies=[Depends(normal_auth)])
    async def completions(request: Request) -> JSONResponse:
        st = engine_state(request)
        body: CompletionRequest = await _parse(request, CompletionRequest)
        prompts, batch = _completion_prompts(body)
        try:
            params = body.params(body.max_tokens)
        except ProtocolError as err:
            raise _error(400, str(err)) from None
        spec = None
        if body.logprobs is not None:
            spec = LogprobSpec(start_len=0 if body.echo and body.logprobs else -1, top_n=body.logprobs, with_text=True)
        rid = body.rid or f"cmpl-{uuid.uuid4().hex}"
        items = [
            PromptItem(i, rid if not batch else f"{rid}_{i}", p if isinstance(p, str) else None,
                       None if isinstance(p, str) else list(p), params, body.lora_path, spec)
            for i, p in enumerate(prompts)
        ]
        results = await _run(request, st, items, "completions", batch)
        choices = []
        for idx, r in enumerate(results):
            prompt = prompts[idx // body.n]
            echo = ""
            if body.echo:
                echo = prompt if isinstance(prompt, str) else st.tokenizer.decode(prompt, skip_special_tokens=True)
            reason, matched = _finish(r.finish_reason)
            choices.append({
                "index": idx, "text": echo + r.text,
                "logprobs": completion_logprobs(r.logprobs, st.tokenizer, body.echo and bool(body.logprobs))
                if r.logprobs is not None else None,
                "finish_reason": reason, "matched_stop": matched,
            })
            if body.return_token_ids:
                choices[-1] |= {"token_ids": r.output_ids, "prompt_token_ids": r.prompt_ids}
        return JSONResponse({
            "id": results[0].rid, "object": "text_completion", "created": int(time.time()), "model": body.model,
            "choices": choices, "usage": _usage(results, body.n), "metadata": _metadata(results[0]),
        })

    @app.post("/v1/chat/completions", dependencies=[Depends(normal_auth)])
    async def chat(request: Request) -> JSONResponse:
        st = engine_state(request)
        body: ChatRequest = await _parse(request, ChatRequest)
        tool_choice = body.tool_choice if body.tool_choice is not None else ("auto" if body.tools else "none")
        template_tools = body.tools if body.tools and tool_choice != "none" else None
        try:
            kwargs = body.chat_template_kwargs or {}
            ids = body.input_ids or render_chat(st.tokenizer, body.messages, template_tools, kwargs)
        except ProtocolError as err:
            raise _error(400, str(err)) from None
        try:
            params = body.params(body.max_completion_tokens or body.max_tokens)
        except ProtocolError as err:
            raise _error(400, str(err)) from None
        if template_tools:  # SGLang keeps special tokens so a tool-call marker survives decoding
            params = params.model_copy(update={"skip_special_tokens": False})
        spec = LogprobSpec(-1, body.top_logprobs or 0, True) if body.logprobs else None
        rid = body.rid or f"chatcmpl-{uuid.uuid4().hex}"
        results = await _run(request, st, [PromptItem(0, rid, None, ids, params, body.lora_path, spec)], "chat", False)
        parser = st.args.tool_call_parser
        choices = []
        for idx, r in enumerate(results):
            content, calls, finish = tool_calls.apply(
                parser, r.text, body.tools or [], tool_choice, dict(r.finish_reason)
            )
            reason, matched = _finish(finish)
            message: dict[str, Any] = {"role": "assistant", "content": content or "", "reasoning_content": None}
            if calls is not None:
                message["tool_calls"] = calls
            choice: dict[str, Any] = {
                "index": idx, "message": message,
                "logprobs": chat_logprobs(r.logprobs, st.tokenizer) if r.logprobs is not None else None,
                "finish_reason": reason, "matched_stop": matched,
            }
            if body.return_prompt_token_ids or body.return_token_ids:
                choice["prompt_token_ids"] = r.prompt_ids
            if body.return_token_ids:
                choice["response_token_ids"] = r.output_ids
            if body.return_meta_info:
                choice["meta_info"] = meta_info(r, st.tokenizer)
            choices.append(choice)
        return JSONResponse({
            "id": results[0].rid, "object": "chat.completion", "created": int(time.time()), "model": body.model,
            "choices": choices, "usage": _usage(results, body.n), "metadata": _metadata(results[0]),
        })


def _normalise_message(i: int, message: dict[str, Any]) -> dict[str, Any]:
    out = dict(message)
    if not isinstance(out.get("role"), str):
        raise ProtocolError(f"messages.{i}.role: expected a string")
    content = out.get("content")
    if content is None:
        out["content"] = ""
    elif isinstance(content, list):
        texts = [p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") in ("text", "input_text")]
        out["content"] = "".join(str(t) for t in texts)
    elif not isinstance(content, str):
        raise ProtocolError(f"messages.{i}.content: expected a string, a list of parts or null")
    calls = []
    for call in out.get("tool_calls") or []:
        fn = dict(call.get("function") or {}) if isinstance(call, dict) else {}
        if isinstance(fn.get("arguments"), str):
            with contextlib.suppress(json.JSONDecodeError):  # not JSON: kept as text
                fn["arguments"] = json.loads(fn["arguments"])
        calls.append({**call, "function": fn} if isinstance(call, dict) else call)
    if calls:
        out["tool_calls"] = calls
    return out


def render_chat(
    tokenizer, messages: list[dict[str, Any]], tools: list[dict] | None, kwargs: dict[str, Any]
) -> list[int]:
    """The prompt token ids of a chat request (see the module contract)."""
    normalised = [_normalise_message(i, m) for i, m in enumerate(messages)]
    extra = {k: v for k, v in kwargs.items() if k not in ("tokenize", "return_dict", "add_generation_prompt")}
    try:
        text = tokenizer.apply_chat_template(
            normalised, tools=tools, tokenize=False, add_generation_prompt=True, **extra
        )
    except Exception as err:  # a template error is the request's fault (missing keys, bad roles)
        raise ProtocolError(f"messages: the chat template cannot render them ({type(err).__name__}: {err})") from None
    return list(tokenizer.encode(str(text), add_special_tokens=False))
