"""Models added and removed at runtime: `POST /v1/models`, `DELETE /v1/models/{model}`.

Both are admin routes (the token, or without one a loopback-bound server). A model is
added from one model block of ps.json, with absolute paths or URIs under the server's
allowed roots (`roots.py`); it loads while the other models keep serving and is visible
once complete. A removed model stops serving at once; its tables leave the tiers when
the last lookup reading them is done, and the memory goes back to the OS.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body
from starlette.concurrency import run_in_threadpool

from hps.config import ModelConfig, parse_model_block
from hps.errors import ModelExistsError
from hps.http.roots import check_absolute, check_sources
from hps.http.routes import admin_guard, load_summary
from hps.http.schemas import ERROR_RESPONSES, JSON, ErrorBody, ReloadResponse, inline_schema
from hps.http.state import ServiceState
from hps.modelfiles.confined import confined

_ADD_EXAMPLE = {
    "model": "ranking", "sparse_files": ["/srv/models/ranking/user", "/srv/models/ranking/item"],
    "embedding_table_names": ["user", "item"], "embedding_vecsize_per_table": [16, 64],
    "maxnum_catfeature_query_per_table_per_sample": [1, 8], "deployed_device_list": [0],
    "max_batch_size": 1024, "gpucache": False,
}


#: the body as `parse_model_block` reads it: a model block's keys, those it requires named,
#: no other key (the document said any object, so `{}` was valid by it and answered 422).
#: The route still takes a dict: the block's errors are the config's, with its hints.
_ADD_BODY = {"requestBody": {"content": {JSON: {"schema": {
    **inline_schema(ModelConfig), "additionalProperties": False,
    "title": "ModelBlock", "description": "One entry of ps.json's `models`."}}}}}


def _error(description: str) -> dict[str, Any]:
    return {"model": ErrorBody, "description": description}


def build_admin_router(state: ServiceState) -> APIRouter:
    """The routes that add and remove models, bound to `state`."""
    router = APIRouter(tags=["admin"])
    admin = admin_guard(state)

    @router.post("/v1/models", status_code=201, response_model=ReloadResponse,
                 dependencies=admin, summary="Add a model (a model block of ps.json)",
                 openapi_extra=_ADD_BODY,
                 responses={**ERROR_RESPONSES,
                            403: _error("Admin routes need a token unless the server is bound "
                                        "to loopback; or a source is outside the allowed "
                                        "roots."),
                            404: _error("A source does not exist."),
                            409: _error("A model of that name is served or loading."),
                            415: _error("A body that is not application/json."),
                            422: _error("Not a valid model block, the files are not a "
                                        "valid model, or the load gate refused them "
                                        "(kind load_gate: the error names the table, "
                                        "check, figure and limit)."),
                            507: _error("The disk of the persistent tier is full: the "
                                        "message names the file and the bytes not "
                                        "written; nothing of the model is kept.")})
    async def add_model(block: Annotated[dict[str, Any], Body(examples=[_ADD_EXAMPLE])]
                        ) -> dict[str, Any]:
        """Load a new model while the others keep serving; answers once it serves.

        The body is one entry of ps.json's `models` (a JSON object: `null` or a list is
        a 422, as the document says); `sparse_files` are absolute paths or URIs under the
        server's allowed roots (`hps serve --allow-root`).
        """
        model = parse_model_block(block)
        check_absolute(model.sparse_files)
        check_sources(model.sparse_files, state.allowed_roots)
        if model.model in state.server.models or model.model in state.configured():
            raise ModelExistsError(f"model {model.model!r} is already served or loading: reload "
                              f"it (POST /v1/models/{model.model}/reload) or remove it first")
        return load_summary(await run_in_threadpool(confined, state.allowed_roots,
                                                    state.add, model))

    @router.delete("/v1/models/{model}", dependencies=admin,
                   summary="Remove a model; the others keep serving",
                   responses={**ERROR_RESPONSES,
                              403: _error("Admin routes need a token unless the server is "
                                          "bound to loopback."),
                              404: _error("Unknown model."),
                              415: _error("A body that is not application/json."),
                              503: _error("The model is still loading.")})
    async def remove_model(model: str) -> dict[str, Any]:
        """Stop serving a model. Lookups already running finish; its tables leave the
        tiers and its memory is returned when the last of them is done."""
        state.model(model)  # 404, or 503 while it loads
        await run_in_threadpool(state.remove, model)
        return {"model": model, "removed": True}

    return router
