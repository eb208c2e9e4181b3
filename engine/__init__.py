"""pinned-eval's CPU engine: SGLang's native HTTP API over transformers, and tiny offline models.

Modules: `server` (FastAPI app + uvicorn), `serving` (running prompts for /generate and /v1),
`openai_api` (/v1/completions, /v1/chat/completions), `logprobs` (logprobs in SGLang's shapes),
`tool_calls` (SGLang's qwen25 / hermes tool-call parsers), `scripted` (test-only scripted
decoding), `runner` (model thread, continuous batching, weight loads), `protocol` (request
validation), `decoding` (sampling and finish rules), `weights` (safetensors loading), `state`
(event-loop side locks and flags), `launch` (`EngineArgs`, no torch import), `cli`
(`python -m engine`), `tiny_model` (offline tiny HF models and perturbed snapshots).
The wire format, field by field: docs/engine.md.
A leaf: imports nothing of the project (the project starts it as a `python -m engine` process).
"""

__version__ = "0.1.0"
