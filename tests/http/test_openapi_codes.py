"""The OpenAPI document describes what the routes answer: every `$ref` resolves (the v2
infer body's `#/$defs/InferInput` did not), and every status code a route is seen to
answer below is among the route's documented responses."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.http.conftest import MODEL, Live, ModelFiles, start

LIMIT = 4096


@pytest.fixture(scope="module")
def small(model_files: ModelFiles) -> Iterator[Live]:
    yield from start(model_files, max_body_bytes=LIMIT)


@pytest.fixture(scope="module")
def locked(model_files: ModelFiles) -> Iterator[Live]:
    yield from start(model_files, token="s3cret", max_body_bytes=LIMIT)


def test_every_ref_resolves(small: Live) -> None:
    doc = small.client.get("/openapi.json").json()
    for ref in set(re.findall(r'"\$ref": "([^"]+)"', json.dumps(doc))):
        node: Any = doc
        assert ref.startswith("#/"), ref
        for part in ref[2:].split("/"):
            assert part in node, f"{ref} does not resolve"
            node = node[part]
    infer = doc["paths"]["/v2/models/{model}/infer"]["post"]["requestBody"]
    schema = infer["content"]["application/json"]["schema"]
    assert "KEYS" in json.dumps(schema) or "inputs" in schema["properties"]


BIG = b"x" * (LIMIT + 1)
JSON_HEADERS = {"Content-Type": "application/json"}
#: (method, documented path, path, request options) of requests answered with errors
CASES: list[tuple[str, str, str, dict[str, Any]]] = [
    ("GET", "/healthz", "/healthz", {"content": BIG}),
    ("GET", "/readyz", "/readyz", {"content": BIG}),
    ("GET", "/metrics", "/metrics", {"content": BIG}),
    ("GET", "/v1/models", "/v1/models", {"content": BIG}),
    ("GET", "/v1/models/{model}", "/v1/models/nope", {}),
    ("POST", "/v1/models", "/v1/models", {"content": BIG, "headers": JSON_HEADERS}),
    ("POST", "/v1/models", "/v1/models", {"content": b"{}", "headers": {
        "Content-Type": "text/plain"}}),
    ("POST", "/v1/models", "/v1/models", {"json": {"model": "x"}}),
    ("POST", "/v1/models", "/v1/models", {"json": {"model": "x"}, "headers": {
        "Origin": "http://localhost:3000"}}),
    ("DELETE", "/v1/models/{model}", "/v1/models/nope", {}),
    ("POST", "/v1/models/{model}/reload", f"/v1/models/{MODEL}/reload",
     {"json": {"sparse_files": ["/nowhere/a", "/nowhere/b"]}}),
    ("POST", "/v1/models/{model}/reload", "/v1/models/nope/reload", {}),
    ("POST", "/v1/models/{model}/tables/{table}/lookup", f"/v1/models/{MODEL}/tables/9/lookup",
     {"content": b"\0" * 8, "headers": {"Content-Type": "application/octet-stream"}}),
    ("POST", "/v1/models/{model}/tables/{table}/lookup", f"/v1/models/{MODEL}/tables/0/lookup",
     {"content": b"\0" * 7, "headers": {"Content-Type": "application/octet-stream"}}),
    ("POST", "/v1/models/{model}/tables/{table}/lookup", f"/v1/models/{MODEL}/tables/0/lookup",
     {"content": b"\0" * 8, "headers": {"Content-Type": "text/plain"}}),
    ("POST", "/v1/models/{model}/tables/{table}/lookup", f"/v1/models/{MODEL}/tables/0/lookup",
     {"content": b"\0" * 8, "headers": {"Content-Type": "application/octet-stream",
                                        "X-HPS-Deadline-Ms": "0"}}),
    ("GET", "/v2", "/v2", {"content": BIG}),
    ("GET", "/v2/health/live", "/v2/health/live", {"content": BIG}),
    ("GET", "/v2/models/{model}", "/v2/models/nope", {}),
    ("GET", "/v2/models/{model}/ready", "/v2/models/nope/ready", {}),
    ("GET", "/v2/models/{model}/config", "/v2/models/nope/config", {}),
    ("GET", "/v2/models/{model}/versions/{version}", f"/v2/models/{MODEL}/versions/2", {}),
    ("POST", "/v2/models/{model}/infer", f"/v2/models/{MODEL}/infer", {"content": b"{"}),
    ("POST", "/v2/models/{model}/infer", f"/v2/models/{MODEL}/infer", {"content": BIG * 300,
                                                                       "headers": {
        "Inference-Header-Content-Length": "2"}}),
    ("POST", "/v2/models/{model}/infer", f"/v2/models/{MODEL}/infer", {
        "content": b"{}", "headers": {"Content-Encoding": "gzip"}}),
    ("POST", "/v2/models/{model}/infer", "/v2/models/nope/infer", {"content": b"{}"}),
]


@pytest.mark.parametrize(("method", "documented", "path", "options"), CASES)
def test_answered_codes_are_documented(small: Live, locked: Live, method: str,
                                       documented: str, path: str,
                                       options: dict[str, Any]) -> None:
    doc = small.client.get("/openapi.json").json()
    codes = set(doc["paths"][documented][method.lower()]["responses"])
    for live in (small, locked):
        answer: httpx.Response = live.client.request(method, path, **options)
        assert answer.status_code >= 400, (path, answer.text)
        assert str(answer.status_code) in codes, (live.url, method, path,
                                                  answer.status_code, answer.text)


# -- the document and the server agree -----------------------------------------------------


def _methods(doc: dict[str, Any], path: str) -> set[str]:
    return {m.upper() for m in doc["paths"][path]}


def test_a_405_allows_every_method_of_its_path(small: Live) -> None:
    """`Allow` lists the methods the path has, as the document does: it named only the
    first route's (`GET` at /v1/models/{model}, whose DELETE is another route)."""
    doc = small.client.get("/openapi.json").json()
    values = {"model": MODEL, "table": "0", "version": "1", "job": "j1"}
    for template in doc["paths"]:
        path = re.sub(r"\{(\w+)\}", lambda m: values[m.group(1)], template)
        answer = small.client.options(path)
        assert answer.status_code == 405, (path, answer.text)
        allowed = {m.strip() for m in answer.headers["allow"].split(",")}
        assert allowed - {"HEAD"} == _methods(doc, template), (path, allowed)
    assert small.client.options(f"/v1/models/{MODEL}").headers["allow"] == "DELETE, GET"


def _schema_admits(doc: dict[str, Any], path: str, body: Any) -> bool:
    """Whether the document's JSON request schema of POST `path` admits `body`."""
    from jsonschema import Draft202012Validator

    content = doc["paths"][path]["post"]["requestBody"]["content"]
    schema = {**content["application/json"]["schema"], "components": doc["components"]}
    return Draft202012Validator(schema).is_valid(body)


#: (documented path, path, JSON body) whose acceptance the document and the server must
#: agree on: they did not on the null model block, the null table with keys, keys with
#: from, and empty inputs (the schema admitted them), nor on `false` as a table or a top
#: (the server took them as 0 and 1)
BODIES: list[tuple[str, str, Any]] = [
    ("/v1/models", "/v1/models", None),
    ("/v1/models", "/v1/models", {}),  # the document admitted it: no key was required
    ("/v1/models/{model}/prefetch", f"/v1/models/{MODEL}/prefetch", {"keys": [1], "table": None}),
    ("/v1/models/{model}/prefetch", f"/v1/models/{MODEL}/prefetch", {"keys": [1], "table": False}),
    ("/v1/models/{model}/prefetch", f"/v1/models/{MODEL}/prefetch",
     {"from": "hot-set", "table": None}),
    ("/v1/models/{model}/prefetch", f"/v1/models/{MODEL}/prefetch",
     {"keys": [1], "table": 0, "from": None}),
    ("/v1/models/{model}/prefetch", f"/v1/models/{MODEL}/prefetch", {"from": "hot-set",
                                                                    "keys": [1]}),
    ("/v1/models/{model}/prefetch", f"/v1/models/{MODEL}/prefetch", {"from": "hot-set",
                                                                    "top": True}),
    ("/v1/models/{model}/reload", f"/v1/models/{MODEL}/reload", None),
    ("/v2/models/{model}/infer", f"/v2/models/{MODEL}/infer", {"inputs": []}),
]


@pytest.mark.parametrize(("documented", "path", "body"), BODIES)
def test_the_document_admits_what_the_server_takes(small: Live, documented: str, path: str,
                                                   body: Any) -> None:
    doc = small.client.get("/openapi.json").json()
    answer = small.client.post(path, content=json.dumps(body).encode(),
                               headers=JSON_HEADERS)
    assert answer.status_code < 500, answer.text
    assert _schema_admits(doc, documented, body) == (answer.status_code < 300), (
        answer.status_code, answer.text)


def test_the_document_and_the_server_agree_on_model_blocks(small: Live) -> None:
    """`POST /v1/models`: the blocks the document refuses (a required key left out, a
    device list left out of a model with GPU caches, a key no block has, a width written
    as a string) are the blocks the server answers 422 `config`; the blocks it admits are
    added (201), a device list left out of a model without GPU caches among them."""
    doc = small.client.get("/openapi.json").json()
    block = {**small.model.config["models"][0], "model": "added"}
    assert block["gpucache"] is False
    schema = doc["paths"]["/v1/models"]["post"]["requestBody"]["content"][
        "application/json"]["schema"]
    assert set(schema["required"]) == {"model", "sparse_files", "embedding_vecsize_per_table",
                                       "maxnum_catfeature_query_per_table_per_sample"}
    no_devices = {k: v for k, v in block.items() if k != "deployed_device_list"}
    refused = [{}, {"model": "added"}, {**block, "no_such_key": 1},
               {**block, "embedding_vecsize_per_table": ["8", "64"]},
               {**no_devices, "gpucache": True}, {**no_devices, "gpucache": None}]
    refused += [{k: v for k, v in block.items() if k != key} for key in schema["required"]]
    for body in refused:
        assert not _schema_admits(doc, "/v1/models", body), body
        answer = small.client.post("/v1/models", json=body)
        assert answer.status_code == 422, (body, answer.text)
        assert answer.json()["error"]["kind"] == "config", answer.text
    for body in (block, no_devices):
        assert _schema_admits(doc, "/v1/models", body), body
        added = small.client.post("/v1/models", json=body)
        assert added.status_code == 201, added.text
        assert small.client.delete("/v1/models/added").status_code == 200


def test_authorization_is_declared_where_a_token_is_set(small: Live, locked: Live) -> None:
    """Without a token no route reads Authorization (a loopback server serves the admin
    routes without one): the document asks for none. With one, every route but health
    and the docs declares it."""
    open_doc = small.client.get("/openapi.json").json()
    assert not any(op.get("security") for ops in open_doc["paths"].values()
                   for op in ops.values())
    assert small.client.post(f"/v1/models/{MODEL}/reload").status_code == 200
    locked_doc = locked.client.get("/openapi.json").json()
    for path, operations in locked_doc["paths"].items():
        for method, operation in operations.items():
            guarded = not (path in ("/healthz", "/readyz") or path.startswith("/v2/health"))
            assert bool(operation.get("security")) == guarded, (method, path)
