"""Online updates: rows published to Kafka or Redis Streams reach every tier of a served
table, its GPU caches included, without a reload.

- `contract.py`: the source and publisher contracts;
- `open.py`: `open_source` / `open_publisher`, the source or publisher a config names;
- `codec.py`: HugeCTR's message (`HCTR`, value size, [key | value] records), as arrays;
- `redis_stream.py`, `kafka.py`: the two sources (and publishers);
- `buffers.py`: reused buffers a round's messages are decoded into;
- `applier.py`: a batch of messages → persistent tier → volatile tier → GPU caches;
- `consumer.py`: the thread that polls, applies, then commits, retrying outages;
- `stats.py`: counters, lag and state for metrics and `/readyz`;
- `publish.py`: writing a model's tables or arrays as update messages (`hps publish`).

The server wires a consumer to its models (hps/server/updates.py); docs/updates.md says
how to run it.
"""

from hps.updates.contract import UpdateMessage, UpdatePublisher, UpdateSource
from hps.updates.open import open_publisher, open_source

__all__ = ["UpdateMessage", "UpdatePublisher", "UpdateSource", "open_publisher", "open_source"]
