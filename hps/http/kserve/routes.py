"""The v2 routes as FastAPI declares them: server metadata, health, model metadata,
readiness and configuration, and infer (whose requests `hot_routes.HotRoutes` answers
ahead of FastAPI; its declaration describes it to OpenAPI and labels its metrics)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request, Response

from hps.errors import UnknownModelError
from hps.http.errors import v2_error_body
from hps.http.hot_routes import HotRoutes
from hps.http.kserve.infer import handle_infer
from hps.http.kserve.schemas import (
    INFER_ERRORS,
    INFER_OPENAPI,
    V2_ERRORS,
    check_version,
    model_config,
    model_metadata,
)
from hps.http.workers_versions import lags_message

if TYPE_CHECKING:
    from hps.http.state import ServiceState


_v2_not_ready = {"description": "The model is loading, its load failed, or (--workers N) a "
                 "worker serves another version of it than the server's (why, in the "
                 "body)."}


def build_v2_router(state: ServiceState, protected: list[Any]) -> APIRouter:
    """The v2 routes of one app; `protected` are the token's dependencies."""
    router = APIRouter(prefix="/v2", tags=["kserve-v2"])

    def not_ready(message: str) -> Response:
        # the protocol's "false" is a 4xx; 400 as Triton answers
        return state.answer(400, "not_ready", message, body=v2_error_body)

    @router.get("", dependencies=protected, summary="Server metadata",
                responses={k: V2_ERRORS[k] for k in (401, 413)})
    async def server_metadata() -> dict[str, Any]:
        from hps import __version__

        return {"name": "hps", "version": __version__,
                "extensions": ["binary_tensor_data", "model_configuration", "statistics"]}

    @router.get("/health/live", summary="Alive (answers while models load)",
                responses={413: V2_ERRORS[413]})
    async def live() -> dict[str, bool]:
        return {"live": True}

    @router.get("/health/ready", summary="Ready: every model of the config is loaded",
                responses={400: {"description": "Not every model is loaded, or (--workers "
                                 "N) a worker serves another version than the server's."},
                           413: V2_ERRORS[413]})
    async def ready() -> Any:
        pending, failed, all_loaded = state.readiness(sorted(state.server.models))
        if all_loaded:
            lags = state.version_lags()  # --workers N: each serves the server's versions
            return not_ready(f"not every worker serves the server's version: "
                             f"{lags_message(lags)}") if lags else {"ready": True}
        return not_ready(f"models not loaded yet: {', '.join(pending) or '-'}"
                         + (f"; failed: {', '.join(failed)}" if failed else ""))

    async def metadata(model: str, version: str | None = None) -> dict[str, Any]:
        check_version(model, version)
        state.model(model)
        return model_metadata(model)

    async def model_ready(model: str, version: str | None = None) -> Any:
        check_version(model, version)
        try:
            state.model(model)
        except UnknownModelError:
            raise
        except Exception as exc:  # loading or failed: "not ready", the reason in the body
            return not_ready(str(exc))
        lags = state.version_lags(model)
        if lags:  # a worker serves another version of it (--workers N)
            return not_ready(lags_message(lags))
        return {"name": model, "ready": True}

    async def config(model: str, version: str | None = None) -> dict[str, Any]:
        check_version(model, version)
        state.model(model)
        return model_config(model)

    async def infer(request: Request, model: str, version: str | None = None) -> Response:
        """Inference: KEYS (INT64) and NUMKEYS (INT32) → OUTPUT0 (FP32), JSON or binary."""
        return await HotRoutes.respond(handle_infer, state, request,
                                       {"model": model, "version": version})

    async def statistics(model: str = "", version: str = "") -> dict[str, Any]:
        """The statistics extension: inference requests that succeeded and failed, with
        their cumulative ns, of one model (or of every served model)."""
        return {"model_stats": state.metrics.infer_stats.model_stats(
            list(state.server.models), model, version)}

    # before /models/{model}: "stats" is this route's, not a model's name
    router.add_api_route("/models/stats", statistics, methods=["GET"], dependencies=protected,
                         summary="Statistics of every served model", responses=V2_ERRORS)
    for base in ("/models/{model}", "/models/{model}/versions/{version}"):
        router.add_api_route(base + "/stats", statistics, methods=["GET"],
                             dependencies=protected, summary="Statistics of the model",
                             responses=V2_ERRORS)
        router.add_api_route(base, metadata, methods=["GET"], dependencies=protected,
                             summary="Model metadata: KEYS, NUMKEYS → OUTPUT0",
                             responses=V2_ERRORS)
        router.add_api_route(base + "/ready", model_ready, methods=["GET"],
                             dependencies=protected, summary="Model ready (200) or not (400)",
                             responses={**V2_ERRORS, 400: _v2_not_ready})
        router.add_api_route(base + "/config", config, methods=["GET"],
                             dependencies=protected, summary="Triton model configuration",
                             responses=V2_ERRORS)
        router.add_api_route(base + "/infer", infer, methods=["POST"], dependencies=protected,
                             summary="Inference (JSON or binary tensor data)",
                             response_class=Response, openapi_extra=INFER_OPENAPI,
                             responses=INFER_ERRORS)
    return router
