"""Hostile and careless clients: every input a client controls ends in a 4xx
with a JSON body, never a 5xx; admin routes accept only the server's own names, JSON
bodies and sources under the allowed roots. Real uvicorn over a socket, httpx clients."""

from __future__ import annotations

import copy
import socket
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.http.conftest import (
    DIMS,
    MODEL,
    TABLE_NAMES,
    Live,
    ModelFiles,
    serving,
    start,
    write_model,
)
from tests.support.raw_http import ResponseReader, connect, raw_request


def with_http(model: ModelFiles, **http: Any) -> ModelFiles:
    config = copy.deepcopy(model.config)
    config["http"] = http
    return replace(model, config=config)


@pytest.fixture
def own(tmp_path: Path) -> Iterator[Live]:
    """A server over a model of the test's own, in tmp_path/srv/v1 (the default root:
    tmp_path/srv); reloads may also read under tmp_path/shared (http.allowed_sources)."""
    model = with_http(write_model(tmp_path / "srv" / "v1", seed=3),
                      allowed_sources=[str(tmp_path / "shared")])
    yield from start(model)


def reload(live: Live, files: list[str] | None = None, **kw: Any) -> httpx.Response:
    body = {"json": {"sparse_files": files}} if files is not None else {}
    return live.client.post(f"/v1/models/{MODEL}/reload", **body, **kw)


def assert_error(answer: httpx.Response, status: int, kind: str) -> None:
    assert answer.status_code == status, answer.text
    assert answer.headers["content-type"].startswith("application/json")
    assert answer.json()["error"]["kind"] == kind


# -- table names and keys -------------------------------------------------------------------


@pytest.mark.parametrize("table", ["²", "١", "0²", "1.0", "-1", "+1", " 1", "9" * 30])
def test_table_names_are_ascii_digits_or_names(live: Live, table: str) -> None:
    """'²' is a digit to str.isdigit (int() then raised: a 500), '١' is 1 to int()
    (it silently picked table 1): both are unknown tables now."""
    assert_error(live.lookup_binary(table, np.arange(3)), 404, "unknown_table")
    assert_error(live.lookup_json(table, np.arange(3)), 404, "unknown_table")


def test_python_keys_beyond_int64_are_refused(live: Live) -> None:
    from hps import KeyTypeError

    for keys in ([2**63], [-(2**63) - 1], [1, 2**64], [-1, 2**63]):
        with pytest.raises(KeyTypeError, match="int64 range"):
            live.server.lookup(MODEL, 0, keys)
    body = b'{"keys": [9223372036854775808]}'
    answer = live.client.post(f"/v1/models/{MODEL}/tables/0/lookup", content=body,
                              headers={"Content-Type": "application/json"})
    assert_error(answer, 400, "bad_json")


def test_json_body_larger_than_the_key_limit_is_refused_before_parsing(live: Live) -> None:
    """16 MiB of JSON keys was parsed whole (≈ 410 MB of Python objects) before the key
    limit was checked; now its Content-Length refuses it, and a chunked one is cut off
    at the table's limit."""
    body = b'{"keys": [' + b"1," * (8 << 20 - 1) + b"1]}"
    answer = live.client.post(f"/v1/models/{MODEL}/tables/0/lookup", content=body,
                              headers={"Content-Type": "application/json"})
    assert_error(answer, 413, "batch_too_large")

    def chunks() -> Iterator[bytes]:
        yield b'{"keys": ['
        for _ in range(64):
            yield b"1," * 8192
        yield b"1]}"

    answer = live.client.post(f"/v1/models/{MODEL}/tables/0/lookup", content=chunks(),
                              headers={"Content-Type": "application/json"})
    assert_error(answer, 413, "body_too_large")


def test_head_healthz(live: Live) -> None:
    assert live.client.head("/healthz").status_code == 200


# -- reload inputs ----------------------------------------------------------------------------


@pytest.mark.parametrize(("files", "status", "kind"), [
    (["/tmp/a\x00b", "/tmp/c"], 422, "config"),  # NUL: was a 500 (ValueError)
    (["/tmp/a\nb", "/tmp/c"], 422, "config"),
    (["file://relative/x", "file://relative/y"], 422, "config"),  # bypassed the checks
    (["relative/a", "relative/b"], 422, "config"),
    (["", ""], 422, "config"),  # an empty path: was a 500 (ValueError; schemathesis)
])
def test_malformed_reload_paths(own: Live, files: list[str], status: int, kind: str) -> None:
    assert_error(reload(own, files), status, kind)
    assert own.client.get("/readyz").status_code == 200


def test_reload_reads_only_under_allowed_roots(own: Live, tmp_path: Path) -> None:
    """By default a reload reads only under the folder holding the models' folders;
    others must be in http.allowed_sources. Checked after `..` and symbolic links are
    resolved."""
    elsewhere = write_model(tmp_path / "elsewhere", seed=4)
    outside = [str(elsewhere.dir / t) for t in TABLE_NAMES]
    assert_error(reload(own, outside), 403, "forbidden")
    sneaky = [str(own.model.dir / ".." / ".." / "elsewhere" / t) for t in TABLE_NAMES]
    assert_error(reload(own, sneaky), 403, "forbidden")
    (own.model.dir / "link").symlink_to(elsewhere.dir)
    linked = [str(own.model.dir / "link" / t) for t in TABLE_NAMES]
    assert_error(reload(own, linked), 403, "forbidden")
    shared = write_model(tmp_path / "shared" / "v2", seed=5)
    answer = reload(own, [str(shared.dir / t) for t in TABLE_NAMES])
    assert answer.status_code == 200, answer.text


def test_reload_never_contacts_a_host_outside_the_roots(own: Live) -> None:
    """The reload route fetched any hdfs/webhdfs URL it was given (a request forgery):
    a source outside the roots is refused before any connection is made."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        listener.settimeout(0.5)
        port = listener.getsockname()[1]
        files = [f"webhdfs://127.0.0.1:{port}/secret/{t}" for t in TABLE_NAMES]
        assert_error(reload(own, files), 403, "forbidden")
        with pytest.raises(TimeoutError):
            listener.accept()


def test_unreachable_s3_source_ends_in_a_json_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An S3 endpoint that accepts connections and never answers: the reload ends in a
    4xx JSON error after the configured source timeouts, the model keeps serving."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    with socket.socket() as blackhole:
        blackhole.bind(("127.0.0.1", 0))
        blackhole.listen(64)
        model = write_model(tmp_path / "v1", seed=6)
        config = copy.deepcopy(model.config)
        config.update(s3_endpoint=f"http://127.0.0.1:{blackhole.getsockname()[1]}",
                      source_connect_timeout=0.5, source_read_timeout=0.5,
                      http={"allowed_sources": ["s3://models/"]})
        with serving(replace(model, config=config)) as live:
            answer = reload(live, [f"s3://models/m/{t}" for t in TABLE_NAMES])
            assert 400 <= answer.status_code < 500, answer.text
            assert answer.json()["error"]["kind"].startswith("source")
            keys = live.model.keys[0][:5]
            assert live.lookup_binary(0, keys).status_code == 200


# -- admin requests ---------------------------------------------------------------------------


def test_admin_refuses_foreign_hosts_and_origins(own: Live) -> None:
    """DNS rebinding sends Host: evil.example to a loopback server; a cross-site form
    sends an Origin; neither reaches an admin route. Lookups are not admin routes."""
    assert_error(reload(own, headers={"Host": "evil.example"}), 403, "host_not_allowed")
    assert_error(reload(own, headers={"Host": "evil.example:8000"}), 403, "host_not_allowed")
    assert_error(reload(own, headers={"Origin": "http://evil.example"}), 403,
                 "host_not_allowed")
    assert_error(reload(own, headers={"Origin": "null"}), 403, "host_not_allowed")
    for host in ("127.0.0.1", "localhost:1234", "[::1]:80"):
        assert reload(own, headers={"Host": host}).status_code == 200
    assert reload(own, headers={"Origin": own.url}).status_code == 200


#: the Host a page sends after its DNS name was rebound to 127.0.0.1
REBOUND = "rebind.attacker.example"
#: (method, path, request options) of a request of every kind of route that reads
READS: list[tuple[str, str, dict[str, Any]]] = [
    ("POST", f"/v1/models/{MODEL}/tables/0/lookup", {
        "content": np.arange(3, dtype="<i8").tobytes(),
        "headers": {"Content-Type": "application/octet-stream"}}),
    ("POST", f"/v1/models/{MODEL}/tables/users/lookup", {"json": {"keys": [1, 2]}}),
    ("POST", f"/v2/models/{MODEL}/infer", {"json": {"inputs": [
        {"name": "KEYS", "datatype": "INT64", "shape": [2], "data": [1, 2]},
        {"name": "NUMKEYS", "datatype": "INT32", "shape": [2], "data": [1, 1]}]}}),
    ("GET", f"/v1/models/{MODEL}/tables/users/hot-set", {}),
    ("GET", f"/v1/models/{MODEL}/tables/users/keys", {}),
    ("GET", "/metrics", {}),
    ("GET", "/v1/models", {}),
    ("GET", f"/v1/models/{MODEL}", {}),
    ("GET", f"/v2/models/{MODEL}", {}),
    ("GET", "/readyz", {}),
    ("GET", "/openapi.json", {}),
]


@pytest.mark.parametrize(("method", "path", "options"), READS,
                         ids=[f"{m} {p}" for m, p, _ in READS])
def test_a_loopback_server_without_a_token_answers_only_its_own_names(
        own: Live, method: str, path: str, options: dict[str, Any]) -> None:
    """DNS rebinding: a web page whose name now resolves to 127.0.0.1 read embeddings and
    model names through every route but the admin ones (200 to any Host). Every route
    answers only the server's names now; the loopback names and the test clients' own
    still get 200."""
    options = dict(options)
    headers = options.pop("headers", {})
    foreign = own.client.request(method, path, **options, headers={**headers, "Host": REBOUND})
    assert foreign.status_code == 403, foreign.text
    error = foreign.json()["error"]
    if not path.startswith("/v2/"):  # KServe's error body is the message alone
        assert error["kind"] == "host_not_allowed"
        error = error["message"]
    assert REBOUND in error
    port = own.url.rsplit(":", 1)[1]
    for host in (None, "127.0.0.1", f"localhost:{port}", f"[::1]:{port}"):
        extra = {} if host is None else {"Host": host}
        answer = own.client.request(method, path, **options, headers={**headers, **extra})
        assert answer.status_code == 200, (host, answer.text)


def test_lookups_answered_by_the_connection_check_the_host_too(own: Live) -> None:
    """A lookup whose whole body comes in one read is answered by the HTTP protocol
    itself (direct.py), not through FastAPI: the same Host rule."""
    path = f"/v1/models/{MODEL}/tables/0/lookup"
    body = np.asarray(own.model.keys[0][:4], "<i8").tobytes()
    with connect(own.url) as sock:
        reader = ResponseReader(sock)
        sock.sendall(raw_request(path, body, host=REBOUND))
        status, _, answer = reader.response()
        assert status == 403 and b"host_not_allowed" in answer
        sock.sendall(raw_request(path, body, host="localhost"))
        status, _, answer = reader.response()
        assert status == 200 and len(answer) == 4 * DIMS[0] * 4


def test_with_a_token_reads_answer_any_host(live_token: Live) -> None:
    """The token is what guards a server that has one (behind a proxy its Host is the
    proxy's name); the Host rule is for loopback servers without one."""
    answer = live_token.lookup_binary(0, live_token.model.keys[0][:2], headers={
        "Host": REBOUND, "Authorization": "Bearer s3cret"})
    assert answer.status_code == 200, answer.text


#: (the Host's bytes, how the error message shows it)
HOSTS = [("ünï.example".encode(), "'ünï.example'"),
         ("\u202eevil.example".encode(), "'\\u202eevil.example'"),  # a bidi override
         (b"bad\xff.example", "'bad\\xff.example'")]  # not UTF-8


@pytest.mark.parametrize(("sent", "shown"), HOSTS, ids=["utf-8", "bidi", "not utf-8"])
def test_a_non_ascii_host_is_echoed_escaped_not_garbled(own: Live, sent: bytes,
                                                        shown: str) -> None:
    """Header bytes arrive decoded as Latin-1: a UTF-8 Host came back as mojibake
    ('Ã¼nÃ¯.example'). It is shown as sent now, and what cannot be shown as it is
    (bytes that are not UTF-8, a character that is not printable) escaped."""
    for answer in (reload(own, headers={"Host": sent}),
                   own.client.get("/v1/models", headers={"Host": sent})):
        assert_error(answer, 403, "host_not_allowed")
        message = answer.json()["error"]["message"]
        assert shown in message and message.isprintable(), message


def test_admin_bodies_are_json_only(own: Live) -> None:
    """A cross-site form can POST text/plain or form bodies without asking first."""
    for media in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data"):
        answer = own.client.post(f"/v1/models/{MODEL}/reload", content=b"{}",
                                 headers={"Content-Type": media})
        assert_error(answer, 415, "unsupported_media_type")
    answer = own.client.post(f"/v1/models/{MODEL}/reload", content=b"{}",
                             headers={"Content-Type": "application/json"})
    assert answer.status_code == 200, answer.text


def test_allowed_hosts_from_the_config(tmp_path: Path) -> None:
    model = with_http(write_model(tmp_path / "v1"), allowed_hosts=["hps.prod.svc"])
    with serving(model) as live:
        assert reload(live, headers={"Host": "hps.prod.svc"}).status_code == 200
        assert reload(live, headers={"Host": "127.0.0.1"}).status_code == 200
        assert_error(reload(live, headers={"Host": "other.svc"}), 403, "host_not_allowed")


def test_non_ascii_token(model_files: ModelFiles) -> None:
    """A token with non-ASCII characters is sent as UTF-8 bytes (it only worked when
    they were Latin-1)."""
    with serving(model_files, token="tökén-ß") as live:
        good = {"Authorization": "Bearer tökén-ß".encode()}
        assert live.client.get("/v1/models", headers=good).status_code == 200
        bad = {"Authorization": "Bearer tökén-s".encode()}
        assert_error(live.client.get("/v1/models", headers=bad), 401, "unauthorized")
        latin1 = {"Authorization": "Bearer tökén-ß".encode("latin-1")}
        assert_error(live.client.get("/v1/models", headers=latin1), 401, "unauthorized")


def test_v2_json_infer_larger_than_the_key_limits_is_refused_before_parsing(
    live: Live
) -> None:
    keys = b"1," * (8 << 20 - 1) + b"1"
    body = (b'{"inputs": [{"name": "KEYS", "datatype": "INT64", "shape": [8388608], '
            b'"data": [' + keys + b"]}]}")
    answer = live.client.post(f"/v2/models/{MODEL}/infer", content=body,
                              headers={"Content-Type": "application/json"})
    assert answer.status_code == 413, answer.text
    assert "error" in answer.json()


# -- the same hostile requests to `hps serve --workers 2` ------------------------------------


def _hostile(model: ModelFiles) -> list[tuple[str, str, dict[str, Any], int, str | None]]:
    """(method, path, request options, status, kind) of the suite's hand-made hostile
    requests that change nothing: this module's, test_errors' and test_openapi_codes'
    (kind None: any kind, the status only 4xx)."""
    from tests.http import test_errors, test_openapi_codes

    lookup = f"/v1/models/{MODEL}/tables/0/lookup"
    json_headers = {"Content-Type": "application/json"}
    outside = [f"/etc/{t}" for t in TABLE_NAMES]
    cases: list[tuple[str, str, dict[str, Any], int, str | None]] = [
        ("POST", path, kwargs, status, kind)
        for _, path, kwargs, status, kind, _ in test_errors.CASES]
    cases += [("POST", path, {"content": body, "headers": json_headers}, status, kind)
              for body in test_errors.UNDECODABLE.values()
              for path, status, kind in test_errors.BODY_ROUTES]
    # not those over its servers' small body limit, nor the 504 a deadline of 0 ms asks
    cases += [(method, path, options, 0, None)
              for method, _, path, options in test_openapi_codes.CASES
              if len(options.get("content", b"")) <= test_openapi_codes.LIMIT
              and "X-HPS-Deadline-Ms" not in options.get("headers", {})]
    cases += [("POST", f"/v1/models/{MODEL}/tables/{table}/lookup", {
        "content": np.arange(3, dtype="<i8").tobytes(),
        "headers": {"Content-Type": "application/octet-stream"}}, 404, "unknown_table")
        for table in ["²", "١", "0²", "1.0", "-1", "+1", " 1", "9" * 30]]
    cases += [("POST", f"/v1/models/{MODEL}/reload", {"json": {"sparse_files": files}},
               422, "config") for files in (["/tmp/a\x00b", "/tmp/c"], ["/tmp/a\nb", "/tmp/c"],
                                            ["file://relative/x", "file://relative/y"],
                                            ["relative/a", "relative/b"])]
    cases += [
        ("POST", f"/v1/models/{MODEL}/reload", {"json": {"sparse_files": outside}}, 403,
         "forbidden"),
        ("POST", "/v1/models", {"json": {**model.config["models"][0], "model": "x",
                                         "sparse_files": outside}}, 403, "forbidden"),
        ("POST", "/v1/models", {"json": {**model.config["models"][0]}}, 409, "model_exists"),
        ("POST", lookup, {"content": b'{"keys": [9223372036854775808]}',
                          "headers": json_headers}, 400, "bad_json"),
        ("POST", f"/v1/models/{MODEL}/reload", {"headers": {"Host": "evil.example"}}, 403,
         "host_not_allowed"),
        ("POST", f"/v1/models/{MODEL}/reload", {"headers": {"Origin": "null"}}, 403,
         "host_not_allowed"),
        ("POST", f"/v1/models/{MODEL}/reload", {"content": b"{}", "headers": {
            "Content-Type": "text/plain"}}, 415, "unsupported_media_type"),
    ]
    cases += [(method, path, {**options, "headers": {**options.get("headers", {}),
                                                    "Host": REBOUND}}, 403, None)
              for method, path, options in READS]
    cases += [("GET", "/v1/models", {"headers": {"Host": sent}}, 403, "host_not_allowed")
              for sent, _ in HOSTS]
    return cases


def test_the_hostile_requests_get_the_same_4xx_from_two_workers(
        live_workers: Live) -> None:
    """Each hostile request of the suite, sent to `hps serve --workers 2` on fresh
    connections (either worker answers): a 4xx with a JSON body, the same status and
    kind as one process gives, never a 5xx; afterwards every answer is still exact."""
    live = live_workers
    keys = live.model.keys[1][:50]
    failures = []
    for method, path, options, status, kind in _hostile(live.model):
        with httpx.Client(base_url=live.url, timeout=60) as client:
            answer = client.request(method, path, **options)
        ok = (answer.status_code == status if status else 400 <= answer.status_code < 500)
        ok = ok and answer.headers.get("content-type", "").startswith("application/json")
        if ok and kind is not None:
            ok = answer.json()["error"]["kind"] == kind
        if not ok:
            failures.append((method, path[:60], answer.status_code, answer.text[:200]))
    assert not failures, failures
    for _ in range(8):  # fresh connections: both workers
        with httpx.Client(base_url=live.url, timeout=30) as client:
            answer = client.post(f"/v1/models/{MODEL}/tables/1/lookup",
                                 content=keys.astype("<i8").tobytes(),
                                 headers={"Content-Type": "application/octet-stream"})
            assert answer.status_code == 200, answer.text
            assert answer.content == live.model.expected(1, keys).tobytes()
            assert client.get("/readyz").status_code == 200
