"""The floor of `hps bench http`: a bare ASGI app on uvicorn answering the same bodies.

It reads the request body (little-endian int64 keys, as the binary lookup gets) and
answers `keys × HPS_BARE_DIM × 4` bytes from a buffer made once: no lookup, no framework,
no metrics. Served exactly as `hps serve` serves (uvicorn, same loop and HTTP parser), it
is what the HTTP stack alone costs; the lookup service cannot be faster than this.

    HPS_BARE_DIM=64 python -m uvicorn hps.tools.bench.bare_asgi:app --port 8001
"""

from __future__ import annotations

import os
from typing import Any

_DIM = int(os.environ.get("HPS_BARE_DIM", "64"))
_ROWS = memoryview(bytes(4 * _DIM * (1 << 16)))  # answers up to 65,536 keys


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":  # lifespan: nothing to set up
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
            message = await receive()
        await send({"type": "lifespan.shutdown.complete"})
        return
    size = 0
    while True:
        message = await receive()
        size += len(message.get("body", b""))
        if not message.get("more_body", False):
            break
    body = _ROWS[:(size // 8) * _DIM * 4]
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/octet-stream"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
