"""FastAPI app of the CPU engine: SGLang's native HTTP API (0.5.23 semantics) over `Runner`.

Endpoints: /health, /health_generate, /ready (always open); /generate, /model_info,
/get_model_info, /server_info, /get_server_info, /v1/models, /get_load (api key); and the
admin-optional control plane /update_weights_from_disk, /update_weight_version,
/pause_generation, /continue_generation, /abort_request, /flush_cache, /load_lora_adapter,
/unload_lora_adapter (admin key if set, else api key if set). `/generate` takes SGLang's
`lora_path` (adapter names, engine/lora.py); `/v1/models` lists loaded adapters.
Auth is `Authorization: Bearer <key>`; failures are 401 `{"error": ...}`.
Malformed /generate bodies are 400 `{"error": "<field>: <why>"}`; while the weights are unknown
after a failed load /generate answers 503. Aborted requests are HTTP 200 with
`finish_reason.type == "abort"`. One log line per /generate call and per control call (stderr).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from engine import __version__
from engine.batch import SeqResult, Sequence
from engine.control import add_control_routes, add_lora_routes
from engine.launch import EngineArgs
from engine.openai_api import add_openai_routes
from engine.protocol import GenerateRequest, ProtocolError, SamplingParams
from engine.runner import Runner
from engine.scripted import Script, load_rules
from engine.serving import execute, output
from engine.state import EngineState, Refused, engine_state, normal_auth, parse_body

log = logging.getLogger("pinned_eval.engine")


def create_app(args: EngineArgs) -> FastAPI:
    """The engine app; the model loads in the lifespan (the port serves only once it is loaded)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        from transformers import AutoTokenizer  # transformers: slow import, only when a model is loaded

        runner = await asyncio.to_thread(
            Runner,
            args.model_path,
            args.weight_version,
            args.threads,
            args.max_batch_size,
            args.context_length,
        )
        tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, args.model_path)
        rules = load_rules(args.scripted_completions) if args.scripted_completions else []
        runner.start()
        app.state.engine = EngineState(args, runner, tokenizer, Script(rules, tokenizer) if rules else None)
        log.info(
            "engine ready model_path=%s weight_version=%s port=%s",
            args.model_path,
            args.weight_version,
            args.port,
        )
        try:
            yield
        finally:
            await asyncio.to_thread(runner.stop)

    app = FastAPI(title="pinned-eval CPU engine", version=__version__, lifespan=lifespan)

    @app.exception_handler(Refused)
    async def refused(_: Request, exc: Refused) -> JSONResponse:
        return JSONResponse(exc.body, status_code=exc.status)

    _health_routes(app)
    _info_routes(app)
    _generate_route(app)
    add_openai_routes(app)
    add_control_routes(app)
    add_lora_routes(app)
    return app


# ---- health -------------------------------------------------------------------------------------
def _health_routes(app: FastAPI) -> None:
    async def probe(request: Request) -> Response:
        st = engine_state(request)
        if st.serving_state() is not None:
            return Response(status_code=503)
        runner = st.runner
        seq = Sequence(
            rid=f"HEALTH_CHECK_{uuid.uuid4().hex}",
            prompt_ids=[runner.bos_id],
            params=SamplingParams(max_new_tokens=1, temperature=0.0),
            seed=0,
            internal=True,
        )
        runner.submit([seq])
        try:
            result: SeqResult = await asyncio.wait_for(asyncio.wrap_future(seq.future), st.args.health_timeout_s)
        except TimeoutError:
            runner.abort(seq.rid, message="health check timed out")
            return Response(status_code=503)
        return Response(status_code=503 if result.finish_reason["type"] == "abort" else 200)

    app.get("/health")(probe)
    app.get("/health_generate")(probe)

    @app.get("/ready")
    async def ready(request: Request) -> Response:
        return Response(status_code=503 if engine_state(request).serving_state() else 200)


# ---- info ---------------------------------------------------------------------------------------
def _info_routes(app: FastAPI) -> None:
    def model_info(request: Request) -> dict:
        st = engine_state(request)
        runner = st.runner
        return {
            "model_path": runner.model_path,
            "tokenizer_path": st.args.model_path,
            "served_model_name": st.served_model_name,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": runner.weight_version,
            "load_format": runner.load_format,
            "reasoning_parser": None,
            "tool_call_parser": st.args.tool_call_parser,
            "disaggregation_mode": "null",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": runner.model_type,
            "architectures": runner.architectures,
        }

    app.get("/model_info", dependencies=[Depends(normal_auth)])(model_info)

    @app.get("/get_model_info", dependencies=[Depends(normal_auth)])
    def get_model_info(request: Request) -> dict:
        log.warning("/get_model_info is deprecated; use /model_info")
        return model_info(request)

    def server_info(request: Request) -> dict:
        st = engine_state(request)
        runner = st.runner
        startup = st.args.model_dump(exclude={"api_key", "admin_api_key"})
        stats = {k: v for k, v in vars(runner.stats).items()}
        return {
            **startup,
            "tokenizer_path": st.args.model_path,
            "served_model_name": st.served_model_name,
            "tp_size": 1,
            "dp_size": 1,
            "device": "cpu",
            "dtype": "float32",
            "load_format": "auto",
            "max_running_requests": st.args.max_batch_size,
            "context_length": runner.context_len,
            "startup_time": st.startup_time,
            "internal_states": [{**stats, **runner.load(), "paused": st.paused, "weights_ok": runner.weights_ok}],
            "version": __version__,
            "engine": "pinned-eval-cpu",
            "frontend": "python",
        }

    app.get("/server_info", dependencies=[Depends(normal_auth)])(server_info)
    app.get("/get_server_info", dependencies=[Depends(normal_auth)])(server_info)

    @app.get("/v1/models", dependencies=[Depends(normal_auth)])
    def models(request: Request) -> dict:
        st = engine_state(request)
        card = {
            "id": st.served_model_name,
            "object": "model",
            "created": int(st.startup_time),
            "owned_by": "sglang",
            "root": st.runner.model_path,
            "max_model_len": st.runner.context_len,
        }
        adapters = [
            {"id": name, "object": "model", "created": int(st.startup_time), "owned_by": "sglang", "root": path,
             "parent": st.served_model_name, "max_model_len": None}
            for name, path in st.runner.lora.loaded().items()
        ]
        return {"object": "list", "data": [card, *adapters]}

    @app.get("/get_load", dependencies=[Depends(normal_auth)])
    def get_load(request: Request) -> list[dict]:
        runner = engine_state(request).runner
        return [{"dp_rank": 0, **runner.load(), "max_batch_size_seen": runner.stats.max_batch_size_seen}]


# ---- generate -----------------------------------------------------------------------------------
def _generate_route(app: FastAPI) -> None:
    @app.api_route("/generate", methods=["POST", "PUT"], dependencies=[Depends(normal_auth)])
    async def generate(request: Request) -> JSONResponse:
        st = engine_state(request)
        req = await parse_body(request, GenerateRequest)
        try:
            items = req.items()
        except ProtocolError as err:
            raise Refused(400, {"error": str(err)}) from None
        results = await execute(request, st, items, "generate", req.is_batch)
        outputs = [output(r, st.tokenizer) for r in results]
        single = not req.is_batch and items[0].params.n == 1
        return JSONResponse(outputs[0] if single else outputs)


def serve(args: EngineArgs) -> None:
    """Run the engine in the foreground until SIGINT/SIGTERM."""
    from transformers.utils import logging as hf_logging  # transformers: slow import, only when serving

    hf_logging.disable_progress_bar()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s engine:{args.port} %(levelname)s %(message)s")
    for noisy in ("httpx", "transformers", "uvicorn.error"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    config = uvicorn.Config(
        create_app(args),
        host=args.host,
        port=args.port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=5,
    )
    uvicorn.Server(config).run()
