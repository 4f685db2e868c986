"""Direct answers (hps/http/direct.py): lookups answered by the HTTP protocol itself say
exactly what the ASGI path says, keep a connection's order, and hand a request to the
ASGI path whenever it needs one. Raw sockets to a real uvicorn server."""

from __future__ import annotations

import json
import time

import numpy as np

from tests.http.conftest import MODEL, Live
from tests.support.raw_http import ResponseReader, connect, raw_request

LOOKUP = f"/v1/models/{MODEL}/tables/items/lookup"
LOOKUP_ROUTE = "/v1/models/{model}/tables/{table}/lookup"


def _keys(live: Live, rng: np.random.Generator) -> tuple[bytes, np.ndarray]:
    keys = live.model.sample_keys(rng, 1, 37, unknown=3)  # 40 keys, 3 unknown
    return keys.astype("<i8").tobytes(), live.model.expected(1, keys)


def test_direct_and_asgi_answers_are_the_same(live: Live, rng: np.random.Generator) -> None:
    """The same requests, once with a Content-Length (answered directly) and once chunked
    (answered by the ASGI path), get the same status, headers and body: lookups, a v2
    infer, and errors of each protocol."""
    body, expected = _keys(live, rng)
    infer_head = json.dumps({"inputs": [
        {"name": "KEYS", "shape": [40], "datatype": "INT64",
         "parameters": {"binary_data_size": len(body)}},
        {"name": "NUMKEYS", "shape": [2], "datatype": "INT32",
         "parameters": {"binary_data_size": 8}}],
        "parameters": {"binary_data_output": True}}).encode()
    infer = infer_head + body + np.array([0, 40], "<i4").tobytes()
    cases = [
        (LOOKUP, body, None),
        (f"/v1/models/{MODEL}/tables/nope/lookup", body, None),  # 404
        (LOOKUP, body[:-1], None),  # 400: not whole keys
        (LOOKUP, body, {"Content-Type": "text/plain"}),  # 415
        (f"/v2/models/{MODEL}/infer", infer,
         {"Inference-Header-Content-Length": str(len(infer_head))}),
        (f"/v2/models/{MODEL}/infer", infer[:-4],
         {"Inference-Header-Content-Length": str(len(infer_head))}),  # 400, v2's form
    ]
    sock = connect(live.url)
    reader = ResponseReader(sock)
    statuses: list[int] = []
    for path, payload, headers in cases:
        direct_before = live.app.hot_routes.answered_directly
        sock.sendall(raw_request(path, payload, headers))
        direct = reader.response()
        assert live.app.hot_routes.answered_directly == direct_before + 1, path
        sock.sendall(raw_request(path, payload, headers, chunked=True))
        asgi = reader.response()
        assert live.app.hot_routes.answered_directly == direct_before + 1, path
        assert direct[0] == asgi[0] and direct[2] == asgi[2], (path, direct, asgi)
        statuses.append(direct[0])
        without_date = [{k: v for k, v in a[1].items() if k != "date"} for a in (direct, asgi)]
        assert without_date[0] == without_date[1], path
    sock.close()
    assert statuses == [200, 404, 400, 415, 200, 400]
    sock = connect(live.url)  # the first case's answer holds the vectors due
    sock.sendall(raw_request(LOOKUP, body))
    status, headers, answer = ResponseReader(sock).response()
    sock.close()
    assert status == 200 and headers["x-hps-keys"] == "40"
    np.testing.assert_array_equal(np.frombuffer(answer, "<f4").reshape(40, -1), expected)


def test_pipelined_requests_are_answered_in_order(live: Live, rng: np.random.Generator
                                                  ) -> None:
    """Requests sent back to back in one write are answered one after another, in their
    order, whether answered directly or by the ASGI path (a chunked one in the middle)."""
    bodies = [_keys(live, rng) for _ in range(4)]
    sock = connect(live.url)
    sock.sendall(raw_request(LOOKUP, bodies[0][0])
                 + raw_request(LOOKUP, bodies[1][0], chunked=True)
                 + raw_request(LOOKUP, bodies[2][0])
                 + raw_request(f"/v1/models/{MODEL}/tables/nope/lookup", bodies[3][0]))
    reader = ResponseReader(sock)
    for _, expected in bodies[:3]:
        status, _, answer = reader.response()
        assert status == 200
        np.testing.assert_array_equal(np.frombuffer(answer, "<f4").reshape(40, -1), expected)
    status, _, answer = reader.response()
    assert status == 404 and "nope" in json.loads(answer)["error"]["message"]
    sock.close()


def test_a_body_in_parts_and_closing_requests(live: Live, rng: np.random.Generator) -> None:
    """A request whose headers and body come in several reads is answered directly once
    the last part is in; `Connection: close` and HTTP/1.0 requests are answered and the
    connection closed."""
    body, expected = _keys(live, rng)
    sock = connect(live.url)
    request = raw_request(LOOKUP, body)
    direct_before = live.app.hot_routes.answered_directly
    for part in (request[:-len(body)], request[-len(body):-100], request[-100:]):
        sock.sendall(part)  # headers, then the body in two parts
        time.sleep(0.1)  # each read alone
    status, _, answer = ResponseReader(sock).response()
    assert status == 200 and live.app.hot_routes.answered_directly == direct_before + 1
    np.testing.assert_array_equal(np.frombuffer(answer, "<f4").reshape(40, -1), expected)
    sock.close()

    for request in (raw_request(LOOKUP, body, {"Content-Type": "application/octet-stream",
                                            "Connection": "close"}),
                    raw_request(LOOKUP, body, version="1.0")):
        sock = connect(live.url)
        sock.sendall(request)
        reader = ResponseReader(sock)
        status, headers, answer = reader.response()
        assert status == 200 and headers["connection"] == "close"
        np.testing.assert_array_equal(np.frombuffer(answer, "<f4").reshape(40, -1),
                                      expected)
        assert reader.closed()
        sock.close()


def test_direct_answers_are_counted(live: Live, rng: np.random.Generator) -> None:
    """Direct answers count in the request metrics by route and status."""
    body, _ = _keys(live, rng)
    before = {code: live.metric("hps_http_requests_total", route=LOOKUP_ROUTE,
                                method="POST", code=code) for code in ("200", "404")}
    direct_before = live.app.hot_routes.answered_directly
    sock = connect(live.url)
    sock.sendall(raw_request(LOOKUP, body) * 3
                 + raw_request(f"/v1/models/{MODEL}/tables/nope/lookup", body))
    reader = ResponseReader(sock)
    assert [reader.response()[0] for _ in range(4)] == [200, 200, 200, 404]
    sock.close()
    assert live.app.hot_routes.answered_directly == direct_before + 4
    assert live.metric("hps_http_requests_total", route=LOOKUP_ROUTE, method="POST",
                       code="200") == before["200"] + 3
    assert live.metric("hps_http_requests_total", route=LOOKUP_ROUTE, method="POST",
                       code="404") == before["404"] + 1
