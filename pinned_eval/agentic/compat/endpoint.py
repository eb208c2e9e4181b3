"""`miles.rollout.generate_utils.generate_endpoint_utils` as pinned-eval serves it: the helpers
that turn a `Sample` into a native `/generate` request and a reply back into the `Sample`.

- `compute_prompt_ids_from_sample(state, sample, tools=None)`: a string prompt is encoded without
  special tokens; a message list is rendered with the state's chat template first;
- `compute_request_payload(args, input_ids, sampling_params, multimodal_inputs=None)`:
  `(payload, None)` with `input_ids`, the sampling params (`max_new_tokens` capped by
  `args.rollout_max_context_len` when set) and `return_logprob: True`; `(None, TRUNCATED)` when no
  token is left;
- `compute_routing_headers(args, sample)`: `X-SMG-Routing-Key` when the sample has a routing key;
- `update_sample_from_response(args, sample, payload, output, update_loss_mask=False)`: appends
  the reply's text, its token ids and logprobs (from `meta_info.output_token_logprobs`), its
  weight version and the status its finish reason implies.
"""

from __future__ import annotations

from typing import Any

from pinned_eval.agentic.compat.types import Sample

__all__ = [
    "compute_prompt_ids_from_sample",
    "compute_request_payload",
    "compute_routing_headers",
    "update_sample_from_response",
]


def compute_prompt_ids_from_sample(state: Any, sample: Sample, tools: list[dict[str, Any]] | None = None) -> list[int]:
    prompt = sample.prompt
    if state.tokenizer is None:
        raise RuntimeError("compute_prompt_ids_from_sample: no tokenizer (args.hf_checkpoint is not set)")
    if not isinstance(prompt, str):
        prompt = state.tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True, tools=tools)
    return list(state.tokenizer.encode(prompt, add_special_tokens=False))


def compute_routing_headers(args: Any, sample: Sample) -> dict[str, str] | None:
    return {"X-SMG-Routing-Key": sample.routing_key} if sample.routing_key else None


def compute_request_payload(
    args: Any, input_ids: list[int], sampling_params: dict[str, Any], multimodal_inputs: dict[str, Any] | None = None
) -> tuple[dict[str, Any] | None, Sample.Status | None]:
    params = dict(sampling_params)
    budget = params.pop("max_new_tokens", getattr(args, "rollout_max_response_len", None))
    context = getattr(args, "rollout_max_context_len", None)
    if context:
        budget = min(budget, context - len(input_ids))
    if budget is None or budget <= 0:
        return None, Sample.Status.TRUNCATED
    return {"input_ids": list(input_ids), "sampling_params": {**params, "max_new_tokens": budget},
            "return_logprob": True}, None


async def update_sample_from_response(
    args: Any, sample: Sample, payload: dict[str, Any], output: dict[str, Any], update_loss_mask: bool = False
) -> None:
    if not sample.response and not sample.tokens and "input_ids" in payload:
        sample.tokens = list(payload["input_ids"])
    triples = output["meta_info"].get("output_token_logprobs") or []
    token_ids = [t[1] for t in triples]
    sample.tokens = sample.tokens + token_ids
    sample.response_length += len(token_ids)
    sample.response += output["text"]
    sample.rollout_log_probs = (sample.rollout_log_probs or []) + [t[0] for t in triples]
    if update_loss_mask:
        sample.loss_mask = (sample.loss_mask or []) + [1] * len(token_ids)
    sample.update_from_meta_info(args, output["meta_info"])
