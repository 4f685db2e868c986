"""Schemathesis against the app's own OpenAPI schema, from one process or from
`hps serve --workers 2`: nothing a client sends gets a 5xx, and the server answers as the
document says.

Positive and negative cases of every operation (both lookup body forms among them) are
sent over the socket to the live server, each checked by every check schemathesis runs
by default: no 5xx; status codes, content types, headers and bodies as documented; what
the schema refuses is refused; a required header left out is refused; a method a path
lacks is a 405 whose `Allow` lists the path's methods; routes that declare the token
enforce it. Examples are bounded so the run stays within seconds.
"""

from __future__ import annotations

from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from jsonschema import Draft202012Validator
from jsonschema.validators import extend
from schemathesis.checks import positive_data_acceptance

from tests.http.conftest import MODEL, TABLE_NAMES, Live

MAX_EXAMPLES = 40
#: table path parameters the cases get: names, indexes, and one the model lacks
TABLES = [*TABLE_NAMES, "0", "1", "no_such_table"]


@pytest.fixture(params=["live", "live_workers"], ids=["one process", "2 workers"])
def api_schema(request: pytest.FixtureRequest) -> schemathesis.BaseSchema:
    """The schema of the app served by one process, then by `hps serve --workers 2`
    (each case is answered by either worker; the admin routes go through the op log)."""
    live: Live = request.getfixturevalue(request.param)
    loaded = schemathesis.openapi.from_url(f"{live.url}/openapi.json")
    loaded.config.generation.update(max_examples=MAX_EXAMPLES, deterministic=False)
    return loaded


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_server_errors(case: schemathesis.Case) -> None:
    # Generated names almost never name the served model: point the cases at it so that
    # the bodies, not only the 404 of an unknown model, are what gets fuzzed.
    # (A DELETE keeps its generated name: removing the served model would leave every
    # later case a 404.)
    params = case.path_parameters
    if params and "model" in params and case.method != "DELETE":
        params["model"] = MODEL
    if params and "table" in params:
        params["table"] = TABLES[len(str(params["table"])) % len(TABLES)]
    response = case.call()
    case.validate_response(response, excluded_checks=[positive_data_acceptance])
    accepted_as_the_schema_says(case, response)


#: what a request the schema accepts may still be refused for, per operation: what JSON
#: Schema cannot say (the files a model block or a reload names and what they hold, the
#: binary body's length in keys of its dtype, the model's batch limit, a v2 tensor's shape
#: against its data). A refusal of anything else (`bad_request`, `bad_json`: the shape of
#: the request) is the document and the server disagreeing.
BEYOND_THE_SCHEMA: dict[tuple[str, str], frozenset[str]] = {
    ("POST", "/v1/models"): frozenset({"config", "model_file", "source", "source_unreachable",
                                       "load_gate"}),
    ("POST", "/v1/models/{model}/reload"): frozenset({"config", "model_file", "source",
                                                      "source_unreachable"}),
    ("POST", "/v1/models/{model}/tables/{table}/lookup"): frozenset({"bad_body",
                                                                   "batch_too_large"}),
}
#: the v2 infer route's answers name no kind (`{"error": message}`): its 400 and 413 are
#: of the tensors' contents (shape against data, binary sizes, NUMKEYS against KEYS)
V2_BEYOND_THE_SCHEMA = frozenset({400, 413})


def accepted_as_the_schema_says(case: schemathesis.Case, response: Any) -> None:
    """schemathesis' positive_data_acceptance, less what BEYOND_THE_SCHEMA names; a JSON
    body is positive when an exact validator says so (the generator compares integers as
    floats: 2**63 + 191 passed for the int64 maximum 2**63 - 1)."""
    meta = case.meta
    if meta is None or not meta.generation.mode.is_positive or response.status_code in {
            401, 403, 404, 409, 429} or response.status_code < 400:
        return
    if not _valid_json_body(case):
        return
    where = (case.method.upper(), case.operation.path)
    if where[1].startswith("/v2/") and where[1].endswith("/infer"):
        assert response.status_code in V2_BEYOND_THE_SCHEMA, (where, response.text)
        return
    kind = response.json()["error"]["kind"]
    assert kind in BEYOND_THE_SCHEMA.get(where, frozenset()), (where, case.body,
                                                               response.text)


def _valid_json_body(case: schemathesis.Case) -> bool:
    """Whether the case's body, when JSON, is valid for its operation's schema, its
    integers compared exactly (jsonschema; the document's $refs resolve in it)."""
    if case.media_type != "application/json" or case.body is None:
        return True
    document = case.operation.schema.raw_schema
    operation = document["paths"][case.operation.path][case.method.lower()]
    schema = operation["requestBody"]["content"]["application/json"]["schema"]
    validator = _EXACT({**schema, "components": document.get("components", {})})
    return validator.is_valid(case.body)


#: JSON Schema's `integer` admits 1.0; the server reads keys and counts as written, and
#: refuses a number written with a fraction (docs/http.md): integers are Python ints here
_EXACT = extend(Draft202012Validator, type_checker=Draft202012Validator.TYPE_CHECKER.redefine(
    "integer", lambda _, value: isinstance(value, int) and not isinstance(value, bool)))
