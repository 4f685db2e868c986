"""The CPU image's own smoke check: each feature the image serves, run once for real.

    python /app/deploy/smoke_check.py        # in the image, as any user (takes ~30 s)

deploy/Dockerfile.cpu runs it as root in its runtime stage, after the environment and
the base are slimmed (deploy/slim_venv.py: shared libraries stripped, botocore's models
cut to the services used; deploy/slim_base.py: unused standard library parts and its
bytecode), so a slimming step that breaks a feature fails the build, and its imports
write the bytecode the image keeps; scripts/compose_check.sh runs it again in the final
image as its non-root user. In a temporary folder it checks:

- the compiled in-process tier over RocksDB: `hps demo`'s model written, loaded and every
  looked-up vector compared with the files (numba compiles the hash map's kernels
  through the stripped llvmlite; RocksDB through rocksdict);
- the HTTP server: `hps serve` (uvicorn with uvloop and httptools, as deployed) turns
  /readyz 200 and answers a JSON lookup with the files' vectors, bit for bit, and the
  `/docs` page and each Swagger UI file it loads (the ones slim_venv.py keeps);
- S3: hps's S3 source builds its boto3 client from botocore's remaining models and signs
  a request for an object, and an STS client (the credential chain's assume-role and web
  identity providers use it) is built; nothing is sent: the compose check's s3 profile
  reads a model from a real S3 server;
- Redis: the client with its hiredis parser, hps's Redis tier and Redis Streams update
  source import.

Exit status 0 when every check passed; the first failure raises.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np

SERVE_TIMEOUT_S = 120


def check_compiled_tier(folder: Path) -> Path:
    """`hps demo` at a small scale: load into hash map + RocksDB, check every vector."""
    from hps.tools.demo import run_demo

    report = run_demo(folder, scale=0.002)
    assert report.ok, f"demo checks failed: {report}"
    print(f"compiled tier + RocksDB: {report.keys_checked:,} vectors checked, "
          f"{report.mismatches} mismatches", flush=True)
    return folder / "ps.json"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str, body: bytes | None = None) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json"} if body is not None else {}
    request = urllib.request.Request(url, data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def check_http(config: Path, folder: Path) -> None:
    """`hps serve` over a socket: ready, then one JSON lookup equal to the files."""
    from hps.http.docs_page import ASSETS, DOCS_PATH
    from hps.modelfiles.formats.sparse_folder import SparseModelReader

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    # the model's relative RocksDB path resolves against the config's folder
    server = subprocess.Popen(
        [sys.executable, "-m", "hps.tools.cli", "serve", str(config), "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + SERVE_TIMEOUT_S
        while True:
            if server.poll() is not None:
                _, err = server.communicate()
                raise AssertionError(f"hps serve exited: {err.decode()}")
            try:
                if _get(f"{url}/readyz")[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"not ready after {SERVE_TIMEOUT_S} s"
            time.sleep(0.2)
        reader = SparseModelReader(str(folder / "item_category"))
        keys = reader.read_keys(0, min(64, reader.num_keys))
        want = reader.read_vectors(0, keys.size)
        status, body = _get(f"{url}/v1/models/demo/tables/item_category/lookup",
                            json.dumps({"keys": keys.tolist()}).encode())
        assert status == 200, f"lookup answered {status}: {body[:200]!r}"
        got = np.asarray(json.loads(body)["vectors"], dtype=np.float32)
        assert np.array_equal(got, want), "HTTP lookup vectors differ from the files"
        for path in ["/docs"] + [f"{DOCS_PATH}/{name}" for name in ASSETS]:
            status, body = _get(f"{url}{path}")
            assert status == 200 and body, f"{path} answered {status}: {body[:200]!r}"
        print(f"HTTP server: ready, {keys.size} vectors looked up over JSON, equal to the "
              f"files; /docs and its {len(ASSETS)} Swagger UI files served", flush=True)
    finally:
        server.terminate()
        server.wait(timeout=30)


def check_s3() -> None:
    """The S3 source's client and an STS client, from the models botocore kept."""
    import boto3

    from hps.modelfiles.s3 import S3Source
    from hps.modelfiles.source import SourceOptions

    # placeholder credentials of its own: signing needs some, nothing is sent
    os.environ.update(AWS_ACCESS_KEY_ID="smoke", AWS_SECRET_ACCESS_KEY="smoke")
    source = S3Source("s3://hps-smoke/models/demo",
                      SourceOptions(s3_endpoint="http://127.0.0.1:9"))
    try:
        url = source.client.generate_presigned_url(
            "get_object", Params={"Bucket": "hps-smoke", "Key": "models/demo/key"})
    finally:
        source.close()
    assert url.startswith("http://127.0.0.1:9/hps-smoke/models/demo/key?"), url
    boto3.client("sts", region_name="us-east-1").close()
    print("S3: the source's client signs an object request; an STS client is built",
          flush=True)


def check_redis() -> None:
    """redis-py with hiredis, hps's Redis tier and update source (importable)."""
    import redis.utils

    import hps.tiers.redis.tier  # noqa: F401
    import hps.updates.redis_stream  # noqa: F401

    assert redis.utils.HIREDIS_AVAILABLE, "redis-py does not find hiredis"
    print("Redis: client with hiredis, tier and update source import", flush=True)


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="hps-smoke-") as tmp:
        folder = Path(tmp) / "demo"
        config = check_compiled_tier(folder)
        check_http(config, folder)
    check_s3()
    check_redis()
    print("smoke check passed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
