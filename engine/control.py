"""Control-plane routes (SGLang's admin-optional endpoints) of the CPU engine.

/update_weights_from_disk (200 `{success: true, message, num_paused_requests: 0}` / 400
`{success: false, message}`; version and model_path change only on success; the load waits for
in-flight requests unless paused, or aborts them with `abort_all_requests`), /update_weight_version
(default aborts in-flight requests, like SGLang), /pause_generation, /continue_generation,
/abort_request (200 empty body), /flush_cache (GET/POST, text body, 400 while requests run);
`add_lora_routes`: /load_lora_adapter, /unload_lora_adapter (contract in engine/lora.py).
"""

from __future__ import annotations

import asyncio
import logging
import time

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from engine.lora import AdapterError
from engine.protocol import (
    AbortRequest,
    ContinueGenerationRequest,
    LoadLoRAAdapterRequest,
    PauseGenerationRequest,
    UnloadLoRAAdapterRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightVersionRequest,
)
from engine.state import EngineState, admin_auth, engine_state, parse_body
from engine.weights import SUPPORTED_LOAD_FORMATS, LoadReport, WeightLoadError

log = logging.getLogger("pinned_eval.engine")


def add_control_routes(app: FastAPI) -> None:
    admin = [Depends(admin_auth)]

    @app.post("/update_weights_from_disk", dependencies=admin)
    async def update_weights_from_disk(request: Request) -> JSONResponse:
        st = engine_state(request)
        req = await parse_body(request, UpdateWeightsFromDiskRequest, failure="message")
        if req.load_format not in SUPPORTED_LOAD_FORMATS:
            message = f"Failed to get model loader: load_format {req.load_format!r} is not supported on CPU"
            return JSONResponse({"success": False, "message": message}, status_code=400)
        started = time.monotonic()
        st.loading += 1
        try:
            if req.abort_all_requests:
                st.runner.abort(abort_all=True, message="Aborted by update_weights_from_disk.")
            if st.paused:  # SGLang loads at once when paused (no writer lock)
                report = await _load(st, req)
            else:
                async with st.lock.write():
                    report = await _load(st, req)
        except WeightLoadError as err:
            log.warning("update_weights_from_disk FAILED path=%s: %s", req.model_path, err)
            message = (
                f"Failed to update weights: {err}. "
                "The engine's weights are now unknown; load a good snapshot."
            )
            return JSONResponse({"success": False, "message": message}, status_code=400)
        finally:
            st.loading -= 1
        log.info(
            "update_weights_from_disk ok path=%s version=%s tensors=%d %.3fs",
            req.model_path,
            st.runner.weight_version,
            report.tensors,
            time.monotonic() - started,
        )
        return JSONResponse(
            {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}
        )

    @app.post("/update_weight_version", dependencies=admin)
    async def update_weight_version(request: Request) -> JSONResponse:
        st = engine_state(request)
        req = await parse_body(request, UpdateWeightVersionRequest, failure="message")
        if req.abort_all_requests:
            st.runner.abort(abort_all=True, message="Aborted by update_weight_version.")
        await asyncio.wrap_future(st.runner.set_weight_version(req.new_version))
        log.info("update_weight_version %s", req.new_version)
        return JSONResponse(
            {
                "success": True,
                "message": f"Weight version updated to {req.new_version}",
                "new_version": req.new_version,
            }
        )

    @app.post("/pause_generation", dependencies=admin)
    async def pause_generation(request: Request) -> dict:
        st = engine_state(request)
        req = await parse_body(request, PauseGenerationRequest)
        st.set_paused(True)
        await asyncio.wrap_future(st.runner.pause(req.mode))
        log.info("pause_generation mode=%s", req.mode)
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation", dependencies=admin)
    async def continue_generation(request: Request) -> dict:
        st = engine_state(request)
        await parse_body(request, ContinueGenerationRequest)
        await asyncio.wrap_future(st.runner.resume())
        st.set_paused(False)
        log.info("continue_generation")
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.post("/abort_request", dependencies=admin)
    async def abort_request(request: Request) -> Response:
        st = engine_state(request)
        req = await parse_body(request, AbortRequest)
        count = st.runner.abort(
            req.rid, abort_all=req.abort_all, message=req.abort_message or "Aborted by request."
        )
        log.info("abort_request rid=%r abort_all=%s matched=%d", req.rid, req.abort_all, count)
        return Response(status_code=200)

    @app.api_route("/flush_cache", methods=["GET", "POST"], dependencies=admin)
    async def flush_cache(request: Request) -> PlainTextResponse:
        if engine_state(request).runner.load()["num_reqs"]:
            return PlainTextResponse("Cache not flushed: requests are running or waiting.", status_code=400)
        return PlainTextResponse(
            "Cache flushed.\nPlease check backend logs for more details. "
            "(When there are running or waiting requests, the operation will not be performed.)"
        )


def add_lora_routes(app: FastAPI) -> None:
    """SGLang's `/load_lora_adapter` and `/unload_lora_adapter` (contract: engine/lora.py)."""
    admin = [Depends(admin_auth)]

    @app.post("/load_lora_adapter", dependencies=admin)
    async def load_lora_adapter(request: Request) -> JSONResponse:
        st = engine_state(request)
        req = await parse_body(request, LoadLoRAAdapterRequest, failure="message")
        hooks = st.runner.lora
        try:
            await asyncio.wrap_future(st.runner.call(lambda: hooks.load(req.lora_name, req.lora_path)))
        except AdapterError as err:
            log.warning("load_lora_adapter FAILED name=%s path=%s: %s", req.lora_name, req.lora_path, err)
            return _lora_reply(False, str(err), hooks.loaded())
        log.info("load_lora_adapter ok name=%s path=%s", req.lora_name, req.lora_path)
        return _lora_reply(True, "", hooks.loaded())

    @app.post("/unload_lora_adapter", dependencies=admin)
    async def unload_lora_adapter(request: Request) -> JSONResponse:
        st = engine_state(request)
        req = await parse_body(request, UnloadLoRAAdapterRequest, failure="message")
        hooks = st.runner.lora
        try:
            async with st.lock.write():  # SGLang waits for the requests that use it
                await asyncio.wrap_future(st.runner.call(lambda: hooks.unload(req.lora_name)))
        except AdapterError as err:
            log.warning("unload_lora_adapter FAILED name=%s: %s", req.lora_name, err)
            return _lora_reply(False, str(err), None)
        log.info("unload_lora_adapter ok name=%s", req.lora_name)
        return _lora_reply(True, "", hooks.loaded())


def _lora_reply(success: bool, message: str, loaded: dict[str, str] | None) -> JSONResponse:
    """SGLang's `LoRAUpdateOutput`: 200 on success, else 400."""
    body = {"success": success, "error_message": message, "loaded_adapters": loaded}
    return JSONResponse(body, status_code=200 if success else 400)


async def _load(st: EngineState, req: UpdateWeightsFromDiskRequest) -> LoadReport:
    return await asyncio.wrap_future(
        st.runner.load_weights(req.model_path, req.weight_version, req.load_format)
    )
