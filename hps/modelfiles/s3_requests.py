"""What one call of the S3 reader may send, whatever the endpoint answers.

Each call of `S3Source` (the HEAD that sizes a file, the GET of one part, a listing)
runs inside `budgeted(...)`. botocore's `before-send` event counts the requests the call
sends, botocore's retries and redirects and the reader's own included (`count_request`),
and past the call's `limit` stops it with a SourceError saying how many requests went
out, over how long, and what the endpoint last answered; `needs-retry` notes each answer
(`note_answer`). The call also keeps when it started, so a timeout's message gives the
time the endpoint really held it, over every attempt, not one attempt's limit.

Redirects: S3 redirects only to name a bucket's region (a 301 carrying
x-amz-bucket-region), which botocore follows once. A redirect without that header (a
plain web server's 301 from a folder to its slash, a proxy's 307) is not followed:
`note_answer` raises it as the ClientError of the call. Followed, botocore asked for the
bucket's region with a HEAD of the bucket, which such a server redirected again, and so
on until Python's recursion limit (79-92 HEADs, then RecursionError).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from hps.errors import SourceError

#: the response header S3 names a bucket's region in (its 301s and 400s carry it)
REGION_HEADER = "x-amz-bucket-region"


@dataclass
class Call:
    """One call to the endpoint: what it reads (the URI its messages name), where
    (`where`: the endpoint in words), at most how many requests, and what it sent."""

    what: str
    where: str
    limit: int
    started: float = field(default_factory=time.monotonic)
    sent: int = 0
    #: the endpoint's last answer: "HTTP 301", or the exception a request raised
    last: str = "no answer yet"

    @property
    def elapsed(self) -> float:
        """Seconds since the call started."""
        return time.monotonic() - self.started

    def attempts(self) -> str:
        """'N request(s) over T s', for a message."""
        return f"{self.sent} request(s) over {self.elapsed:.1f}s"


_CURRENT: ContextVar[Call | None] = ContextVar("hps_s3_call", default=None)


@contextmanager
def budgeted(what: str, where: str, limit: int) -> Iterator[Call]:
    """The requests sent in this thread within the block count towards one call."""
    call = Call(what, where, limit)
    token = _CURRENT.set(call)
    try:
        yield call
    finally:
        _CURRENT.reset(token)


def count_request(**_: Any) -> None:
    """botocore's before-send hook: count the request; SourceError past the limit."""
    call = _CURRENT.get()
    if call is None:
        return
    if call.sent >= call.limit:
        raise SourceError(
            f"{call.what}: {call.where} was sent {call.attempts()} without an answer S3 "
            f"would give (last: {call.last}); hps sends at most {call.limit} for one read")
    call.sent += 1


def note_answer(response: Any = None, caught_exception: Exception | None = None,
                operation: Any = None, **_: Any) -> None:
    """botocore's needs-retry hook (before its own): note the answer; a redirect that
    names no region is the call's error, not followed (see the module)."""
    call = _CURRENT.get()
    if caught_exception is not None:
        if call is not None:
            call.last = f"{type(caught_exception).__name__}: {caught_exception}"
        return
    if response is None:
        return
    http, parsed = response
    status = int(getattr(http, "status_code", 0) or 0)
    if call is not None:
        call.last = f"HTTP {status}"
    if 300 <= status < 400 and REGION_HEADER not in http.headers:
        from botocore.exceptions import ClientError

        raise ClientError(parsed, operation.name if operation is not None else "request")
