"""Lookups through a published port, checked against the model's files (compose_check.sh).

    python scripts/compose_probe.py exact URL MODEL_DIR [--keys N] [--tier volatile|persistent]
    python scripts/compose_probe.py steady URL MODEL_DIR --seconds S
    python scripts/compose_probe.py recover URL MODEL_DIR [--within S]
    python scripts/compose_probe.py replicas URL MODEL_DIR --replicas a,b
    python scripts/compose_probe.py publish MODEL_DIR NEW_DIR
    python scripts/compose_probe.py reload URL MODEL_DIR --as /models/demo-v2
    python scripts/compose_probe.py scrapes PROMETHEUS_URL MODEL_DIR --targets a,b,c
    python scripts/compose_probe.py compiles URL -

Every lookup is a binary `POST /v1/models/demo/tables/<table>/lookup` of random keys of
the model's files (MODEL_DIR/<table>/key, emb_vector, as `hps demo` writes them) on both
tables, and every answer must equal the files' rows bit for bit. With a token set
(HPS_TOKEN), it is sent. Exit status 0 when every check holds, 1 otherwise (the reason
is printed).

- `exact`: one round; with --tier, the table counters of `GET /v1/models/demo` must show
  that every key of the round was served by that tier (the Redis tier, or RocksDB).
- `steady`: rounds without pause for S seconds (the check kills Redis meanwhile): every
  answer exact, none refused; prints the rounds and the slowest one.
- `recover`: repeats the same keys until the volatile tier serves all of them again
  (rows fetched from RocksDB while Redis was down are written back to it).
- `replicas`: rounds through a load balancer until each named replica (the
  X-HPS-Replica header the balancer adds) has answered exactly; with --converge, rounds
  not exact yet are retried (online updates still on their way) until --within ends.
- `publish`: writes a new version of the model to NEW_DIR (same keys, new vectors): the
  check publishes its tables as online updates (`hps publish`) and reloads them.
- `reload`: `POST /v1/models/demo/reload` of the replica at URL with the tables under
  the container path given by --as (MODEL_DIR is the same folder seen from here), then
  one exact round against MODEL_DIR.
- `scrapes`: Prometheus's /api/v1/targets until every named target is up (scraped
  without error), and no other target is there. MODEL_DIR is not read.
- `compiles`: the service's `hps_compiles_total` (/metrics) by phase: none may be
  counted after ready (a lookup path that compiled, or read numba's cache, while clients
  were served: what ready means to prevent). MODEL_DIR is not read.

Standard library and NumPy only (no hps import: it checks the served containers).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np

MODEL = "demo"
TABLES = {"user_item": 16, "item_category": 64}
TIER_COUNTERS = {"volatile": "volatile_hits", "persistent": "persistent_hits"}
OCTET_STREAM, JSON = "application/octet-stream", "application/json"


class ProbeFailure(Exception):
    """A check that did not hold."""


def read_table(model_dir: Path, table: str, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """(keys int64[n], vectors float32[n, dim]) of one sparse model folder."""
    keys = np.fromfile(model_dir / table / "key", "<i8")
    vectors = np.fromfile(model_dir / table / "emb_vector", "<f4").reshape(-1, dim)
    if keys.size != vectors.shape[0]:
        raise ProbeFailure(f"{model_dir / table}: {keys.size} keys, {vectors.shape[0]} rows")
    return keys, vectors


def request(url: str, data: bytes | None = None, media: str = OCTET_STREAM
            ) -> tuple[bytes, dict[str, str]]:
    """(body, headers) of a GET, or of a POST of `data` as `media`; raises unless 200."""
    headers = {"Content-Type": media} if data is not None else {}
    token = os.environ.get("HPS_TOKEN")
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as answer:
            return answer.read(), dict(answer.headers)
    except urllib.error.HTTPError as exc:
        raise ProbeFailure(f"{url}: {exc.code} {exc.read()[:300]!r}") from None
    except OSError as exc:
        raise ProbeFailure(f"{url}: {exc}") from None


class Probe:
    """The model's files and the service's URL; one round = one lookup per table."""

    def __init__(self, url: str, model_dir: Path, keys: int) -> None:
        self.url = url.rstrip("/")
        self.files = {t: read_table(model_dir, t, d) for t, d in TABLES.items()}
        self.count = keys
        self.rng = np.random.default_rng()

    def draw(self) -> dict[str, np.ndarray]:
        """Rows to look up: random, with repeats, per table."""
        return {t: self.rng.integers(0, keys.size, self.count)
                for t, (keys, _) in self.files.items()}

    def round(self, rows: dict[str, np.ndarray]) -> set[str]:
        """Look up the keys of `rows`; raises unless every vector is exact.

        Returns the replicas that answered (the X-HPS-Replica header), if any.
        """
        replicas = set()
        for table, picked in rows.items():
            keys, vectors = self.files[table]
            body, headers = request(f"{self.url}/v1/models/{MODEL}/tables/{table}/lookup",
                                    keys[picked].astype("<i8").tobytes())
            got = np.frombuffer(body, "<f4").reshape(picked.size, -1)
            if not np.array_equal(got, vectors[picked]):
                wrong = int((got != vectors[picked]).any(axis=1).sum())
                raise ProbeFailure(f"{table}: {wrong} of {picked.size} vectors differ "
                                   f"from the model's files ({self.url})")
            replica = headers.get("X-HPS-Replica") or headers.get("x-hps-replica")
            if replica:
                replicas.add(replica)
        return replicas

    def counters(self) -> dict[str, dict[str, int]]:
        """Per table: the lookup counters of `GET /v1/models/demo`."""
        body, _ = request(f"{self.url}/v1/models/{MODEL}")
        return {t["name"]: t["stats"] for t in json.loads(body)["tables"]}


def served_by(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]],
              tier: str) -> tuple[int, int]:
    """(keys the tier served, keys looked up) between two counter readings."""
    name = TIER_COUNTERS[tier]
    hits = sum(after[t][name] - before[t][name] for t in TABLES)
    keys = sum(after[t]["keys"] - before[t]["keys"] for t in TABLES)
    return hits, keys


def exact(probe: Probe, tier: str | None) -> str:
    before = probe.counters() if tier else None
    probe.round(probe.draw())
    if tier is None or before is None:
        return f"{2 * probe.count} keys, every vector exact"
    hits, keys = served_by(before, probe.counters(), tier)
    if hits != keys:
        raise ProbeFailure(f"the {tier} tier served {hits} of {keys} keys")
    return f"{keys} keys, every vector exact, all {keys} served by the {tier} tier"


def steady(probe: Probe, seconds: float) -> str:
    rounds, slowest = 0, 0.0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        started = time.perf_counter()
        probe.round(probe.draw())
        slowest = max(slowest, time.perf_counter() - started)
        rounds += 1
    return (f"{rounds} rounds in {seconds:.0f} s ({2 * rounds * probe.count} keys), every "
            f"vector exact, none refused; slowest round {slowest * 1000:.0f} ms")


def recover(probe: Probe, within: float) -> str:
    rows = probe.draw()
    deadline = time.monotonic() + within
    attempts = 0
    while True:
        before = probe.counters()
        probe.round(rows)
        attempts += 1
        hits, keys = served_by(before, probe.counters(), "volatile")
        if hits == keys:
            return (f"the volatile tier serves all {keys} keys again "
                    f"(round {attempts}), every vector exact")
        if time.monotonic() > deadline:
            raise ProbeFailure(f"after {within:.0f} s the volatile tier serves {hits} of "
                               f"{keys} keys")
        time.sleep(0.5)


def replicas(probe: Probe, names: set[str], within: float, converge: bool) -> str:
    """Rounds until every named replica answered exactly; with `converge`, rounds that
    are not exact yet (updates still on their way) are retried until `within` ends."""
    seen: set[str] = set()
    rounds = inexact = 0
    deadline = time.monotonic() + within
    while not names <= seen:
        rounds += 1
        try:
            seen |= probe.round(probe.draw())
        except ProbeFailure:
            if not converge or time.monotonic() > deadline:
                raise
            inexact += 1
            seen = set()  # every replica must answer exactly from here on
            time.sleep(0.2)
        if time.monotonic() > deadline:
            raise ProbeFailure(f"replicas {sorted(names - seen)} never answered "
                               f"(answered: {sorted(seen)})")
    waited = f", after {inexact} rounds not exact yet" if converge else ""
    return f"replicas {', '.join(sorted(seen))} answered exactly ({rounds} rounds{waited})"


def publish(model_dir: Path, new_dir: Path) -> str:
    rng = np.random.default_rng()
    for table, dim in TABLES.items():
        keys, _ = read_table(model_dir, table, dim)
        (new_dir / table).mkdir(parents=True, exist_ok=True)
        keys.astype("<i8").tofile(new_dir / table / "key")
        rng.standard_normal((keys.size, dim), dtype=np.float32).tofile(
            new_dir / table / "emb_vector")
    return f"new vectors for every key of {', '.join(TABLES)} in {new_dir}"


def reload(probe: Probe, container_dir: str) -> str:
    files = [f"{container_dir.rstrip('/')}/{table}" for table in TABLES]
    body, _ = request(f"{probe.url}/v1/models/{MODEL}/reload",
                      json.dumps({"sparse_files": files}).encode(), JSON)
    seconds = json.loads(body)["seconds"]
    probe.round(probe.draw())
    return f"reloaded from {container_dir} in {seconds:.1f} s, every vector exact"


def scrapes(prometheus: str, names: set[str], within: float) -> str:
    deadline = time.monotonic() + within
    while True:
        body, _ = request(f"{prometheus.rstrip('/')}/api/v1/targets?state=active")
        targets = {t["labels"].get("instance", ""): t
                   for t in json.loads(body)["data"]["activeTargets"]}
        up = {name for name, t in targets.items() if t["health"] == "up"}
        if up == names == set(targets):
            return "every target up: " + ", ".join(
                f"{n} ({targets[n]['lastScrapeDuration'] * 1000:.0f} ms)" for n in sorted(names))
        if time.monotonic() > deadline:
            state = {n: (t["health"], t.get("lastError", "")) for n, t in targets.items()}
            raise ProbeFailure(f"expected {sorted(names)} up, targets are {state}")
        time.sleep(1)


def compiles(url: str) -> str:
    body, _ = request(f"{url.rstrip('/')}/metrics")
    counted = {}
    for line in body.decode().splitlines():
        if line.startswith("hps_compiles_total{"):
            phase = line.split('phase="', 1)[1].split('"', 1)[0]
            counted[phase] = float(line.rsplit(" ", 1)[1])
    if "after_ready" not in counted:
        raise ProbeFailure('no hps_compiles_total{phase="after_ready"} in /metrics')
    if counted["after_ready"]:
        raise ProbeFailure(f"{counted['after_ready']:.0f} compiles after ready "
                           f"(hps_compiles_total: {counted})")
    return (f"hps_compiles_total: {counted.get('load', 0):.0f} while loading (compiled or "
            f"read from numba's cache), {counted.get('before_ready', 0):.0f} else before "
            "ready, 0 after ready")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=["exact", "steady", "recover", "replicas", "publish",
                                         "reload", "scrapes", "compiles"])
    parser.add_argument("url")
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--keys", type=int, default=500, help="keys per table and round")
    parser.add_argument("--tier", choices=sorted(TIER_COUNTERS))
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--within", type=float, default=30.0)
    parser.add_argument("--replicas", default="")
    parser.add_argument("--converge", action="store_true",
                        help="replicas: retry rounds that are not exact yet until --within")
    parser.add_argument("--targets", default="")
    parser.add_argument("--as", dest="container_dir", default="")
    args = parser.parse_args(argv)
    try:
        if args.mode == "publish":  # publish MODEL_DIR NEW_DIR
            print(f"ok   publish: {publish(Path(args.url), args.model_dir)}", flush=True)
            return 0
        if args.mode == "scrapes":
            report = scrapes(args.url, set(filter(None, args.targets.split(","))),
                             args.within)
            print(f"ok   scrapes {args.url}: {report}", flush=True)
            return 0
        if args.mode == "compiles":
            print(f"ok   compiles {args.url}: {compiles(args.url)}", flush=True)
            return 0
        probe = Probe(args.url, args.model_dir, args.keys)
        if args.mode == "reload":
            report = reload(probe, args.container_dir)
        elif args.mode == "exact":
            report = exact(probe, args.tier)
        elif args.mode == "steady":
            report = steady(probe, args.seconds)
        elif args.mode == "recover":
            report = recover(probe, args.within)
        else:
            report = replicas(probe, set(filter(None, args.replicas.split(","))), args.within,
                              args.converge)
    except ProbeFailure as exc:
        print(f"FAIL {args.mode} {args.url}: {exc}", flush=True)
        return 1
    print(f"ok   {args.mode} {args.url}: {report}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
