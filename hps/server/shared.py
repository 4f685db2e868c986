"""One HPS per config source, shared by the framework layers (hps.torch, hps.tensorflow).

HugeCTR's plugins held one global parameter server per process; here every layer built
from the same source shares one: a file path by its real path, any other config object
(ParameterServerConfig, PSConfig, dict) by its identity. Layers keep an integer handle,
which is what a framework op can carry. Thread-safe: a second layer asking for a server
that is still starting waits for it rather than starting another.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any

from hps.api import HPS
from hps.errors import ConfigError


@dataclass
class _Entry:
    server: HPS
    source: Any  # held so that an object's id stays its own while the entry lives


class ServerRegistry:
    """Handles of shared servers, by config source."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._handles: dict[tuple[str, Any], int] = {}
        self._entries: dict[int, _Entry] = {}
        self._next = 1

    @staticmethod
    def _key(source: Any) -> tuple[str, Any]:
        if isinstance(source, (str, os.PathLike)):
            return ("file", os.path.realpath(os.fspath(source)))
        return ("object", id(source))

    def acquire(self, source: Any) -> int:
        """The handle of the server for `source`, started on first use (ConfigError and
        the load's errors propagate; nothing is registered then)."""
        key = self._key(source)
        with self._lock:
            handle = self._handles.get(key)
            if handle is None:
                server = HPS(source)
                handle, self._next = self._next, self._next + 1
                self._entries[handle] = _Entry(server, source)
                self._handles[key] = handle
            return handle

    def server(self, handle: int) -> HPS:
        """The server of a handle; ConfigError once it was closed."""
        try:
            return self._entries[handle].server
        except KeyError:
            raise ConfigError(f"hps server handle {handle} is closed") from None

    def __len__(self) -> int:
        return len(self._entries)

    def close_all(self) -> None:
        """Close every server; handles given out before fail from now on."""
        with self._lock:
            entries, self._entries, self._handles = self._entries, {}, {}
        for entry in entries.values():
            entry.server.close()


#: the process's registry, shared by every framework layer
servers = ServerRegistry()
