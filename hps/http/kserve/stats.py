"""The KServe v2 / Triton statistics extension: per model, inference requests that
succeeded and failed, with their cumulative time, as `tritonclient`'s
`get_inference_statistics` reads them (`GET /v2/models[/{model}]/stats`, gRPC
ModelStatistics).

Both protocols count into one `InferStats` (`Metrics.infer_stats`): the HTTP infer route
on the event loop, gRPC on its worker threads, hence the lock (uncontended, a fraction
of a µs of a request's hundreds). A request counts once its model is known to be
served: one for an unknown model is in no model's figures, as in Triton. Durations are
from the request's arrival at the route to its answer, in ns. `inference_count` and
`execution_count` are the requests that succeeded (each request is one execution here:
nothing is batched across requests); the other durations Triton reports (queue,
compute_*) are not measured apart and stay 0. A reload keeps a model's figures; a
removed model's go with it on the next listing.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from hps.errors import UnknownModelError
from hps.http.kserve.schemas import VERSION

#: Triton's duration fields, in its order; only success and fail are measured here
DURATIONS = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output",
             "cache_hit", "cache_miss")


@dataclass
class ModelInferStats:
    """One model's counters."""

    success_count: int = 0
    success_ns: int = 0
    fail_count: int = 0
    fail_ns: int = 0
    last_inference_ms: int = 0


class InferStats:
    """Success and failure counts and times of inference requests, per model."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._models: dict[str, ModelInferStats] = {}

    def _entry(self, model: str) -> ModelInferStats:
        entry = self._models.get(model)
        if entry is None:
            entry = self._models[model] = ModelInferStats()
        return entry

    def success(self, model: str, ns: int) -> None:
        """Count one request of `model` answered after `ns` nanoseconds."""
        with self._lock:
            entry = self._entry(model)
            entry.success_count += 1
            entry.success_ns += ns
            entry.last_inference_ms = int(time.time() * 1000)

    def fail(self, model: str, ns: int) -> None:
        """Count one request of `model` that failed after `ns` nanoseconds."""
        with self._lock:
            entry = self._entry(model)
            entry.fail_count += 1
            entry.fail_ns += ns

    def model_stats(self, served: list[str], model: str = "", version: str = ""
                    ) -> list[dict[str, Any]]:
        """Triton's `model_stats` list: of `model` (UnknownModelError unless it is among
        `served`), or of every served model when `model` is empty."""
        if model:
            if model not in served or version not in ("", VERSION):
                raise UnknownModelError(f"no model {model!r}"
                                        + (f" version {version!r}" if version else "")
                                        + f" is served (models: {', '.join(served)})")
            names = [model]
        else:
            names = sorted(served)
        with self._lock:
            entries = {n: ModelInferStats(**self._entry(n).__dict__) for n in names}
        return [_as_triton(name, entry) for name, entry in entries.items()]


def _as_triton(name: str, entry: ModelInferStats) -> dict[str, Any]:
    durations = {field: {"count": 0, "ns": 0} for field in DURATIONS}
    durations["success"] = {"count": entry.success_count, "ns": entry.success_ns}
    durations["fail"] = {"count": entry.fail_count, "ns": entry.fail_ns}
    return {"name": name, "version": VERSION, "last_inference": entry.last_inference_ms,
            "inference_count": entry.success_count, "execution_count": entry.success_count,
            "inference_stats": durations, "batch_stats": []}
