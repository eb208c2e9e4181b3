"""A retool-style generate function (miles' `custom_generate_function_path` contract) whose tool is
pinned-eval's stock sandboxed Python interpreter.

It runs in pinned-eval's runner subprocess, never in the worker: `args.sglang_router_ip` /
`sglang_router_port` are the point's gateway (every reply checked against the pinned weight
version), and the model's code runs in the sandbox (`pinned_eval.sandbox.python_tool`). With real
miles installed the same module runs there unchanged.
"""

import json
import re

from miles.utils.http_utils import post
from miles.utils.types import Sample

from pinned_eval.sandbox.python_tool import execute_tool

TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


async def generate(args, sample: Sample, sampling_params) -> Sample:
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    headers = {"X-SMG-Routing-Key": sample.routing_key} if sample.routing_key else None
    response = ""
    for _ in range(args.generate_max_turns or 4):
        out = await post(url, {"text": sample.prompt + response, "sampling_params": sampling_params}, headers=headers)
        response += out["text"]
        sample.update_from_meta_info(args, out["meta_info"])  # weight version and status, as miles does
        call = TOOL_CALL.search(out["text"])
        if call is None or sample.status != Sample.Status.COMPLETED:
            break
        try:
            request = json.loads(call.group(1))
            result = await execute_tool(request.get("name", ""), request.get("arguments") or {})
        except ValueError as exc:  # the model wrote a malformed call: tell it, as a tool would
            result = f"Error: {exc}"
        response += f"\n<tool_response>\n{result}\n</tool_response>\n"
    sample.response = response
    return sample
