"""Models added and reloaded from an S3 endpoint that answers as S3 never does: a plain
HTTP server (http.server in a thread, set as AWS_ENDPOINT_URL) whose HEAD lacks the
ETag or the Content-Length, refuses with a bare 403, answers a web server's HTML 404
page, or redirects (elsewhere, or naming another region). Each ends in a 4xx
with a JSON error naming what the endpoint answered (a HEAD without an ETag was a 500:
KeyError 'ETag'); nothing is added, the served model keeps serving. Real uvicorn over a
socket, boto3 over HTTP to the odd server."""

from __future__ import annotations

import copy
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.http.conftest import MODEL, TABLE_NAMES, Live, ModelFiles, serving, write_model

ROOT = "s3://bucket/models/"


class OddS3(BaseHTTPRequestHandler):
    """Serves the files of `folder` at /bucket/models/<table>/<file> in the answer
    `shape` the test picks; every request is noted in `seen`."""

    folder: Path
    shape = "no_etag"
    seen: list[str] = []

    def log_message(self, *args: object) -> None:  # the test's output stays clean
        pass

    def _file(self) -> bytes | None:
        rel = self.path.split("?", 1)[0].removeprefix("/bucket/models/")
        path = self.folder / rel
        return path.read_bytes() if path.is_file() else None

    def do_HEAD(self) -> None:
        self.seen.append(f"HEAD {self.path}")
        self._answer(head=True)

    def do_GET(self) -> None:
        self.seen.append(f"GET {self.path}")
        self._answer(head=False)

    def _answer(self, head: bool) -> None:
        data = self._file()
        shape = self.shape
        if data is None:
            self.send_error(404)
            return
        if shape == "html404":  # a web server's page (well-formed XML): no S3 error body
            page = b"<html><body><h1>404 Not Found</h1></body></html>"
            self.send_response(404)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            if not head:
                self.wfile.write(page)
            return
        if shape == "region":  # S3's answer to a request signed for another region
            self.send_response(301)
            self.send_header("x-amz-bucket-region", "eu-west-1")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if shape == "forbidden":  # a bare 403: no S3 XML error body
            self.send_response(403)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if shape in ("moved", "temporary"):  # a redirect to another host
            self.send_response(301 if shape == "moved" else 307)
            self.send_header("Location", f"http://elsewhere.example{self.path}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(200)
        if shape != "no_etag":
            self.send_header("ETag", '"0123456789abcdef"')
        if shape != "no_length" or not head:
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if not head:
            self.wfile.write(data)


@dataclass
class Odd:
    """The odd server: its handler class (whose `shape` a test sets), URL and files."""

    handler: type[OddS3]
    url: str
    files: ModelFiles


@pytest.fixture(scope="module")
def odd_s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Odd]:
    files = write_model(tmp_path_factory.mktemp("odd-s3"), seed=8)
    handler = type("Handler", (OddS3,), {"folder": files.dir, "seen": []})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield Odd(handler, f"http://127.0.0.1:{httpd.server_address[1]}", files)
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def live_s3(tmp_path: Path, odd_s3: Odd, monkeypatch: pytest.MonkeyPatch) -> Iterator[Live]:
    """A server whose models may be added from s3://bucket/models/ (the odd server)."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", odd_s3.url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    model = write_model(tmp_path / "v1", seed=6)
    config = copy.deepcopy(model.config)
    config.update(source_connect_timeout=2.0, source_read_timeout=2.0,
                  http={"allowed_sources": [ROOT]})
    with serving(replace(model, config=config)) as live:
        yield live


def _block(model: ModelFiles, name: str) -> dict[str, object]:
    return {**model.config["models"][0], "model": name,
            "sparse_files": [f"{ROOT}{t}" for t in TABLE_NAMES]}


#: (shape, status, kind, words the message must hold)
SHAPES = [
    ("no_etag", 422, "source", ["ETag", "s3://bucket/models/users/key"]),
    ("no_length", 422, "source", ["Content-Length", "s3://bucket/models/users/key"]),
    ("forbidden", 403, "source_access", ["s3://bucket/models/users/key"]),
    ("moved", 422, "source", ["s3://bucket/models/users/key", "301"]),
    ("temporary", 422, "source", ["s3://bucket/models/users/key", "redirected", "307"]),
    # (was 422 `S3 error  (HTTP 404): `: botocore's code of an HTML page is empty)
    ("html404", 404, "source_not_found", ["s3://bucket/models/users", "does not exist"]),
    # (said `answered HTTP 301 301`)
    ("region", 422, "source", ["bucket 'bucket' is in region eu-west-1, not us-east-1",
                               "answered HTTP 301: name the region"]),
]


@pytest.mark.parametrize("route", ["add", "reload"])
@pytest.mark.parametrize(("shape", "status", "kind", "words"), SHAPES,
                         ids=[s[0] for s in SHAPES])
def test_odd_s3_answers_end_in_a_4xx_and_change_nothing(
        live_s3: Live, odd_s3: Odd, route: str, shape: str, status: int, kind: str,
        words: list[str]) -> None:
    handler = odd_s3.handler
    handler.shape = shape
    handler.seen.clear()
    before = live_s3.lookup_binary(0, live_s3.model.keys[0][:5]).content
    if route == "add":
        answer = live_s3.client.post("/v1/models", json=_block(live_s3.model, "extra"))
    else:
        answer = live_s3.client.post(f"/v1/models/{MODEL}/reload", json={
            "sparse_files": [f"{ROOT}{t}" for t in TABLE_NAMES]})
    assert answer.status_code == status, answer.text
    assert answer.headers["content-type"] == "application/json"
    error = answer.json()["error"]
    assert error["kind"] == kind, error
    for word in words:
        assert word in error["message"], error["message"]
    assert not re.search(r"HTTP (\d{3}) \1\b", error["message"]), error["message"]
    assert "S3 error  " not in error["message"] and not error["message"].endswith(": ")
    assert any(r.startswith("HEAD /bucket/models/users/key") for r in handler.seen), \
        handler.seen
    listed = live_s3.client.get("/v1/models").json()["models"]
    assert [m["model"] for m in listed] == [MODEL]
    assert live_s3.lookup_binary(0, live_s3.model.keys[0][:5]).content == before
    assert live_s3.client.get("/readyz").status_code == 200


def test_a_well_formed_answer_loads(live_s3: Live, odd_s3: Odd) -> None:
    """The same server with an ETag and a Content-Length on its HEADs: the model is added
    and serves its rows (the odd answers above are what fails)."""
    odd_s3.handler.shape = "s3"
    answer = live_s3.client.post("/v1/models", json=_block(live_s3.model, "extra"))
    assert answer.status_code == 201, answer.text
    keys = odd_s3.files.keys[1][:10]
    got = live_s3.lookup_binary(1, keys, model="extra")
    assert got.status_code == 200, got.text
    assert got.content == odd_s3.files.expected(1, keys).tobytes()


def test_a_plain_http_server_as_the_endpoint_answers_422_naming_its_redirect(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`python -m http.server` as the endpoint, asked for a folder it lacks: its 301 of
    the bucket's listing sent botocore into a recursion (79-92 HEADs) and the reload
    answered 422 `unexpected RecursionError`. Now the 301 is named, and not followed."""
    from tests.modelfiles.test_s3_endpoints import PlainServer

    (tmp_path / "www" / "bucket").mkdir(parents=True)
    plain = PlainServer(tmp_path)
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", plain.endpoint)
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
        model = write_model(tmp_path / "v1", seed=6)
        config = copy.deepcopy(model.config)
        config["http"] = {"allowed_sources": [ROOT]}
        with serving(replace(model, config=config)) as live:
            answer = live.client.post(f"/v1/models/{MODEL}/reload", json={
                "sparse_files": [f"{ROOT}{t}" for t in TABLE_NAMES]})
            assert answer.status_code == 422, answer.text
            message = answer.json()["error"]["message"]
            assert "Recursion" not in message and "redirected the request (HTTP 301" in message
            assert live.client.get("/readyz").status_code == 200
        assert "HEAD 301" not in plain.requests() and plain.requests().count("GET 301") == 1
    finally:
        plain.close()
