"""`miles.rollout.generate_hub.multi_turn` as pinned-eval serves it: `generate`, miles' multi-turn
tool-calling loop on native `/generate` (the retool recipe): up to `args.generate_max_turns` model
calls; each reply's tool calls (`args.generate_tool_call_parser` over `args.generate_tool_specs_path`)
run through `args.generate_execute_tool_function_path` and their outputs are appended (loss mask
0); it stops at a reply without tool calls, an `abort` / `length` finish, or no tokens left."""

from __future__ import annotations

from copy import deepcopy

from pinned_eval.agentic.compat.base_types import GenerateFnInput, GenerateFnOutput
from pinned_eval.agentic.compat.endpoint import (
    compute_prompt_ids_from_sample,
    compute_request_payload,
    compute_routing_headers,
    update_sample_from_response,
)
from pinned_eval.agentic.compat.http_utils import post
from pinned_eval.agentic.compat.misc import load_function
from pinned_eval.agentic.compat.tool_call_utils import (
    create_tool_call_parser,
    execute_tool_calls,
    update_sample_with_tool_responses,
)

__all__ = ["generate"]


async def generate(input: GenerateFnInput) -> GenerateFnOutput:
    args, sample = input.args, deepcopy(input.sample)
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    execute = load_function(args.generate_execute_tool_function_path)
    specs = load_function(args.generate_tool_specs_path)
    parser = create_tool_call_parser(specs, args.generate_tool_call_parser)
    sample.tokens = compute_prompt_ids_from_sample(input.state, sample, tools=specs)
    for _ in range(args.generate_max_turns):
        payload, halt = compute_request_payload(args, sample.tokens, input.sampling_params)
        if payload is None:
            assert halt is not None
            sample.status = halt
            break
        output = await post(url, payload, headers=compute_routing_headers(args, sample))
        await update_sample_from_response(args, sample, payload=payload, output=output, update_loss_mask=True)
        if output["meta_info"]["finish_reason"]["type"] in ("abort", "length"):
            break
        _, calls = parser.parse_non_stream(output["text"])
        if not calls:
            break
        update_sample_with_tool_responses(sample, await execute_tool_calls(calls, execute), input.state.tokenizer)
    return GenerateFnOutput(samples=sample)
