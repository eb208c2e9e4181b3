"""`miles.rollout.generate_hub.single_turn` as pinned-eval serves it: `generate`, one native
`/generate` call to the router `args` names (the point gateway), the reply folded into the sample."""

from __future__ import annotations

from pinned_eval.agentic.compat.base_types import GenerateFnInput, GenerateFnOutput
from pinned_eval.agentic.compat.endpoint import (
    compute_prompt_ids_from_sample,
    compute_request_payload,
    compute_routing_headers,
    update_sample_from_response,
)
from pinned_eval.agentic.compat.http_utils import post
from pinned_eval.agentic.compat.types import Sample

__all__ = ["generate"]


async def generate(input: GenerateFnInput) -> GenerateFnOutput:
    args, sample = input.args, input.sample
    if sample.status not in (Sample.Status.PENDING, Sample.Status.ABORTED):
        raise ValueError(f"single_turn.generate: sample {sample.index} has status {sample.status}")
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    input_ids = compute_prompt_ids_from_sample(input.state, sample)
    payload, halt = compute_request_payload(args, input_ids=input_ids, sampling_params=input.sampling_params)
    if payload is None:
        assert halt is not None
        sample.status = halt
        return GenerateFnOutput(samples=sample)
    output = await post(url, payload, headers=compute_routing_headers(args, sample))
    await update_sample_from_response(args, sample, payload=payload, output=output)
    return GenerateFnOutput(samples=sample)
