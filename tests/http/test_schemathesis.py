"""Schemathesis against the app's own OpenAPI schema: nothing a client sends gets a 5xx,
from one process or from `hps serve --workers 2`.

Positive and negative cases of every operation (both lookup body forms among them) are
sent over the socket to the live server; the check is `not_a_server_error`. Examples
are bounded so the run stays within a few seconds.
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

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
    params = case.path_parameters
    if params and "model" in params:
        params["model"] = MODEL
    if params and "table" in params:
        params["table"] = TABLES[len(str(params["table"])) % len(TABLES)]
    case.call_and_validate(checks=[not_a_server_error])
