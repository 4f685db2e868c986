"""A real S3 server (moto) on a loopback port, as a pytest plugin (tests/conftest.py loads
it): the model-source tests read models from it, the docs test serves a page's bucket."""

from __future__ import annotations

import contextlib
import logging
import os
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

#: AWS settings the S3 tests run under: fake credentials, no profile or config file, no
#: instance-metadata lookups (which would wait on 169.254.169.254), no endpoint override.
FAKE_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    "AWS_EC2_METADATA_DISABLED": "true",
}
CLEARED_AWS_ENV = (
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_REGION",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_ROLE_ARN",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
)


@dataclass
class S3Server:
    """A running moto S3 server: its endpoint and helpers to fill it."""

    endpoint: str

    def client(self, region: str = "us-east-1", **kwargs: Any) -> Any:
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name=region, **kwargs)

    def new_bucket(self, region: str = "us-east-1") -> str:
        """A fresh bucket (unique name) in `region`."""
        name = f"hps-{uuid.uuid4().hex[:12]}"
        kwargs: dict[str, Any] = {}
        if region != "us-east-1":
            kwargs["CreateBucketConfiguration"] = {"LocationConstraint": region}
        self.client(region).create_bucket(Bucket=name, **kwargs)
        return name

    def put_model(self, bucket: str, prefix: str, keys: np.ndarray, vectors: np.ndarray) -> None:
        """Upload a HugeCTR sparse model folder (`key`, `emb_vector`) under `prefix`."""
        client = self.client()
        client.put_object(Bucket=bucket, Key=f"{prefix}/key", Body=keys.astype("<i8").tobytes())
        client.put_object(
            Bucket=bucket, Key=f"{prefix}/emb_vector", Body=vectors.astype("<f4").tobytes()
        )

    def _set_auth(self, count: str) -> None:
        req = urllib.request.Request(
            f"{self.endpoint}/moto-api/reset-auth",
            data=count.encode(),
            method="POST",
            headers={"Content-Type": "text/plain"},
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            resp.read()

    @contextlib.contextmanager
    def enforced_auth(self) -> Iterator[None]:
        """Within the block, moto checks access keys, signatures and IAM policies."""
        self._set_auth("0")
        try:
            yield
        finally:
            self._set_auth("inf")


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """moto's ThreadedMotoServer on a free 127.0.0.1 port, reached over real HTTP.

    Fake AWS credentials and isolation from the host's AWS config are set here, for the
    server's lifetime only (restored at the end of the session).
    """
    try:
        from moto.server import ThreadedMotoServer
    except ImportError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"moto[server] is needed for the S3 tests: {exc}")
        pytest.skip(f"moto[server] not installed: {exc}")
    werkzeug_log = logging.getLogger("werkzeug")
    old_level = werkzeug_log.level
    werkzeug_log.setLevel(logging.WARNING)  # one access-log line per request otherwise
    with pytest.MonkeyPatch.context() as mp:
        for name in CLEARED_AWS_ENV:
            mp.delenv(name, raising=False)
        for name, value in FAKE_AWS_ENV.items():
            mp.setenv(name, value)
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        try:
            host, port = server.get_host_and_port()
            yield S3Server(f"http://{host}:{port}")
        finally:
            server.stop()
            werkzeug_log.setLevel(old_level)
