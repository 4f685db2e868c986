"""Upload the sparse model folders under a local folder to S3 (or MinIO), once.

    python upload_model.py /models/demo s3://hps-models/demo

Every sub-folder holding a `key` and an `emb_vector` file is a table and is uploaded to
`<prefix>/<table>/` (its `slot_id` and `meta` files too, when present); anything else
(the demo's RocksDB, ps.json) stays local. The bucket is created when missing.
Credentials and the endpoint come from the standard AWS environment: AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY, AWS_REGION, and AWS_ENDPOINT_URL for an S3-compatible store.
Exit status 0 when every table is uploaded, 1 otherwise.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from urllib.parse import urlparse

TABLE_FILES = ("key", "emb_vector", "slot_id", "meta")


def tables_under(folder: Path) -> list[Path]:
    """Sub-folders (the folder itself included) that are sparse model tables."""
    found = [p.parent for p in sorted(folder.rglob("key")) if (p.parent / "emb_vector").is_file()]
    return found


def upload(folder: Path, target: str) -> list[str]:
    """Upload every table under `folder` to `target` (s3://bucket/prefix); returns URIs."""
    import boto3
    from botocore.exceptions import ClientError

    parsed = urlparse(target)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise SystemExit(f"target must be s3://bucket/prefix, got {target!r}")
    bucket, prefix = parsed.netloc, parsed.path.strip("/")
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    s3 = boto3.client("s3", region_name=region)
    try:
        s3.head_bucket(Bucket=bucket)
    except ClientError:
        s3.create_bucket(Bucket=bucket)
    tables = tables_under(folder)
    if not tables:
        raise SystemExit(f"no sparse model tables (key + emb_vector) under {folder}")
    uris = []
    for table in tables:
        rel = table.relative_to(folder).as_posix()
        dest = "/".join(p for p in (prefix, "" if rel == "." else rel) if p)
        for name in TABLE_FILES:
            if (table / name).is_file():
                s3.upload_file(str(table / name), bucket, f"{dest}/{name}")
        uris.append(f"s3://{bucket}/{dest}")
        print(f"uploaded {table} → s3://{bucket}/{dest}", flush=True)
    return uris


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    upload(Path(argv[1]), argv[2])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
