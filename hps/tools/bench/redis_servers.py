"""Real `redis-server` processes on loopback ports, for the Redis benchmark and the tests.

`RedisServer` is one standalone server, `RedisClusterProcs` a cluster made by
`redis-cli --cluster create` (masters, optionally replicas). Each lives in its own work
folder, binds 127.0.0.1 only, keeps no snapshot or AOF, and allows `DEBUG` from loopback
(the tests use `DEBUG SLEEP` to make the server slow). Nothing here is used by the tier
itself.

A missing `redis-server` or `redis-cli` raises `RedisBinaryMissing`, which names the
package to install; callers (test fixtures) let it fail rather than skip.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis


class RedisBinaryMissing(RuntimeError):
    """`redis-server` or `redis-cli` is not on PATH."""


def redis_binary(name: str) -> str:
    """Path of `redis-server` / `redis-cli`; raises RedisBinaryMissing if absent."""
    path = shutil.which(name)
    if path is None:
        raise RedisBinaryMissing(
            f"'{name}' is not on PATH: install it (Debian/Ubuntu: apt-get install redis-server; "
            "scripts/test.sh does this) to run the Redis tests and benchmark"
        )
    return path


#: ports this process has handed out: a cluster's nodes take theirs (client and bus
#: ports) before any node binds one, and the kernel may offer a port it offered a moment
#: ago again (a node then failed "Address already in use" in CI)
_HANDED: set[int] = set()


def free_port() -> int:
    """A loopback TCP port that was free a moment ago, never one this process handed
    out before."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _HANDED:
            _HANDED.add(port)
            return port


def _wait(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except (redis.RedisError, OSError) as exc:
            last = exc
        time.sleep(0.02)
    raise TimeoutError(f"{what} within {timeout} s" + (f" (last error: {last})" if last else ""))


class RedisServer:
    """One `redis-server` process on 127.0.0.1:`port`, in `workdir`.

    `password` sets `requirepass`; `extra` is passed on the command line as is (e.g.
    `["--user", "alice", "on", ">pw", "~*", "+@all"]`); `tls` = (certificate, key, CA
    certificate) files makes it serve TLS only, on `port`; `node_timeout_ms` is a cluster
    node's `cluster-node-timeout` (how long before a silent peer counts as failing).
    `start()` returns when the server answers PING; `kill()` is SIGKILL (a crash), `stop()` a
    clean shutdown; `start()` again reuses the same port.
    """

    def __init__(
        self,
        workdir: str | os.PathLike[str] | None = None,
        *,
        port: int | None = None,
        password: str | None = None,
        extra: Sequence[str] = (),
        cluster: bool = False,
        node_timeout_ms: int = 1000,
        tls: tuple[str, str, str] | None = None,
    ) -> None:
        self._own_dir = workdir is None
        self.tls = tls
        self.node_timeout_ms = node_timeout_ms
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="hps-redis-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.password = password
        self.extra = list(extra)
        self.cluster = cluster
        self.cluster_port = free_port() if cluster else 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def host(self) -> str:
        return "127.0.0.1"

    @property
    def address(self) -> str:
        """`host:port`, as `volatile_db.address` takes it."""
        return f"{self.host}:{self.port}"

    def _argv(self) -> list[str]:
        if self.tls is None:
            ports = ["--port", str(self.port)]
        else:
            cert, key, ca = self.tls
            ports = ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", cert,
                     "--tls-key-file", key, "--tls-ca-cert-file", ca, "--tls-auth-clients", "no"]
        argv = [
            redis_binary("redis-server"),
            *ports,
            "--bind", "127.0.0.1",
            "--dir", str(self.workdir),
            "--logfile", str(self.workdir / "redis.log"),
            "--save", "",
            "--appendonly", "no",
            "--daemonize", "no",
            "--enable-debug-command", "local",
        ]
        if self.password:
            argv += ["--requirepass", self.password]
        if self.cluster:
            argv += [
                "--cluster-enabled", "yes",
                "--cluster-port", str(self.cluster_port),
                "--cluster-config-file", str(self.workdir / "nodes.conf"),
                "--cluster-node-timeout", str(self.node_timeout_ms),
                # the failover tests kill a master: let the replica take over quickly
                "--cluster-replica-validity-factor", "0",
            ]
        return argv + self.extra

    def start(self, timeout: float = 10.0) -> RedisServer:
        if self.proc is not None and self.proc.poll() is None:
            return self
        self.proc = subprocess.Popen(
            self._argv(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            cwd=self.workdir,
        )
        try:
            _wait(self._answers, timeout, f"redis-server on port {self.port} did not answer")
        except TimeoutError:
            self.kill()
            raise
        return self

    def _answers(self) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            log = self.workdir / "redis.log"
            tail = log.read_text()[-2000:] if log.exists() else ""
            raise RuntimeError(f"redis-server on port {self.port} exited:\n{tail}")
        with self.client(socket_timeout=0.5) as c:
            return bool(c.ping())

    def client(self, **kwargs: Any) -> redis.Redis:
        """A plain redis-py client of this server (authenticated when it has a password)."""
        kwargs.setdefault("password", self.password)
        if self.tls is not None:
            kwargs.update(ssl=True, ssl_ca_certs=self.tls[2], ssl_check_hostname=False)
        return redis.Redis(host=self.host, port=self.port, **kwargs)

    def kill(self) -> None:
        """SIGKILL: the server dies as in a crash (no shutdown, connections reset)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def stop(self) -> None:
        """SIGTERM and wait; falls back to SIGKILL."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None

    def close(self) -> None:
        """Stop the server and remove its folder if this object made it."""
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


class RedisClusterProcs:
    """A Redis Cluster of `masters` masters and `replicas` replicas per master.

    Made with `redis-cli --cluster create … --cluster-replicas R --cluster-yes`; `start()`
    returns when every node reports `cluster_state:ok` and agrees on the slots.
    """

    def __init__(
        self,
        workdir: str | os.PathLike[str] | None = None,
        *,
        masters: int = 3,
        replicas: int = 0,
        extra: Sequence[str] = (),
        node_timeout_ms: int = 1000,
    ) -> None:
        self._own_dir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="hps-redis-cluster-"))
        self.replicas = replicas
        self.nodes = [
            RedisServer(self.workdir / f"node{i}", cluster=True, extra=extra,
                        node_timeout_ms=node_timeout_ms)
            for i in range(masters * (1 + replicas))
        ]

    @property
    def address(self) -> str:
        """Comma list of every node's `host:port` (the seeds for `volatile_db.address`)."""
        return ",".join(n.address for n in self.nodes)

    def start(self, timeout: float = 30.0) -> RedisClusterProcs:
        for node in self.nodes:
            node.start()
        cmd = [redis_binary("redis-cli"), "--cluster", "create",
               *[n.address for n in self.nodes],
               "--cluster-replicas", str(self.replicas), "--cluster-yes"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            self.close()
            raise RuntimeError(f"redis-cli --cluster create failed:\n{done.stdout}\n{done.stderr}")
        _wait(self._ready, timeout, "the cluster did not reach cluster_state:ok")
        return self

    def _ready(self) -> bool:
        for node in self.nodes:
            with node.client(socket_timeout=0.5) as c:
                info = c.cluster("info")
                if info.get("cluster_state") != "ok" or int(info.get("cluster_known_nodes", 0)) \
                        != len(self.nodes):
                    return False
        masters = self.masters()
        if len(masters) != len(self.nodes) // (1 + self.replicas):
            return False
        for node in self.nodes:  # every replica has finished its first sync
            if node in masters:
                continue
            with node.client(socket_timeout=0.5) as c:
                if c.info("replication").get("master_link_status") != "up":
                    return False
        return True

    def masters(self) -> list[RedisServer]:
        """The nodes that are masters now (as the first live node sees it)."""
        by_port = {n.port: n for n in self.nodes}
        for node in self.nodes:
            if node.proc is None:
                continue
            with node.client(socket_timeout=0.5) as c:
                slots = c.execute_command("CLUSTER", "SLOTS")
            return [by_port[int(entry[2][1])] for entry in slots]
        return []

    def replica_of(self, master: RedisServer) -> RedisServer:
        """A replica of `master`."""
        with master.client(socket_timeout=0.5) as c:
            my_id = c.execute_command("CLUSTER", "MYID").decode()
        for node in self.nodes:
            if node is master or node.proc is None:
                continue
            with node.client(socket_timeout=0.5) as c:
                role = c.execute_command("ROLE")
            if role[0] == b"slave" and int(role[2]) == master.port:
                return node
            # ROLE answers the master's announced port; compare ids as a fallback
            with node.client(socket_timeout=0.5) as c:
                lines = c.execute_command("CLUSTER", "NODES").decode().splitlines()
            for line in lines:
                fields = line.split()
                if "myself" in fields[2] and len(fields) > 3 and fields[3] == my_id:
                    return node
        raise LookupError(f"no replica of {master.address}")

    def wait_ok(self, timeout: float = 20.0, steady: float = 0.5) -> None:
        """Wait until every live node reports cluster_state:ok again, and keeps saying so
        for `steady` seconds (just after a failover a node can still flip to fail while
        the new configuration spreads)."""
        ok_since: list[float] = []

        def all_ok() -> bool:
            for node in self.nodes:
                if node.proc is None:
                    continue
                with node.client(socket_timeout=0.5) as c:
                    if c.cluster("info").get("cluster_state") != "ok":
                        return False
            return True

        def ok() -> bool:
            if not all_ok():
                ok_since.clear()
                return False
            if not ok_since:
                ok_since.append(time.monotonic())
            return time.monotonic() - ok_since[0] >= steady

        _wait(ok, timeout, "the cluster did not return to cluster_state:ok")

    def close(self) -> None:
        for node in self.nodes:
            node.close()
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> RedisClusterProcs:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
