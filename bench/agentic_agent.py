"""The agent function `python -m bench agentic_point --function agent` runs (miles' agent-function
contract, `custom_agent_function_path`): one chat completion to its session per sample."""

import os
from typing import Any

import httpx


async def run_agent(base_url: str, prompt: Any, request_kwargs: dict[str, Any], metadata: dict[str, Any],
                    **kwargs: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    async with httpx.AsyncClient(timeout=60) as client:
        reply = await client.post(f"{base_url}/v1/chat/completions",
                                  headers={"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"},
                                  json={"model": "policy", "messages": messages, **request_kwargs})
        reply.raise_for_status()
    return {}


async def generate_reading_tokenizer(input: Any) -> Any:
    """miles' hub `agentic_tool_call` after reading `state.tokenizer` first: what every agent point
    paid while the compat `GenerateState` loaded the tokenizer when made (the before figure)."""
    from miles.rollout.generate_hub.agentic_tool_call import generate

    assert input.state.tokenizer is not None
    return await generate(input)
