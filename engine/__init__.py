"""pinned-eval's CPU engine: SGLang's native HTTP API over transformers, and tiny offline models.

Modules: `server` (FastAPI app + uvicorn), `runner` (model thread, continuous batching, weight
loads), `protocol` (request validation), `decoding` (sampling and finish rules), `weights`
(safetensors loading), `state` (event-loop side locks and flags), `launch` (process start/stop,
no torch import), `tiny_model` (offline tiny HF models and perturbed snapshots).
"""

__version__ = "0.1.0"
