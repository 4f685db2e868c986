"""The S3 reader against endpoints that are not S3: a plain `python -m http.server` (a
process) and small http.server handlers (a thread) that redirect, stall or fail. Each
read ends in an error true to what the endpoint did, after a bounded number of
requests."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from hps.errors import SourceError, SourceNotFoundError, SourceUnreachableError
from hps.modelfiles.formats import ReadOptions, open_model
from hps.modelfiles.s3 import S3Source
from hps.modelfiles.source import SourceOptions
from tests.conftest import write_table
from tests.support.redis_servers import free_port


@pytest.fixture(autouse=True)
def credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)


class PlainServer:
    """`python -m http.server` over a folder holding bucket/models/users (a sparse
    folder); its request log is read back from its stderr."""

    def __init__(self, root: Path) -> None:
        self.port = free_port()
        self.log = root / "requests.log"
        self._out = open(self.log, "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "http.server", str(self.port), "--bind", "127.0.0.1",
             "--directory", str(root / "www")], stdout=subprocess.DEVNULL, stderr=self._out)
        deadline = time.monotonic() + 20
        while not self._listening():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise AssertionError(f"http.server did not start: {self.log.read_text()}")
            time.sleep(0.05)

    def _listening(self) -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", self.port)) == 0

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def requests(self) -> list[str]:
        """'HEAD 301', 'GET 404', ... for each request answered so far."""
        found = re.findall(r'"([A-Z]+) [^"]*" (\d{3})', self.log.read_text())
        return [f"{method} {status}" for method, status in found]

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)
        self._out.close()


@pytest.fixture
def plain(tmp_path: Path, rng: np.random.Generator) -> Iterator[PlainServer]:
    keys = np.arange(100, dtype=np.int64)
    write_table(tmp_path / "www" / "bucket" / "models" / "users", keys,
                rng.standard_normal((100, 4)).astype(np.float32))
    server = PlainServer(tmp_path)
    yield server
    server.close()


def test_a_plain_http_server_asked_for_a_folder_it_lacks(plain: PlainServer) -> None:
    """It answers the listing of the bucket with a 301 to the folder's slash: botocore
    followed it with a HEAD of the bucket, redirected again, 80 times, and the load
    answered `unexpected RecursionError`. Now the redirect is the error, not followed."""
    options = SourceOptions(s3_endpoint=plain.endpoint)
    with pytest.raises(SourceError) as error:
        open_model("s3://bucket/models/nothere", ReadOptions(4), options)
    message = str(error.value)
    assert "Recursion" not in message
    assert (f"s3://bucket/models/nothere/: endpoint {plain.endpoint} redirected the request "
            "(HTTP 301 to /bucket/?list-type=2") in message
    seen = plain.requests()
    assert seen.count("GET 301") == 1 and "HEAD 301" not in seen, seen


def test_a_plain_http_server_asked_for_a_folder_as_a_file(plain: PlainServer) -> None:
    with S3Source("s3://bucket/models", SourceOptions(s3_endpoint=plain.endpoint)) as source:
        with pytest.raises(SourceError, match=re.escape(
                f"s3://bucket/models/users: endpoint {plain.endpoint} redirected the request "
                "(HTTP 301 to /bucket/models/users/)")):
            source.size("users")
    assert plain.requests() == ["HEAD 301"]


#: a web server's error page that is well-formed XML: botocore parses it to an empty
#: error code (a page that is not XML it reads as the bare status)
HTML_PAGE = (b"<html><head><title>{status}</title></head><body><h1>{status}</h1>"
             b"</body></html>")


class Odd(BaseHTTPRequestHandler):
    """Answers every request as `shape` says: `slow` (holds it `hold` seconds), `region`
    (S3's 301 naming another region), `busy` (503), `html404` and `html500` (a web
    server's HTML page, no S3 error body); notes each in `seen`."""

    shape = "slow"
    hold = 1.0
    seen: list[str] = []

    def log_message(self, *args: object) -> None:
        pass

    def do_HEAD(self) -> None:
        self._answer()

    def do_GET(self) -> None:
        self._answer()

    def _answer(self) -> None:
        self.seen.append(f"{self.command} {self.path}")
        if self.shape == "slow":
            time.sleep(self.hold)
        status = {"slow": 200, "region": 301, "busy": 503, "html404": 404,
                  "html500": 500}[self.shape]
        if self.shape.startswith("html"):
            page = HTML_PAGE.replace(b"{status}", str(status).encode())
            self.send_response(status)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(page)
            return
        self.send_response(status)
        if self.shape == "region":
            self.send_header("x-amz-bucket-region", "eu-west-1")
        self.send_header("ETag", '"0123"')
        self.send_header("Content-Length", "0")
        self.end_headers()


@pytest.fixture
def odd() -> Iterator[tuple[type[Odd], str]]:
    handler = type("Handler", (Odd,), {"seen": []})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield handler, f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_a_timeout_names_the_time_the_endpoint_really_held_the_read(
        odd: tuple[type[Odd], str]) -> None:
    """Each attempt timed out after read_timeout and botocore tried again: the message
    said `did not answer within 0.3s` of a read held for seconds."""
    handler, endpoint = odd
    options = SourceOptions(s3_endpoint=endpoint, read_timeout=0.3, max_attempts=3)
    with S3Source("s3://bucket/t", options) as source:
        started = time.monotonic()
        with pytest.raises(SourceUnreachableError) as error:
            source.size("key")
        held = time.monotonic() - started
    found = re.search(r"did not answer: 3 request\(s\) over ([\d.]+)s, each given 0.3s "
                      r"\(source_read_timeout\)", str(error.value))
    assert found is not None, str(error.value)
    assert held - 0.2 <= float(found.group(1)) <= held + 0.05, (found.group(1), held)
    assert float(found.group(1)) >= 0.9  # three attempts of 0.3 s at least
    assert handler.seen == ["HEAD /bucket/t/key"] * 3


def test_s3s_redirect_to_another_region_is_named_and_bounded(
        odd: tuple[type[Odd], str]) -> None:
    handler, endpoint = odd
    handler.shape = "region"
    with S3Source("s3://bucket/t", SourceOptions(s3_endpoint=endpoint)) as source:
        with pytest.raises(SourceError, match="s3://bucket/t/key: bucket 'bucket' is in region "
                                              "eu-west-1, not us-east-1") as error:
            source.size("key")
        assert 1 <= len(handler.seen) <= source.request_limit(), handler.seen
    # the status once (it said `answered HTTP 301 301`: botocore's code of a bare answer)
    assert f"endpoint {endpoint} answered HTTP 301: name the region" in str(error.value)


def test_a_web_servers_html_404_is_a_missing_file(odd: tuple[type[Odd], str]) -> None:
    """An HTML 404 page, no S3 error body: botocore's code is empty, and the HEAD's
    precise GET made it `S3 error  (HTTP 404): ` (422 over HTTP). It is the file that is
    missing, on every call: the HEAD, a part's GET, the listing."""
    handler, endpoint = odd
    handler.shape = "html404"
    with S3Source("s3://bucket/t", SourceOptions(s3_endpoint=endpoint)) as source:
        for call in (lambda: source.size("key"), lambda: source.read("key", 0, 8)):
            with pytest.raises(SourceNotFoundError, match=re.escape(
                    "s3://bucket/t/key does not exist (no object 't/key' in bucket "
                    "'bucket')")):
                call()
        with pytest.raises(SourceNotFoundError, match="s3://bucket/t/ does not exist"):
            source.names()
    assert "GET /bucket/t/key" in handler.seen  # the page was read, not only the HEAD


def test_a_web_servers_html_500_names_its_status_once(odd: tuple[type[Odd], str]) -> None:
    handler, endpoint = odd
    handler.shape = "html500"
    options = SourceOptions(s3_endpoint=endpoint, max_attempts=1)
    with S3Source("s3://bucket/t", options) as source, pytest.raises(SourceError) as error:
        source.read("key", 0, 8)
    assert str(error.value).startswith("s3://bucket/t/key: S3 error (HTTP 500)")


def test_an_endpoint_that_keeps_failing_is_tried_max_attempts_times(
        odd: tuple[type[Odd], str]) -> None:
    handler, endpoint = odd
    handler.shape = "busy"
    options = SourceOptions(s3_endpoint=endpoint, max_attempts=2)
    with S3Source("s3://bucket/t", options) as source:
        with pytest.raises(SourceError, match=r"s3://bucket/t/key: S3 error \(HTTP 503\)"):
            source.size("key")
        assert len(handler.seen) <= source.request_limit()
