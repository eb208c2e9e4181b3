"""Logprobs on the wire, in SGLang's shapes (docs/engine.md, "Logprobs").

Contract:
- `meta_fields` gives `/generate`'s `meta_info` entries of a request that set `return_logprob`:
  `input_token_logprobs` and `output_token_logprobs` as `[logprob, token_id, text]` triples
  (text is null unless `return_text_in_logprobs`; the first prompt entry's logprob is null),
  `output_token_logprobs_length`, and with `top_logprobs_num > 0` also `input_top_logprobs`
  (first row null) and `output_top_logprobs` (one list of triples per position, best first).
  Token texts are each token decoded alone, special tokens kept (SGLang's `batch_decode`).
- `completion_logprobs` is `/v1/completions`' `LogProbs` (`tokens`, `token_logprobs`,
  `top_logprobs` as {text: logprob} or null, `text_offset` all -1): prompt entries first when
  echoed, then the output's (SGLang's `to_openai_style_logprobs`).
- `chat_logprobs` is `/v1/chat/completions`' `{"content": [{token, bytes, logprob,
  top_logprobs: [{token, bytes, logprob}]}]}` over the output tokens; `bytes` are the token's
  raw bytes (byte-level BPE tokenizers: from the token itself, so a fragment of a multi-byte
  character keeps its byte; otherwise the UTF-8 of its text).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from engine.batch import Logprobs, Top


def _texts(tokenizer, ids: list[int]) -> list[str]:
    return [str(t) for t in tokenizer.batch_decode([[i] for i in ids])] if ids else []


def _triples(tokenizer, pairs: list[tuple[Any, int]], with_text: bool) -> list[list[Any]]:
    texts = _texts(tokenizer, [i for _, i in pairs]) if with_text else [None] * len(pairs)
    return [[lp, i, t] for (lp, i), t in zip(pairs, texts, strict=True)]


def _top_rows(tokenizer, rows: list[Top | None], with_text: bool) -> list[list[list[Any]] | None]:
    return [None if row is None else _triples(tokenizer, list(row), with_text) for row in rows]


def meta_fields(lp: Logprobs, tokenizer) -> dict[str, Any]:
    """The logprob entries of one `/generate` reply's `meta_info`."""
    text = lp.spec.with_text
    out: dict[str, Any] = {
        "input_token_logprobs": _triples(tokenizer, lp.input_token, text),
        "output_token_logprobs": _triples(tokenizer, lp.output_token, text),
        "output_token_logprobs_length": len(lp.output_token),
    }
    if lp.spec.top_n > 0:
        out["input_top_logprobs"] = _top_rows(tokenizer, lp.input_top, text)
        out["output_top_logprobs"] = _top_rows(tokenizer, list(lp.output_top), text)
    return out


def completion_logprobs(lp: Logprobs, tokenizer, echo: bool) -> dict[str, Any]:
    """`choices[i].logprobs` of a `/v1/completions` reply."""
    pairs: list[tuple[Any, int]] = [*(lp.input_token if echo else []), *lp.output_token]
    tops: list[Top | None] = [*(lp.input_top if echo else []), *lp.output_top]
    texts = _texts(tokenizer, [i for _, i in pairs])
    top_dicts: list[dict[str, float] | None] = []
    for row in tops:
        if row is None:
            top_dicts.append(None)
        else:
            row_texts = _texts(tokenizer, [i for _, i in row])
            top_dicts.append({t: v for (v, _), t in zip(row, row_texts, strict=True)})
    return {
        "text_offset": [-1] * len(pairs),
        "token_logprobs": [v for v, _ in pairs],
        "tokens": texts,
        "top_logprobs": top_dicts if lp.spec.top_n > 0 else [],
    }


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, character -> byte."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars = keep[:]
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(keep, chars, strict=True)}


def _token_bytes(tokenizer, token_id: int, text: str) -> list[int]:
    piece = tokenizer.convert_ids_to_tokens(token_id)
    decoder = _byte_decoder()
    if isinstance(piece, str) and piece and all(ch in decoder for ch in piece):
        return [decoder[ch] for ch in piece]
    return list(text.encode("utf-8"))


def chat_logprobs(lp: Logprobs, tokenizer) -> dict[str, Any]:
    """`choices[i].logprobs` of a `/v1/chat/completions` reply."""
    content = []
    texts = _texts(tokenizer, [i for _, i in lp.output_token])
    for k, ((value, token_id), text) in enumerate(zip(lp.output_token, texts, strict=True)):
        top: list[dict[str, Any]] = []
        if lp.spec.top_n > 0 and k < len(lp.output_top):
            row = lp.output_top[k]
            for (v, i), t in zip(row, _texts(tokenizer, [i for _, i in row]), strict=True):
                top.append({"token": t, "bytes": _token_bytes(tokenizer, i, t), "logprob": v})
        content.append(
            {"token": text, "bytes": _token_bytes(tokenizer, token_id, text), "logprob": value, "top_logprobs": top}
        )
    return {"content": content}
