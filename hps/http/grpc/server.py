"""`GrpcServer`: grpcio serving `GRPCInferenceService` for one app's state, on its own
thread pool, bound up front (a taken port is a BindError before anything is served),
stopped with a grace period that lets calls in flight finish.

    grpc_server = GrpcServer(app.state.hps, "127.0.0.1", 8001)  # binds
    grpc_server.start(); …; grpc_server.stop(grace=5).wait()

The request size limit is the HTTP body limit (`max_body_bytes`): a larger message is
RESOURCE_EXHAUSTED, answered by grpcio before any of it is parsed.

One port, several processes (`hps serve --workers N`): grpcio listens on a port of its
own and cannot be handed the supervisor's socket, so the supervisor holds the port with
`reserve_port` (bound with SO_REUSEPORT, never listening: the kernel hands connections
only to listening sockets) and each worker calls `share_port(port)` before its
`GrpcServer` binds it with SO_REUSEPORT too; the kernel spreads new connections over
the workers (a channel's calls all go to the worker its connection landed on). Any
other port is bound alone (SO_REUSEPORT off), so a port in use is a BindError instead
of a second server sharing it silently.
"""

from __future__ import annotations

import errno
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import grpc

from hps.errors import BindError
from hps.http.grpc.service import InferenceService, handler

if TYPE_CHECKING:
    from hps.http.state import ServiceState

#: gRPC worker threads: each call in flight, and each open stream, holds one; more than
#: the cores, since a stream holds its thread while it waits for the next request
DEFAULT_GRPC_THREADS = 16
#: the ports this process serves together with other processes (`share_port`)
_SHARED_PORTS: set[int] = set()


def share_port(port: int) -> None:
    """Bind `port` with SO_REUSEPORT from now on in this process: a worker's share of
    the port its supervisor holds (`reserve_port`)."""
    _SHARED_PORTS.add(port)


def reserve_port(host: str, port: int) -> socket.socket:
    """Hold `host:port` (0: a free port) for the gRPC servers of several processes:
    a socket bound with SO_REUSEPORT alone, not listening. Other programs cannot bind
    the port meanwhile (nor a single `hps serve`, which binds without SO_REUSEPORT).
    Raises BindError when the port is taken. Close it to give the port up."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host.strip("[]") or None, port, type=socket.SOCK_STREAM,
            flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise BindError(f"cannot serve gRPC on {host!r}: not an address of this machine "
                        f"({exc.strerror})") from None
    # first alone: a port another server shares with SO_REUSEPORT is taken for us too
    probe = socket.socket(family, kind, proto)
    held = socket.socket(family, kind, proto)
    try:
        if family == socket.AF_INET6:  # as grpcio binds "[::]": both families
            for sock in (probe, held):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        probe.bind(address)
        address = (address[0], probe.getsockname()[1], *address[2:])
        probe.close()
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        held.bind(address)
    except OSError as exc:
        held.close()
        where = grpc_address(host, port)
        if exc.errno == errno.EADDRINUSE:
            raise BindError(f"cannot serve gRPC on {where}: the port is in use; pick "
                            "another with --grpc-port") from None
        raise BindError(f"cannot serve gRPC on {where}: {exc.strerror}") from None
    finally:
        probe.close()
    return held


def grpc_address(host: str, port: int) -> str:
    """`host:port` as grpcio spells a listening address (IPv6 in brackets)."""
    host = host.strip("[]") or "0.0.0.0"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class GrpcServer:
    """The v2 gRPC service of `state`, bound to `host:port` (0: a free port) on creation."""

    def __init__(self, state: ServiceState, host: str, port: int,
                 threads: int = DEFAULT_GRPC_THREADS) -> None:
        self.server = grpc.server(
            ThreadPoolExecutor(threads, thread_name_prefix="hps-grpc"),
            options=[("grpc.max_receive_message_length", state.max_body_bytes),
                     ("grpc.max_send_message_length", -1),
                     # without this a second server could bind the same port silently
                     ("grpc.so_reuseport", int(port in _SHARED_PORTS))])
        self.server.add_generic_rpc_handlers((handler(InferenceService(state)),))
        address = grpc_address(host, port)
        try:
            self.port = self.server.add_insecure_port(address)
        except RuntimeError:  # grpcio ≥ 1.50 raises where it used to answer 0
            self.port = 0
        if self.port == 0:
            raise BindError(f"cannot serve gRPC on {address}: the port is in use or the "
                            "address is not this machine's; pick another with --grpc-port")
        self.host = host

    @property
    def address(self) -> str:
        """Where a client on this machine reaches the service (tritonclient's `url`)."""
        host = self.host.strip("[]")
        if host in ("0.0.0.0", ""):
            host = "127.0.0.1"
        elif host == "::":
            host = "::1"
        return grpc_address(host, self.port)

    def start(self) -> str:
        self.server.start()
        return self.address

    def stop(self, grace: float = 5.0) -> threading.Event:
        """New calls are refused at once; calls in flight get `grace` seconds. Returns
        at once: the event is set when the last call is done."""
        return self.server.stop(grace)

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop(0).wait()
