"""Errors of the HTTP layer, and the map from every error to a status code and JSON body.

Every error answer has the body `{"error": {"kind": …, "message": …}}`. `kind` is the
`kind` of the `HPSError` raised by the server (`unknown_model`, `batch_too_large`, …) or
one of the HTTP layer's own below; metrics count errors by it.

    ApiError                      raised by the HTTP layer itself
    ├── UnsupportedMediaType      415 unsupported_media_type
    ├── BodyTooLarge              413 body_too_large
    ├── BadBody                   400 bad_body      (binary body not whole keys of its dtype)
    ├── BadJSON                   400 bad_json      (not JSON, or not {"keys": [...]})
    ├── BadHTTP                   400 bad_http      (not HTTP/1.1 the parser reads: framing.py)
    ├── Unauthorized              401 unauthorized  (token set, none or a wrong one sent)
    ├── Forbidden                 403 forbidden     (admin route, no token, not on loopback)
    ├── ModelNotReady             503 model_loading / model_failed
    └── LookupStalled             503 lookup_stalled (no answer within the lookup limit)

Input errors are 4xx and change nothing; a 5xx means the server could not do what a
valid request asked (a model still loading, a reload whose source failed, a bug). A full
disk (OSError ENOSPC or EDQUOT, from a reload's writes) is 507 insufficient_storage: the
message names the file and the bytes not written; the old version keeps serving.
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from typing import Any

from hps import errors as hps_errors

#: an error body from (kind, message): each protocol has its own
ErrorBody = Callable[[str, str], dict[str, Any]]


class ApiError(Exception):
    """An error of the HTTP layer: it carries its status code and kind."""

    status = 400
    kind = "bad_request"

    def __init__(self, message: str, *, kind: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        if kind is not None:
            self.kind = kind
        self.headers = headers


class UnsupportedMediaType(ApiError):
    """The body's content type is neither application/octet-stream nor JSON."""

    status = 415
    kind = "unsupported_media_type"


class BodyTooLarge(ApiError):
    """The body is larger than the server's limit."""

    status = 413
    kind = "body_too_large"


class BadBody(ApiError):
    """A binary body is not a whole number of keys of its dtype, or a header that says
    how to read it (dtype, deadline) is not one the server reads."""

    kind = "bad_body"


class BadJSON(ApiError):
    """A JSON body is not valid JSON, or not of the expected shape."""

    kind = "bad_json"


class BadHTTP(ApiError):
    """The request is not HTTP/1.1 that uvicorn's parser reads (its request line, a
    header, its Content-Length or chunked framing): answered by the connection itself
    (hps/http/framing.py), which then closes."""

    kind = "bad_http"


class Unauthorized(ApiError):
    """A token is set and the request carries none, or a different one."""

    status = 401
    kind = "unauthorized"


class Forbidden(ApiError):
    """An admin route was called on a server without a token that is not on loopback."""

    status = 403
    kind = "forbidden"


class ModelNotReady(ApiError):
    """The model is in the config but not loaded (yet, or its load failed)."""

    status = 503
    kind = "model_loading"


class Overloaded(ApiError):
    """More lookups wait than the server's admission queue holds: shed, not queued."""

    status = 503
    kind = "overloaded"


class LookupStalled(ApiError):
    """A lookup did not return within the server's limit (its thread is held by
    something that does not end): refused rather than waited for."""

    status = 503
    kind = "lookup_stalled"


class DeadlineExceeded(ApiError):
    """The request's deadline (`X-HPS-Deadline-Ms`) passed before its answer was ready."""

    status = 504
    kind = "deadline_exceeded"


#: HPSError class → HTTP status; the first class in the error's MRO found here wins
_STATUS: dict[type[Exception], int] = {
    hps_errors.UnknownModelError: 404,
    hps_errors.UnknownTableError: 404,
    hps_errors.BatchTooLargeError: 413,
    hps_errors.LookupInputError: 400,
    hps_errors.ModelExistsError: 409,
    hps_errors.NoHotCopiesError: 409,
    hps_errors.ConfigError: 422,
    hps_errors.ModelFileError: 422,
    hps_errors.SourceNotFoundError: 404,
    hps_errors.SourceAccessError: 403,
    hps_errors.SourceError: 422,  # a source a request named cannot be read
    hps_errors.MissingExtraError: 501,
    hps_errors.TierUnavailableError: 503,
    hps_errors.WorkersBehindError: 503,
}


#: errno values of a disk that cannot take a write: no space, or the user's quota spent
_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})


def is_storage_full(exc: BaseException) -> bool:
    """Whether `exc` says a disk is full (an OSError ENOSPC / EDQUOT of our own writes)."""
    return (isinstance(exc, OSError) and not isinstance(exc, hps_errors.HPSError)
            and exc.errno in _FULL)


def status_of(exc: Exception) -> int:
    """The HTTP status an error is answered with."""
    if isinstance(exc, ApiError):
        return exc.status
    for cls in type(exc).__mro__:
        if cls in _STATUS:
            return _STATUS[cls]
    if is_storage_full(exc):
        return 507
    return 500


def kind_of(exc: Exception) -> str:
    """The `kind` of an error for its JSON body and metrics ('internal' for a bug)."""
    if isinstance(exc, (ApiError, hps_errors.HPSError)):
        return exc.kind
    if is_storage_full(exc):
        return "insufficient_storage"
    return "internal"


def error_body(kind: str, message: str) -> dict[str, Any]:
    """The /v1 error body: `{"error": {"kind": …, "message": …}}`."""
    return {"error": {"kind": kind, "message": message}}


def v2_error_body(kind: str, message: str) -> dict[str, Any]:
    """The KServe v2 error body: `{"error": message}` (the protocol's form)."""
    return {"error": message}
