"""Running prompts on the runner, shared by `/generate` and the OpenAI-compatible `/v1` routes.

Contract:
- `execute(request, st, items, route, batch)` turns `PromptItem`s into sequences (each prompt's `n`
  copies next to it, request order), checks them (vocabulary, context length), waits while the
  engine is paused, then holds the weight read lock while the runner works, so a weight load
  never lands in the middle of a request; it aborts the sequences if the client goes away.
  Bad prompts raise `Refused(400, {"error": "<field>: <why>"})` (the `/v1` routes re-shape it);
  unknown weights after a failed load raise `Refused(503, ...)`. One log line per call.
- A prompt that asked for logprobs gets a `Logprobs` record; with `--scripted-completions` a
  prompt matching a rule gets its scripted tokens (engine/scripted.py).
- `output(result, tokenizer)` is SGLang's `/generate` item: `{text, output_ids, meta_info}`;
  `meta_info` names the weight version the tokens came from (`weight_version`, and
  `weight_versions` spans when it changed mid-request) and, when asked, the logprob fields of
  engine/logprobs.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

from fastapi import Request

from engine import decoding
from engine.batch import Logprobs, SeqResult, Sequence
from engine.logprobs import meta_fields
from engine.protocol import PromptItem, ProtocolError
from engine.runner import Runner
from engine.state import EngineState, Refused

log = logging.getLogger("pinned_eval.engine")


def build(st: EngineState, items: list[PromptItem], batch: bool) -> list[Sequence]:
    """Sequences for every prompt and copy (request order, copies next to their prompt)."""
    runner = st.runner
    seqs: list[Sequence] = []
    for item in items:
        where = f"input_ids.{item.index}" if batch else "input_ids"
        if item.text is not None:
            ids = list(st.tokenizer.encode(item.text))
            where = f"text.{item.index}" if batch else "text"
        else:
            ids = item.input_ids or []
            bad = [t for t in ids if not 0 <= t < runner.vocab_size]
            if bad:
                raise ProtocolError(f"{where}: token id {bad[0]} outside the vocabulary [0, {runner.vocab_size})")
        if len(ids) >= runner.context_len:
            raise ProtocolError(
                f"{where}: the input ({len(ids)} tokens) is longer than the model's context "
                f"length ({runner.context_len} tokens)"
            )
        if len(ids) + item.params.max_new_tokens > runner.context_len:
            raise ProtocolError(
                f"sampling_params.max_new_tokens: requested {len(ids)} + {item.params.max_new_tokens} tokens, "
                f"more than the context length ({runner.context_len}); lower the suite's max_new_tokens "
                "(`pinned-eval block save suite --max-new-tokens N`, `max_response_len` in a miles eval YAML)"
            )
        if item.logprobs is not None and item.logprobs.start_len > len(ids):
            raise ProtocolError(
                f"logprob_start_len: {item.logprobs.start_len} is more than the {len(ids)} input tokens"
            )
        script = st.script.tokens_for(ids) if st.script is not None else None
        rid = item.rid or uuid.uuid4().hex
        for j in range(item.params.n):
            seqs.append(
                Sequence(
                    rid=rid if item.params.n == 1 else f"{rid}_{j}",
                    prompt_ids=ids,
                    params=item.params,
                    seed=decoding.copy_seed(item.params.sampling_seed, j),
                    lora_name=item.lora_name,
                    logprobs=Logprobs(item.logprobs) if item.logprobs is not None else None,
                    script=script,
                )
            )
    return seqs


def _resolve_adapters(st: EngineState, seqs: list[Sequence]) -> None:
    """Attach each sequence's adapter (under the read lock, so no unload can race it)."""
    adapters = st.runner.lora.adapters
    for seq in seqs:
        if seq.lora_name is not None:
            seq.lora = adapters.get(seq.lora_name)
            if seq.lora is None:
                raise Refused(
                    400,
                    {"error": f"lora_path: got LoRA adapter that has never been loaded: {seq.lora_name}; "
                              f"loaded adapters: {sorted(adapters)}"},
                )


async def _await_results(request: Request, runner: Runner, seqs: list[Sequence]) -> list[SeqResult]:
    """Wait for every sequence; abort them if the client disconnects or the handler is cancelled."""
    gathered = asyncio.ensure_future(asyncio.gather(*(asyncio.wrap_future(s.future) for s in seqs)))
    try:
        while True:
            done, _ = await asyncio.wait({gathered}, timeout=0.5)
            if done:
                return gathered.result()
            if await request.is_disconnected():
                runner.abort_seqs(seqs, "Client disconnected.")
    finally:
        if not gathered.done():
            runner.abort_seqs(seqs, "Request cancelled.")


async def execute(
    request: Request, st: EngineState, items: list[PromptItem], route: str, batch: bool
) -> list[SeqResult]:
    """Run `items` to completion (see the module contract); results in request order.
    `batch`: the prompts came as a list (errors then name `text.<i>` / `input_ids.<i>`)."""
    started = time.monotonic()
    try:
        seqs = build(st, items, batch)
    except ProtocolError as err:
        raise Refused(400, {"error": str(err)}) from None
    await st.wait_unpaused()
    async with st.lock.read():
        if not st.runner.weights_ok:
            raise Refused(503, {"error": "weights unknown after a failed weight update; load a good snapshot"})
        _resolve_adapters(st, seqs)
        st.runner.submit(seqs)
        results = await _await_results(request, st.runner, seqs)
    finishes = sorted({r.finish_reason["type"] for r in results})
    log.info(
        "%s rid=%s seqs=%d prompt_tokens=%d completion_tokens=%d finish=%s version=%s lora=%s %.3fs",
        route,
        results[0].rid,
        len(results),
        sum(r.prompt_tokens for r in results),
        sum(r.completion_tokens for r in results),
        ",".join(finishes),
        results[0].weight_version,
        ",".join(sorted({s.lora_name or "-" for s in seqs})),
        time.monotonic() - started,
    )
    return results


def meta_info(r: SeqResult, tokenizer) -> dict[str, Any]:
    """SGLang's `meta_info` of one result."""
    meta: dict[str, Any] = {
        "id": r.rid,
        "finish_reason": r.finish_reason,
        "prompt_tokens": r.prompt_tokens,
        "completion_tokens": r.completion_tokens,
        "cached_tokens": 0,
        "reasoning_tokens": 0,
        "weight_version": r.weight_version,
        "num_retractions": r.num_retractions,
        "e2e_latency": round(r.e2e_latency, 6),
    }
    if r.weight_versions is not None:
        meta["weight_versions"] = r.weight_versions
    if r.logprobs is not None:
        meta.update(meta_fields(r.logprobs, tokenizer))
    return meta


def output(r: SeqResult, tokenizer) -> dict[str, Any]:
    """One `/generate` reply item."""
    return {"text": r.text, "output_ids": r.output_ids, "meta_info": meta_info(r, tokenizer)}
