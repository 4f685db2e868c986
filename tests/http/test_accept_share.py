"""Connections opened together spread over the workers of `hps serve --workers N`
(hps/http/accept_share.py), and the board that decides it."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from hps.http.accept_share import STALE_S, ConnectionBoard, SharedAccept
from hps.tools.bench.http import every_worker_accepting
from tests.http.conftest import MODEL, TABLE_NAMES, write_model
from tests.http.test_workers import serve, stop, write_run


def _established_inodes(port: int) -> set[int]:
    """Socket inodes of this machine's established TCP connections whose local port is
    `port` (the server's ends), from /proc/net/tcp and tcp6."""
    inodes: set[int] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:  # a loop over connections, not keys
            fields = line.split()
            local_port = int(fields[1].rsplit(":", 1)[1], 16)
            if local_port == port and fields[3] == "01":  # ESTABLISHED
                inodes.add(int(fields[9]))
    return inodes


def _connections_per_worker(pids: dict[int, int], port: int) -> dict[int, int]:
    """How many of the server's established connections each worker holds."""
    inodes = _established_inodes(port)
    held = {}
    for index, pid in pids.items():
        count = 0
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:[") and int(target[8:-1]) in inodes:
                count += 1
        held[index] = count
    return held


def _request(port: int, keys: np.ndarray) -> bytes:
    body = keys.astype("<i8").tobytes()
    return (f"POST /v1/models/{MODEL}/tables/{TABLE_NAMES[0]}/lookup HTTP/1.1\r\n"
            f"Host: 127.0.0.1:{port}\r\nContent-Type: application/octet-stream\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def _answer_status(conn: socket.socket) -> int:
    """The status of the answer on `conn` (its head read; the body is small)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        assert chunk, "the server closed the connection"
        data += chunk
    return int(data.split(b" ", 2)[1])


def _wait_board(board: ConnectionBoard, done: Callable[[np.ndarray], bool]) -> None:
    """Until `done(counts)` holds of the board's counts, every worker beating."""
    deadline = time.monotonic() + 10
    while not (done(board.slots[:, 0]) and board.responsive() == board.slots.shape[0]):
        assert time.monotonic() < deadline, board.slots.tolist()
        time.sleep(0.01)


def _assert_even_unless_passed_over(held: dict[int, int], board: ConnectionBoard,
                                    passed_before: np.ndarray) -> None:
    """The connections `held` by each worker are even, unless a worker took one past
    another whose heartbeat had gone stale (a loaded machine not running it for STALE_S:
    the design takes the connection rather than wait), which the board counts."""
    counts = sorted(held.values())
    if len(set(counts)) > 1:
        passed = board.passed_over() - passed_before
        assert passed.sum() > 0, (held, "uneven with no worker passed over")


def test_connections_opened_together_spread_evenly_over_the_workers(
        tmp_path: Path) -> None:
    """Bursts of connections opened at once, each accepted before a request is sent on
    any (a worker answering its first request is busy: one that stays busy for over
    STALE_S is not waited for, and the others take the connections, as they should)."""
    model = write_model(tmp_path / "model")
    served = serve(*write_run(tmp_path, model.config))
    try:
        pids = served.worker_pids()
        assert len(pids) == 2
        # "loaded in every worker" comes as each acks; each then starts accepting
        every_worker_accepting(served.run_folder(), 2, 30.0)
        board = ConnectionBoard(served.run_folder(), 2)
        request = _request(served.port, model.keys[0][:16])
        passed = board.passed_over()
        for count in (6, 4, 10):
            conns = [socket.create_connection(("127.0.0.1", served.port), timeout=30)
                     for _ in range(count)]
            try:
                _wait_board(board, lambda counts, n=count: counts.sum() == n)  # all accepted
                held = _connections_per_worker(pids, served.port)
                _assert_even_unless_passed_over(held, board, passed)
                passed = board.passed_over()
                for conn in conns:
                    conn.sendall(request)
                assert [_answer_status(conn) for conn in conns] == [200] * count
            finally:
                for conn in conns:
                    conn.close()
            _wait_board(board, lambda counts: not counts.any())  # the closes are in
        board.close()
    finally:
        assert stop(served) == 0


def test_the_board_waits_only_for_workers_with_a_fresh_heartbeat(tmp_path: Path) -> None:
    board = ConnectionBoard(tmp_path, 3)
    other = ConnectionBoard(tmp_path, 3)  # another worker's mapping of the same file
    try:
        assert board.fewest_other(0) is None  # nobody else has beaten yet
        other.publish(1, 4)
        other.publish(2, 2)
        assert board.fewest_other(0) == 2
        assert board.fewest_other(2) == 4
        other.leave(2)  # a worker that drains is not waited for
        assert board.fewest_other(0) == 4
        other.slots[1, 1] -= int(2 * STALE_S * 1e9)  # its heartbeat went stale
        assert board.fewest_other(0) is None
        assert board.others(0) == (None, 4)  # not waited for, but seen: a pass counted
        assert board.others(2) == (None, 4)  # the one that left is neither
    finally:
        other.close()
        board.close()


class _Worker:
    """A worker's accept (`SharedAccept`) on a listening socket of its own, whose
    protocols keep their transports (`made`), counted as `hps serve` counts them."""

    def __init__(self, board: ConnectionBoard, index: int) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0), backlog=64)
        self.made: list[asyncio.BaseTransport] = []
        self.conns: list[socket.socket] = []
        made = self.made

        class Made(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                made.append(transport)

        self.accept = SharedAccept(self.listener, board, index, lambda: len(made))
        self._protocol = self.accept.counted(Made)

    def start(self) -> None:
        self.accept.start(asyncio.get_running_loop(), self._protocol)

    async def connect(self, count: int) -> None:
        """`count` connections opened at once, then until every one is made."""
        port = self.listener.getsockname()[1]
        self.conns += [socket.create_connection(("127.0.0.1", port)) for _ in range(count)]
        while len(self.made) < len(self.conns):
            await asyncio.sleep(0.001)

    async def stop(self) -> None:
        self.accept.stop()
        for transport in self.made:
            transport.close()
        await asyncio.sleep(0.01)  # the closes run

    def close(self) -> None:
        for conn in self.conns:
            conn.close()
        self.listener.close()


def test_a_worker_counts_the_connections_it_took_past_a_stale_one(tmp_path: Path) -> None:
    """Worker 1 holds none and stops beating: worker 0 takes every connection (not
    waiting), and counts each it took while holding more than worker 1."""
    board = ConnectionBoard(tmp_path, 2)
    worker = _Worker(board, 0)

    async def run() -> None:
        board.publish(1, 0)
        board.slots[1, 1] -= int(2 * STALE_S * 1e9)
        worker.start()
        for _ in range(3):
            await worker.connect(1)
        await worker.stop()

    try:
        asyncio.run(asyncio.wait_for(run(), 10))
        assert board.passed_over().tolist() == [2, 0]  # the 2nd and 3rd: 1 and 2 against 0
    finally:
        worker.close()
        board.close()


def test_a_board_file_opened_again_keeps_its_counts(tmp_path: Path) -> None:
    first = ConnectionBoard(tmp_path, 2)
    first.publish(1, 7)
    first.close()
    again = ConnectionBoard(tmp_path, 2)  # a worker started again maps the same file
    try:
        assert again.fewest_other(0) == 7
    finally:
        again.close()


@pytest.mark.parametrize("workers", [1, 4])
def test_the_board_has_a_slot_for_each_worker(tmp_path: Path, workers: int) -> None:
    board = ConnectionBoard(tmp_path, workers)
    try:
        assert board.slots.shape == (workers, 3)
        board.publish(workers - 1, 3)
        assert board.fewest_other(0) == (3 if workers > 1 else None)
    finally:
        board.close()


def test_the_benches_floor_with_workers_spreads_connections_as_hps_serve_does(
        tmp_path: Path) -> None:
    """The floor of `hps bench http --workers N` (hps/tools/bench/bare_workers.py) accepts
    as the workers of `hps serve` do: the two then differ by the service alone. Every
    connection is accepted before a request is sent on any, as in the test above (a
    worker answering its first request for over STALE_S is not waited for: 3/5 on a
    loaded 2-core machine)."""
    from hps.tools.bench.cpus import children
    from hps.tools.bench.http import _bare_server, _free_port, bare_board

    port = _free_port()
    pids: list[int] = []
    with _bare_server(tmp_path, port, 8, None, pids, workers=2):
        workers = dict(enumerate(children(pids[0])))
        assert len(workers) == 2
        body = np.arange(16, dtype="<i8").tobytes()
        request = (f"POST / HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                   f"Content-Length: {len(body)}\r\n\r\n").encode() + body
        board = ConnectionBoard(bare_board(tmp_path, port), 2)
        conns = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(8)]
        try:
            _wait_board(board, lambda counts: counts.sum() == 8)  # all accepted
            _assert_even_unless_passed_over(_connections_per_worker(workers, port), board,
                                            np.zeros(2, np.int64))
            for conn in conns:
                conn.sendall(request)
            assert [_answer_status(conn) for conn in conns] == [200] * 8
        finally:
            for conn in conns:
                conn.close()
            board.close()


class _RecordingBoard(ConnectionBoard):
    """A board that keeps every count its worker published."""

    def __init__(self, folder: Path, workers: int) -> None:
        super().__init__(folder, workers)
        self.published: list[int] = []

    def publish(self, index: int, open_connections: int) -> None:
        self.published.append(open_connections)
        super().publish(index, open_connections)


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_a_burst_of_connections_is_never_counted_twice(tmp_path: Path, loop: str) -> None:
    """Every count a worker publishes (and decides on) is at most the connections it took:
    a connection is counted as accepted until its protocol counts it, and handed over in
    one step. A count one too high made the worker holding 3 of 8 read 4 and leave the
    8th to the other (3/5, no worker passed over)."""
    import uvloop

    board = _RecordingBoard(tmp_path, 1)
    worker = _Worker(board, 0)

    async def run() -> None:
        worker.start()
        for _ in range(4):  # bursts: each connection lands while the last is being made
            await worker.connect(16)
        await asyncio.sleep(3 * 0.01)  # heartbeats after the last is made
        await worker.stop()

    try:
        factory = uvloop.new_event_loop if loop == "uvloop" else asyncio.new_event_loop
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(asyncio.wait_for(run(), 10))
        assert max(board.published) <= 64, board.published
        assert board.published[-1] == 64
    finally:
        worker.close()
        board.close()
