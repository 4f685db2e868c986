"""HugeCTR's HPS test flows on a GPU: the same calls, shapes and config objects as
tests/test_hugectr_compat.py (tests/support/hugectr_flows.py), now with the GPU cache attached:
Dynamic, UVM and Static agreeing (each served by its own table), torch CPU and CUDA
capsules agreeing with `lookup`, and hps.torch.LookupLayer on CUDA keys, eager and
compiled."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hps.inference import HPS, EmbeddingCacheType_t
from tests.support.hugectr_flows import (
    CACHE_TYPES,
    MODEL,
    Model,
    native_lookup,
    ps_config,
    torch_dlpack_lookup,
    write_model,
)

pytestmark = pytest.mark.gpu


@pytest.fixture
def torch() -> Any:
    return pytest.importorskip("torch")


@pytest.fixture
def model(tmp_path: Path, rng: np.random.Generator) -> Model:
    return write_model(tmp_path / "model", rng)


@pytest.fixture
def close_layers() -> Iterator[None]:
    yield
    from hps.torch import close_servers

    close_servers()


def _gpu_tables(server: HPS) -> list[Any]:
    tables = server.server.model(MODEL).tables
    assert all(0 in t.gpu for t in tables), "the server did not attach GPU tables"
    return [t.gpu[0] for t in tables]


def test_hpsdlpack_flow(torch: Any, model: Model, rng: np.random.Generator) -> None:
    cat_input = model.sample(rng, 1)
    with HPS(ps_config(model.files)) as server:
        gpu = _gpu_tables(server)
        embedding1, embedding2 = native_lookup(server, cat_input)
        np.testing.assert_array_equal(embedding1.reshape(2, 1), model.vectors_of(0, cat_input[:2]))
        np.testing.assert_array_equal(embedding2.reshape(26, 16),
                                      model.vectors_of(1, cat_input[2:]))
        for device in ("cpu", "cuda:0"):
            np.testing.assert_array_equal(torch_dlpack_lookup(server, cat_input, device),
                                          embedding2.reshape(1, 26 * 16))
        assert gpu[1].stats()["hits"] > 0  # the later lookups hit what the first inserted


def test_cache_types_agree(model: Model, rng: np.random.Generator) -> None:
    batches = [model.sample(rng, 1), model.sample(rng, 10)]
    results: dict[EmbeddingCacheType_t, list[tuple[np.ndarray, np.ndarray]]] = {}
    for cache_type in CACHE_TYPES:
        with HPS(ps_config(model.files, max_batchsize=10, cache_type=cache_type)) as server:
            gpu = _gpu_tables(server)
            want = {EmbeddingCacheType_t.Static: "static",
                    EmbeddingCacheType_t.UVM: "uvm"}.get(cache_type, "dynamic")
            assert gpu[1].mode == want
            results[cache_type] = [native_lookup(server, batches[0]),
                                   native_lookup(server, batches[1], batch_size=10),
                                   native_lookup(server, batches[0])]  # now from the cache
    dynamic = results[EmbeddingCacheType_t.Dynamic]
    np.testing.assert_array_equal(dynamic[0][1].reshape(26, 16),
                                  model.vectors_of(1, batches[0][2:]))
    for cache_type in (EmbeddingCacheType_t.UVM, EmbeddingCacheType_t.Static):
        for got, want in zip(results[cache_type], dynamic, strict=True):
            np.testing.assert_array_equal(got[0], want[0])
            np.testing.assert_array_equal(got[1], want[1])


def test_lookup_layer_on_cuda(torch: Any, model: Model, rng: np.random.Generator,
                              close_layers: None) -> None:
    from hps.torch import LookupLayer

    config = ps_config(model.files, max_batchsize=32)
    deep = LookupLayer(config, MODEL, 1, 16)
    wide = LookupLayer(config, MODEL, 0, 1)
    rows = np.asarray(model.sample(rng, 32)).reshape(32, -1)
    keys = torch.as_tensor(rows[:, 2:], device="cuda")
    out = deep(keys)
    assert out.shape == (32, 26, 16) and out.device == keys.device
    np.testing.assert_array_equal(out.cpu().numpy().reshape(-1, 16),
                                  model.vectors_of(1, rows[:, 2:].flatten()))

    def rank(wide_keys: Any, deep_keys: Any) -> Any:
        return deep(deep_keys).sum(dim=(1, 2)) + wide(wide_keys).sum(dim=(1, 2))

    wide_keys = torch.as_tensor(rows[:, :2], device="cuda")
    compiled = torch.compile(rank, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(wide_keys, keys), rank(wide_keys, keys))


def test_lookup_layer_spare_outputs(torch: Any, model: Model, rng: np.random.Generator,
                                    close_layers: None) -> None:
    """The layer's next output, allocated while the GPU answers (hps/gpu/overlap.py), is
    used only for the same shape, device and stream, and never aliases an output the
    caller still holds."""
    from hps.torch import LookupLayer

    layer = LookupLayer(ps_config(model.files, max_batchsize=32), MODEL, 1, 16)
    batches = [np.asarray(model.sample(rng, 8)).reshape(8, -1)[:, 2:] for _ in range(6)]
    held = []
    for rows in batches:  # same shape: every call after the first takes the spare
        spare = layer._spares[-1][0].data_ptr() if layer._spares else None
        out = layer(torch.as_tensor(rows, device="cuda"))
        assert spare is None or out.data_ptr() == spare
        held.append((out, rows))
    for out, rows in held:  # no output was overwritten by a later call
        np.testing.assert_array_equal(out.cpu().numpy().reshape(-1, 16),
                                      model.vectors_of(1, rows.flatten()))
    assert len({out.data_ptr() for out, _ in held}) == len(held)

    spare = layer._spares[-1][0].data_ptr()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # another stream: the spare is not used
        keys = torch.as_tensor(batches[0], device="cuda")
        out = layer(keys)
    side.synchronize()
    assert out.data_ptr() != spare
    np.testing.assert_array_equal(out.cpu().numpy().reshape(-1, 16),
                                  model.vectors_of(1, batches[0].flatten()))
    narrow = layer(torch.as_tensor(batches[1][:, :5], device="cuda"))  # another shape
    assert narrow.shape == (8, 5, 16)
    np.testing.assert_array_equal(narrow.cpu().numpy().reshape(-1, 16),
                                  model.vectors_of(1, batches[1][:, :5].flatten()))


def test_lookup_layer_returned_outputs(torch: Any, model: Model, rng: np.random.Generator,
                                      close_layers: None) -> None:
    """Outputs the layer returned are held only until its next GPU wait: one the caller
    dropped then goes back to the allocator (device memory stays flat over many calls), one
    the caller keeps is never reused, and calls that queue no kernel hold a bounded few."""
    from hps.torch import LookupLayer

    layer = LookupLayer(ps_config(model.files, max_batchsize=32), MODEL, 1, 16)
    rows = np.asarray(model.sample(rng, 8)).reshape(8, -1)[:, 2:]
    keys = torch.as_tensor(rows, device="cuda")
    kept = layer(keys)
    torch.cuda.synchronize()
    layer(keys)  # dropped at once
    before = torch.cuda.memory_allocated()
    for _ in range(50):
        layer(keys)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before
    assert len(layer._returned) == 1  # the last call's output; the others were let go
    np.testing.assert_array_equal(kept.cpu().numpy().reshape(-1, 16),
                                  model.vectors_of(1, rows.flatten()))

    empty = torch.empty((0, 26), dtype=torch.int64, device="cuda")
    for _ in range(20):  # no kernel, so no GPU wait to let go in: bounded on the spot
        assert layer(empty).shape == (0, 26, 16)
    assert len(layer._returned) <= 4


def test_lookup_layer_threads(torch: Any, model: Model, rng: np.random.Generator,
                              close_layers: None) -> None:
    """Threads sharing one layer (and its spares) each get their own, right vectors."""
    from concurrent.futures import ThreadPoolExecutor

    from hps.torch import LookupLayer

    layer = LookupLayer(ps_config(model.files, max_batchsize=32), MODEL, 1, 16)
    work = [np.asarray(model.sample(rng, 4)).reshape(4, -1)[:, 2:] for _ in range(200)]

    def run(rows: np.ndarray) -> tuple[Any, np.ndarray]:
        return layer(torch.as_tensor(rows, device="cuda")), rows

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(run, work))
    torch.cuda.synchronize()
    for out, rows in results:
        np.testing.assert_array_equal(out.cpu().numpy().reshape(-1, 16),
                                      model.vectors_of(1, rows.flatten()))
    assert len({out.data_ptr() for out, _ in results}) == len(results)
    assert len(layer._spares) <= 4
