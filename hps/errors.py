"""The exception tree of `hps`.

Every error that `hps` raises on purpose is an `HPSError`, so callers can catch one
class. The subclasses say what kind of failure it was, because callers act on the kind:
the HTTP layer maps input errors to 4xx, the lookup path falls through to the next tier
on `TierUnavailableError`, and metrics are labelled by `kind`.

    HPSError
    ├── ConfigError                 a ps.json / YAML / dict config is malformed
    │   ├── ModelExistsError        a model of that name is served already (HTTP 409)
    │   └── NoHotCopiesError        the table keeps no hot copies to fill (HTTP 409)
    ├── MissingExtraError           an optional dependency is not installed
    ├── LookupInputError            a lookup request is malformed (HTTP 400)
    │   ├── UnknownModelError       no model of that name is loaded (HTTP 404)
    │   ├── UnknownTableError       the model has no such table (HTTP 404)
    │   ├── KeyTypeError            keys are not an integer array
    │   ├── BatchTooLargeError      more keys than max_batch_size × maxnum_catfeature…
    │   └── OutputBufferError       output of wrong dtype, size, layout or device
    ├── ModelFileError              model files are missing, truncated, corrupt or inconsistent
    │   ├── UnsupportedFormatError  a format hps does not read (pickled PyTorch, a lone .npy)
    │   └── LoadGateError       a version the load gate refused (hps/gate/verdict.py)
    ├── SourceError                 a model URI cannot be read
    │   ├── SourceNotFoundError     the object or file does not exist
    │   ├── SourceAccessError       credentials missing or access denied
    │   └── SourceUnreachableError  the host cannot be reached
    ├── TierError                   a database tier failed
    │   ├── TierUnavailableError    network/timeout: fall through to the next tier, retry later
    │   │   └── TableUnreadableError  a shared table's write never ended (its writer died)
    │   └── TierSetupError          wrong address, password, TLS files: fails at start
    │       └── StoreInUseError     another process has the RocksDB store open for writing
    ├── DeviceError                 no CUDA device, too little device memory, wrong device
    ├── BindError                   the HTTP server cannot bind its address (port in use)
    ├── ModelsNotLoadedError        a model failed to load at start, and the server requires them
    └── UpdateError                 online updates (Kafka, Redis Streams) failed
        ├── UpdateSourceUnavailableError  broker or Redis down: retried with backoff
        └── BadUpdateError          a message or publish request that cannot be applied
"""

from __future__ import annotations


class HPSError(Exception):
    """Base class of every error `hps` raises on purpose."""

    kind = "hps"


class ConfigError(HPSError, ValueError):
    """A configuration is malformed; the message names the key path and the expected form."""

    kind = "config"


class ModelExistsError(ConfigError):
    """A model to add has the name of one served (or being added) already."""

    kind = "model_exists"


class NoHotCopiesError(ConfigError):
    """A fill of hot copies (hps/gpu/hot_rows.py) asked of a table that keeps none: not a
    static table sharded over several GPUs here (a server without GPUs keeps none)."""

    kind = "no_hot_copies"


class MissingExtraError(HPSError, ImportError):
    """An optional dependency is missing; the message names the extra to install."""

    kind = "missing_extra"

    def __init__(self, package: str, extra: str, purpose: str) -> None:
        super().__init__(
            f"{purpose} needs the '{package}' package: pip install 'hps-server[{extra}]'"
        )
        self.package = package
        self.extra = extra


class LookupInputError(HPSError, ValueError):
    """A lookup request is malformed; nothing was read or written."""

    kind = "bad_input"


class UnknownModelError(LookupInputError, KeyError):
    """No model of that name is loaded."""

    kind = "unknown_model"

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class UnknownTableError(LookupInputError, KeyError):
    """The model has no table of that index or name."""

    kind = "unknown_table"

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class KeyTypeError(LookupInputError, TypeError):
    """Keys are not an array of integers, or not readable as one."""

    kind = "bad_keys"


class BatchTooLargeError(LookupInputError):
    """More keys than max_batch_size × maxnum_catfeature_query_per_table_per_sample."""

    kind = "batch_too_large"


class OutputBufferError(LookupInputError):
    """The output buffer has the wrong dtype, size, layout or device, or is read-only."""

    kind = "bad_output"


class ModelFileError(HPSError, ValueError):
    """Model files are missing, truncated, corrupt, or inconsistent with the config.

    The message names the file and what is wrong; a load that raises it writes nothing
    that stays behind.
    """

    kind = "model_file"


class UnsupportedFormatError(ModelFileError):
    """Files in a format hps does not read; the message says what to save them as."""

    kind = "unsupported_format"


class SourceError(HPSError, OSError):
    """A model URI cannot be read."""

    kind = "source"


class SourceNotFoundError(SourceError):
    """The file or object named by the URI does not exist."""

    kind = "source_not_found"


class SourceAccessError(SourceError):
    """Credentials are missing or access was denied."""

    kind = "source_access"


class SourceUnreachableError(SourceError):
    """The host behind the URI cannot be reached."""

    kind = "source_unreachable"


class TierError(HPSError):
    """A database tier failed."""

    kind = "tier"


class TierUnavailableError(TierError, ConnectionError):
    """A network tier did not answer in time; callers fall through and retry later."""

    kind = "tier_unavailable"


class TableUnreadableError(TierUnavailableError):
    """A table in shared memory is in the middle of a write that does not end (the
    process writing it died, or stalled): its rows cannot be read whole. The next tier
    answers; without one the lookup fails (HTTP 503) rather than wait for it."""

    kind = "table_unreadable"


class TierSetupError(TierError):
    """A tier cannot be set up: wrong address, credentials or TLS files."""

    kind = "tier_setup"


class StoreInUseError(TierSetupError):
    """Another process (a running `hps serve`?) has the RocksDB store open for writing;
    a read-only open reads it meanwhile."""

    kind = "store_in_use"


class DeviceError(HPSError, RuntimeError):
    """No usable CUDA device, too little device memory, or data on the wrong device."""

    kind = "device"


class ModelsNotLoadedError(HPSError):
    """A model of the config failed to load when the server started, and the server was
    told to require them all (`hps serve --require-models`, `http.require_models`)."""

    kind = "models_not_loaded"


class WorkersBehindError(HPSError):
    """Under `hps serve --workers N`, a change (reload, added or removed model) was made
    in the leader, but some live worker did not apply it within the wait
    (`$HPS_WORKER_ACK_WAIT_S`): it still serves what it served before. Asking again sees
    the change through; /readyz names the workers meanwhile."""

    kind = "workers_behind"


class BindError(HPSError, OSError):
    """The HTTP server cannot listen on its address: the port is taken, or not allowed."""

    kind = "bind"


class UpdateError(HPSError):
    """Online updates (hps/updates) failed."""

    kind = "update"


class UpdateSourceUnavailableError(UpdateError, ConnectionError):
    """The update source (Kafka broker, Redis) cannot be reached; retried with backoff while
    lookups go on."""

    kind = "update_source_unavailable"


class BadUpdateError(UpdateError, ValueError):
    """An update that cannot be applied: a malformed message (skipped and counted by the
    consumer) or bad arrays given to a publish call. `reason` names what is wrong
    ("magic", "value_size", "truncated", "unknown_table", "non_finite", "key_range"; for
    a publisher also "message_size": a message larger than the broker takes)."""

    kind = "bad_update"

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason
