"""Per-sequence token selection and finish rules, with SGLang's semantics.

Contract:
- `choose_token` applies, in order: logit_bias, repetition/frequency/presence penalties, a ban on
  stop tokens while fewer than `min_new_tokens` were generated, then greedy argmax when
  `params.greedy`, else temperature, top_k, top_p, min_p and a draw from the sequence's own
  `torch.Generator`. The same seed and the same logits give the same token, whatever else is in
  the batch.
- `finish_reason` returns SGLang's JSON (`{"type": "stop", "matched": <id or str>}` or
  `{"type": "length", "length": N}`) or None. No stop rule applies before `min_new_tokens`.
  EOS stops unless `ignore_eos`; `stop_token_ids` always stop.
- `processed_logits` is the first half of `choose_token` (bias, penalties, min-token ban) and
  `pick` the second; `token_logprobs` is the distribution SGLang reports for an output token
  (its sampler): log-softmax of the processed logits, divided by the temperature unless the
  request is greedy, before top-k/top-p/min-p; -inf is clamped to the float minimum (JSON-safe).
- `output_text` decodes the output and trims the matched stop string (or a matched stop token)
  unless `no_stop_trim`; `output_ids` are never trimmed.
- Sampling seeds: copy 0 of a request uses `sampling_seed` itself; copy j > 0 of an `n > 1`
  request uses a seed derived from (seed, j), so copies differ but stay reproducible.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Sequence

import torch

from engine.protocol import ALL_TOKENS, SamplingParams


def copy_seed(seed: int | None, copy_index: int) -> int:
    """The seed of copy `copy_index` of a request; a fresh random seed when none was given."""
    if seed is None:
        return secrets.randbits(63)
    if copy_index == 0:
        return seed
    return (seed * 1_000_003 + copy_index * 7_919) % (1 << 63)


def make_generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed % (1 << 63))


def _penalise(
    logits: torch.Tensor, params: SamplingParams, prompt_ids: Sequence[int], output_ids: Sequence[int]
) -> None:
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long)
        seen = seen[seen < logits.numel()]
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
    if output_ids and (params.frequency_penalty != 0.0 or params.presence_penalty != 0.0):
        ids = torch.tensor(output_ids, dtype=torch.long)
        ids = ids[ids < logits.numel()]
        counts = torch.bincount(ids, minlength=logits.numel()).to(logits.dtype)
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)


def processed_logits(
    logits: torch.Tensor,
    params: SamplingParams,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    stop_ids: Sequence[int],
) -> torch.Tensor:
    """One row of float logits `[vocab]` after logit_bias, penalties and the min-token stop ban."""
    logits = logits.float().clone()
    vocab = logits.numel()
    for token, bias in params.logit_bias.items():
        if 0 <= token < vocab:
            logits[token] += bias
    _penalise(logits, params, prompt_ids, output_ids)
    if len(output_ids) < params.min_new_tokens:
        banned = [t for t in stop_ids if 0 <= t < vocab]
        if banned:
            logits[banned] = float("-inf")
    return logits


def token_logprobs(processed: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The logprob vector SGLang reports for an output position (see the module contract)."""
    scaled = processed if params.greedy else processed / params.temperature
    out = torch.log_softmax(scaled, dim=-1)
    return out.clamp(min=torch.finfo(out.dtype).min)


def choose_token(
    logits: torch.Tensor,
    params: SamplingParams,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    generator: torch.Generator,
    stop_ids: Sequence[int],
) -> int:
    """Pick the next token from one row of float logits `[vocab]`."""
    return pick(processed_logits(logits, params, prompt_ids, output_ids, stop_ids), params, generator)


def pick(processed: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """The sampling half of `choose_token`, over `processed_logits`."""
    logits = processed.clone()
    vocab = logits.numel()
    if params.greedy:
        return int(torch.argmax(logits))
    logits /= params.temperature
    if params.top_k < min(vocab, ALL_TOKENS):
        kth = torch.topk(logits, params.top_k).values[-1]
        logits[logits < kth] = float("-inf")
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        drop = (cumulative - sorted_probs) > params.top_p  # keep the smallest prefix reaching top_p
        probs[order[drop]] = 0.0
    if params.min_p > 0.0:
        probs[probs < params.min_p * probs.max()] = 0.0
    return int(torch.multinomial(probs, 1, generator=generator))


def finish_reason(
    params: SamplingParams,
    output_ids: Sequence[int],
    text: str | None,
    eos_ids: Sequence[int],
    prompt_len: int,
    context_len: int,
) -> dict | None:
    """SGLang's finish_reason after the last token of `output_ids` was appended (None: keep going).

    `text` is the decoded output so far (needed only when the request has stop strings/regexes).
    """
    count = len(output_ids)
    if count >= params.min_new_tokens and output_ids:
        last = output_ids[-1]
        if last in params.stop_token_ids or (not params.ignore_eos and last in eos_ids):
            return {"type": "stop", "matched": last}
        if text is not None:
            hit = _first_stop_string(text, params.stop)
            if hit is not None:
                return {"type": "stop", "matched": hit}
            for pattern in params.stop_regex:
                if re.search(pattern, text):
                    return {"type": "stop", "matched": pattern}
    if count >= params.max_new_tokens:
        return {"type": "length", "length": params.max_new_tokens}
    if prompt_len + count >= context_len:
        return {"type": "length", "length": count}
    return None


def _first_stop_string(text: str, stops: Sequence[str]) -> str | None:
    best: tuple[int, str] | None = None
    for stop in stops:
        pos = text.find(stop) if stop else -1
        if pos >= 0 and (best is None or pos < best[0]):
            best = (pos, stop)
    return None if best is None else best[1]


def output_text(decode, output_ids: list[int], params: SamplingParams, finish: dict | None) -> str:
    """The response text: decoded output, trimmed at the matched stop unless `no_stop_trim`."""
    matched = finish.get("matched") if finish and finish.get("type") == "stop" else None
    if isinstance(matched, int) and not params.no_stop_trim:
        return decode(output_ids[:-1], params.skip_special_tokens)
    text = decode(output_ids, params.skip_special_tokens)
    if isinstance(matched, str) and not params.no_stop_trim:
        if matched in params.stop:
            pos = text.find(matched)
            if pos >= 0:
                return text[:pos]
        else:
            found = re.search(matched, text)
            if found:
                return text[: found.start()]
    return text
