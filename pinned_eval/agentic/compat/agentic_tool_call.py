"""`miles.rollout.generate_hub.agentic_tool_call` as pinned-eval serves it: `generate`, the
wrapper of an agent function (`args.custom_agent_function_path`) that speaks chat completions.

`generate(input)` calls `await run_agent(base_url=<the sample's gateway session>, prompt,
request_kwargs, metadata)`, miles' agent contract: `base_url` is an OpenAI base URL
(`<base>/v1/chat/completions`), whose bearer token is also in `OPENAI_API_KEY` (set by the
runner, so an OpenAI client finds it); `request_kwargs` are the sampling params under
chat-completion names (`max_new_tokens` -> `max_tokens`, `sampling_seed` -> `seed`); a returned
dict is merged into the sample's metadata. The sample's response, status and weight versions are
then taken by the worker from the gateway's transcript of that session (miles' merged session
trajectory, `pinned_eval.rollout.trajectory`), so they
are what the fleet answered, not what the agent says.
"""

from __future__ import annotations

import inspect
from contextvars import ContextVar
from typing import Any

from pinned_eval.agentic.compat.base_types import GenerateFnInput, GenerateFnOutput
from pinned_eval.agentic.compat.misc import load_function
from pinned_eval.agentic.compat.types import Sample

__all__ = ["SESSION_URL", "generate", "request_kwargs"]

SESSION_URL: ContextVar[str | None] = ContextVar("pinned_eval_session_url", default=None)
_NAMES = {"max_new_tokens": "max_tokens", "sampling_seed": "seed"}
_KEPT = ("temperature", "top_p", "top_k", "max_new_tokens", "sampling_seed", "stop")


def request_kwargs(sampling_params: dict[str, Any]) -> dict[str, Any]:
    """Sampling params under chat-completion names (see the module docstring)."""
    return {_NAMES.get(k, k): v for k, v in sampling_params.items() if k in _KEPT and v is not None}


async def generate(input: GenerateFnInput) -> GenerateFnOutput:
    args, sample = input.args, input.sample
    agent = load_function(getattr(args, "custom_agent_function_path", None))
    if agent is None:
        raise ValueError("agentic_tool_call.generate: custom_agent_function_path is not set")
    base_url = SESSION_URL.get()
    if base_url is None:
        raise RuntimeError("agentic_tool_call.generate: no gateway session for this sample")
    out = agent(base_url=base_url, prompt=sample.prompt, request_kwargs=request_kwargs(input.sampling_params),
                metadata=sample.metadata)
    out = await out if inspect.isawaitable(out) else out
    if isinstance(out, dict):
        sample.metadata.update(out)
    sample.status = Sample.Status.COMPLETED
    sample.metadata["from_transcript"] = True
    return GenerateFnOutput(samples=sample)
