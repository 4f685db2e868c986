"""One server per config source inside a process, shared by `HPS` and the framework layers.

HugeCTR's plugins held one global parameter server per process; here every `HPS` and
every layer (hps.torch, hps.tensorflow) built from the same source shares one
HierarchicalParameterServer: a file path by its real path, any other config object
(ParameterServerConfig, PSConfig, dict) by its identity. Without that, a second server of
the same config would find the first one's RocksDB store locked.

A server is closed when its last user lets go: each `HPS` holds it until its `close()`,
the layers hold it together until `close_all()` (hps.torch.close_servers). Layers keep an
integer handle, which is what a framework op can carry. Thread-safe: a second user asking
for a server that is still starting waits for it rather than starting another.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hps.errors import ConfigError
from hps.hugectr.params import as_ps_config
from hps.server.parameter_server import HierarchicalParameterServer

if TYPE_CHECKING:
    from hps.server.loader import LoadProgress

#: a config source as the registry knows it: ("file", real path) or ("object", id)
SourceKey = tuple[str, Any]


@dataclass
class _Shared:
    server: HierarchicalParameterServer
    source: Any  # held so that an object's id stays its own while the entry lives
    users: int = 0


class ServerRegistry:
    """Shared servers by config source, counted by their users; layers' handles."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._shared: dict[SourceKey, _Shared] = {}
        self._handles: dict[SourceKey, int] = {}  # the layers' reference, one per source
        self._by_handle: dict[int, HierarchicalParameterServer] = {}
        self._keys: dict[int, SourceKey] = {}
        self._next = 1

    @staticmethod
    def key(source: Any) -> SourceKey:
        """How `source` is told apart: a path by its real path, an object by identity."""
        if isinstance(source, (str, os.PathLike)):
            return ("file", os.path.realpath(os.fspath(source)))
        return ("object", id(source))

    def open(self, source: Any, progress: LoadProgress | None = None
             ) -> tuple[SourceKey, HierarchicalParameterServer]:
        """The server of `source`, started (with `progress`) if none is open, with one
        more user; give it back with `release(key)`. ConfigError and the load's errors
        propagate, and nothing is registered then."""
        key = self.key(source)
        with self._lock:
            shared = self._shared.get(key)
            if shared is None:
                # a config file goes by its path, which the server's errors then name
                server = HierarchicalParameterServer(
                    source if isinstance(source, (str, os.PathLike)) else as_ps_config(source),
                    progress=progress)
                shared = self._shared[key] = _Shared(server, source)
            shared.users += 1
            return key, shared.server

    def release(self, key: SourceKey) -> None:
        """One user of the server of `key` lets go; the last one closes it."""
        with self._lock:
            shared = self._shared.get(key)
            if shared is None:
                return
            shared.users -= 1
            if shared.users > 0:
                return
            del self._shared[key]
        shared.server.close()

    def is_open(self, source: Any) -> bool:
        """Whether a server of `source` is open in this process."""
        with self._lock:
            return self.key(source) in self._shared

    def acquire(self, source: Any) -> int:
        """The layers' handle of the server for `source` (shared with any open `HPS` of
        it), started on first use (errors as `open`)."""
        key = self.key(source)
        with self._lock:
            handle = self._handles.get(key)
            if handle is not None:
                return handle
        _, server = self.open(source)
        with self._lock:
            handle = self._handles.get(key)
            if handle is not None:  # another thread's layer got there first
                duplicate = True
            else:
                duplicate = False
                handle, self._next = self._next, self._next + 1
                self._handles[key] = handle
                self._by_handle[handle] = server
                self._keys[handle] = key
        if duplicate:
            self.release(key)
        return handle

    def server(self, handle: int) -> HierarchicalParameterServer:
        """The server of a layers' handle; ConfigError once it was closed."""
        try:
            return self._by_handle[handle]
        except KeyError:
            raise ConfigError(f"hps server handle {handle} is closed") from None

    def __len__(self) -> int:
        return len(self._by_handle)

    def close_all(self) -> None:
        """The layers let go of every server (closed unless an `HPS` still holds it);
        handles given out before fail from now on."""
        with self._lock:
            keys = list(self._keys.values())
            self._handles, self._by_handle, self._keys = {}, {}, {}
        for key in keys:
            self.release(key)


#: the process's registry, shared by `HPS` and every framework layer
servers = ServerRegistry()
