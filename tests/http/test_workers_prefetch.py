"""Prefetches under `hps serve --workers 2` (hps/http/workers_prefetch.py): a job asked of
either worker runs in both, its id is unique in the run, and its status answers from
either worker with both workers' parts; the board itself between two workers' views."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from hps.http import workers_prefetch
from hps.http.workers_prefetch import PrefetchBoard, combine
from tests.http.conftest import MODEL, ModelFiles, wait_until, write_model
from tests.http.test_workers import ROOT, Served, serve, stop, write_run


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Served,
                                                                            ModelFiles]]:
    folder = tmp_path_factory.mktemp("workers-prefetch")
    model = write_model(folder / "model")
    config, shm = write_run(folder, model.config)
    served = serve(config, shm)
    yield served, model
    stop(served)


def _status(served: Served, job: str) -> httpx.Response:
    # a new connection each time: either worker may answer
    return httpx.get(f"{served.url}/v1/models/{MODEL}/prefetch/{job}", timeout=30)


def test_a_prefetch_runs_in_every_worker_and_answers_from_either(
        two_workers: tuple[Served, ModelFiles]) -> None:
    served, model = two_workers
    present = model.keys[0][:100]
    absent = np.arange(10**12, 10**12 + 7, dtype=np.int64)  # no tier holds these
    keys = np.concatenate([present, absent, present[:10]]).tolist()  # repeats count once
    jobs: list[str] = []
    for _ in range(40):  # until each worker took some request
        answer = httpx.post(f"{served.url}/v1/models/{MODEL}/prefetch",
                            json={"table": "users", "keys": keys}, timeout=30)
        assert answer.status_code == 202, answer.text
        jobs.append(answer.json()["jobs"][0]["job"])
        if {j.split(".")[0] for j in jobs} == {"w0", "w1"}:
            break
    assert {j.split(".")[0] for j in jobs} == {"w0", "w1"}, jobs
    assert len(set(jobs)) == len(jobs)  # unique in the run, whichever worker took it
    for job in jobs:
        wait_until(lambda job=job: _status(served, job).json()["status"] == "done",
                   timeout=30)
        for _ in range(6):  # never a 404, whichever worker answers
            answer = _status(served, job)
            assert answer.status_code == 200, answer.text
            got = answer.json()
            assert got["job"] == job and got["model"] == MODEL and got["table"] == "users"
            assert got["status"] == "done" and got["error"] is None
            assert (got["keys"], got["found"], got["missing"]) == (107, 100, 7)
            assert got["gpu_inserted"] == 0  # no GPU caches here
            parts = got["workers"]
            assert [p["worker"] for p in parts] == [0, 1]
            assert all(p["status"] == "done" and p["found"] == 100 for p in parts), parts
    # both parts queued: the keys files are gone from the run folder
    board = served.run_folder() / "prefetch"
    wait_until(lambda: not list(board.glob("*.keys.npy")), timeout=10)
    # lookups still answer the model's rows
    lookup = httpx.post(f"{served.url}/v1/models/{MODEL}/tables/users/lookup",
                        json={"keys": present[:5].tolist()}, timeout=30)
    assert np.allclose(np.asarray(lookup.json()["vectors"], np.float32),
                       model.vectors[0][:5])


def test_the_cli_follows_a_prefetch_of_both_workers(
        two_workers: tuple[Served, ModelFiles], tmp_path: Path) -> None:
    served, model = two_workers
    keys_file = tmp_path / "users.keys"
    keys_file.write_bytes(model.keys[0][:500].astype("<i8").tobytes())
    done = subprocess.run(
        [sys.executable, "-m", "hps.tools.cli", "models", "prefetch", MODEL, "--table",
         "users", "--keys-file", str(keys_file), "--wait", "--url", served.url],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert " done: 500 found, 0 in no tier" in done.stdout, done.stdout
    assert "workers: 0 done, 1 done" in done.stdout, done.stdout


@pytest.mark.parametrize("job", ["w0.p999999", "p1", "w0.p1.0", "w0..p1", "w0.p1..%2F..%2Fx"])
def test_unknown_or_malformed_job_ids_are_404(two_workers: tuple[Served, ModelFiles],
                                              job: str) -> None:
    served, _ = two_workers
    for _ in range(4):
        answer = _status(served, job)
        assert answer.status_code == 404, answer.text
        assert answer.json()["error"]["kind"] in ("unknown_job", "not_found")


def test_a_prefetch_of_an_unknown_table_is_refused_before_it_is_announced(
        two_workers: tuple[Served, ModelFiles]) -> None:
    served, _ = two_workers
    board = served.run_folder() / "prefetch"

    def log() -> list[bytes]:
        return [p.read_bytes() for p in sorted(board.glob("requests.*.jsonl"))]

    before = log()
    answer = httpx.post(f"{served.url}/v1/models/{MODEL}/prefetch",
                        json={"table": "nope", "keys": [1, 2]}, timeout=30)
    assert answer.status_code == 404, answer.text
    assert log() == before


def _part(job: str, status: str, found: int = 5, gpu: int = 0, error: str | None = None
          ) -> dict[str, object]:
    return {"job": job, "model": "m", "table": "t", "status": status, "keys": 5,
            "found": found, "volatile_filled": 0, "gpu_inserted": gpu, "missing": 5 - found,
            "seconds": 0.5, "error": error}


def test_the_board_between_two_workers(tmp_path: Path) -> None:
    live = [0, 1]
    leader = PrefetchBoard(tmp_path, 0, lambda: live)
    other = PrefetchBoard(tmp_path, 1, lambda: live)
    keys = np.array([5, 3, 9], np.int64)
    other.announce("w1.p1", "m", "t", keys)
    assert other.new_requests() == []  # its own announcement is not its to take
    (request,) = leader.new_requests()
    assert request == {"job": "w1.p1", "model": "m", "table": "t", "from": 1}
    assert np.array_equal(leader.keys_of(request), keys)
    assert leader.new_requests() == []  # read once
    other.publish(_part("w1.p1", "done", gpu=3))
    assert leader.status("w1.p1")["workers"][0] == {"worker": 0, "status": "queued"}
    assert leader.status("w1.p1")["status"] == "running"  # one part done, one to come
    leader.publish(_part("w1.p1", "running", found=2))
    assert (tmp_path / "prefetch" / "w1.p1.keys.npy").exists() is False  # both took it
    leader.publish(_part("w1.p1", "done", gpu=3))
    got = other.status("w1.p1")
    assert got["status"] == "done" and got["gpu_inserted"] == 6
    assert [p["worker"] for p in got["workers"]] == [0, 1]
    live.remove(1)  # a worker that died is not waited for
    assert leader.status("w1.p1")["workers"] == [got["workers"][0]]
    assert leader.status("../w1.p1") is None and leader.status("w9.p9") is None
    leader.publish(_part("w0.p3", "done"))  # a job of one worker alone (a warm-up's)
    assert not (tmp_path / "prefetch" / "w0.p3.0.json").exists()


def test_a_worker_started_again_skips_the_jobs_before_it(tmp_path: Path) -> None:
    live = [0, 1]
    leader = PrefetchBoard(tmp_path, 0, lambda: live)
    first = PrefetchBoard(tmp_path, 1, lambda: live)
    leader.announce("w0.p1", "m", "t", np.arange(4, dtype=np.int64))
    leader.announce("w0.p2", "m", "t", np.arange(4, dtype=np.int64))
    leader.publish(_part("w0.p1", "done"))
    leader.publish(_part("w0.p2", "done"))
    assert [r["job"] for r in first.new_requests()] == ["w0.p1", "w0.p2"]
    first.publish(_part("w0.p1", "done", gpu=5))
    first.publish(_part("w0.p2", "running"))  # then worker 1 dies
    assert leader.status("w0.p2")["status"] == "running"
    again = PrefetchBoard(tmp_path, 1, lambda: live)  # worker 1 started again
    assert again.new_requests() == []  # it takes only what comes after its start
    assert leader.status("w0.p1")["workers"][1]["gpu_inserted"] == 5  # finished: kept
    got = leader.status("w0.p2")
    assert got["status"] == "done" and got["workers"][1]["status"] == "skipped"


def test_combined_status_of_parts() -> None:
    done, running = _part("w0.p1", "done"), _part("w0.p1", "running", found=1)
    assert combine({0: done, 1: done}, [0, 1])["status"] == "done"
    assert combine({0: done, 1: running}, [0, 1])["status"] == "running"
    assert combine({0: done}, [0, 1])["status"] == "running"
    assert combine({1: _part("w0.p1", "queued")}, [0, 1])["status"] == "queued"
    failed = combine({0: done, 1: _part("w0.p1", "failed", error="worker 1: gone")}, [0, 1])
    assert failed["status"] == "failed" and failed["error"] == "worker 1: gone"
    assert combine({0: _part("w0.p1", "cancelled"), 1: done}, [0, 1])["status"] == "cancelled"
    # the leader's counts, the GPU rows of every worker
    mixed = combine({0: _part("w0.p1", "done", found=4, gpu=4), 1: _part("w0.p1", "done",
                                                                         gpu=5)}, [0, 1])
    assert mixed["found"] == 4 and mixed["gpu_inserted"] == 9


def test_the_request_log_goes_on_in_segments_and_drops_what_was_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(workers_prefetch, "SEGMENT_BYTES", 100)  # two requests a segment
    live = [0, 1]
    leader = PrefetchBoard(tmp_path, 0, lambda: live)
    other = PrefetchBoard(tmp_path, 1, lambda: live)
    keys = np.arange(3, dtype=np.int64)
    taken: list[str] = []
    for n in range(1, 13):
        leader.announce(f"w0.p{n}", "m", "t", keys)
        if n % 3 == 0:  # the other worker reads now and then, across segments
            taken += [r["job"] for r in other.new_requests()]
        assert leader.new_requests() == []  # its own
    taken += [r["job"] for r in other.new_requests()]
    assert taken == [f"w0.p{n}" for n in range(1, 13)]  # each once, in order
    folder = tmp_path / "prefetch"
    segments = sorted(int(p.name.split(".")[1]) for p in folder.glob("requests.*.jsonl"))
    assert len(segments) <= 3 and segments[-1] == 5  # the read ones are gone
    # a worker started again skips the requests of the last two segments
    again = PrefetchBoard(tmp_path, 1, lambda: live)
    skipped = sorted(p.name for p in folder.glob("w0.p*.1.json"))
    assert skipped and len(skipped) <= 4
    assert again.new_requests() == []
    leader.announce("w0.p13", "m", "t", keys)
    assert [r["job"] for r in again.new_requests()] == ["w0.p13"]
