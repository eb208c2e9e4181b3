"""pinned-eval's CPU engine: SGLang's native HTTP API over transformers, and tiny offline models.

Modules: `server` (FastAPI app + uvicorn), `runner` (model thread, continuous batching, weight
loads), `protocol` (request validation), `decoding` (sampling and finish rules), `weights`
(safetensors loading), `state` (event-loop side locks and flags), `launch` (`EngineArgs`, no torch
import), `cli` (`python -m engine`), `tiny_model` (offline tiny HF models and perturbed snapshots).
A leaf: imports nothing of the project (the project starts it as a `python -m engine` process).
"""

__version__ = "0.1.0"
