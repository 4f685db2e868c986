"""hps.torch.LookupLayer on CPU tensors: shapes, values, the shared server registry,
torch.compile(fullgraph=True) through the custom op, concurrency, and its benchmark.
tests/test_hugectr_compat_gpu.py runs the layer on CUDA tensors."""

from __future__ import annotations

import json
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hps import ConfigError, KeyTypeError, TierSetupError, UnknownModelError, UnknownTableError
from hps.inference import HPS
from hps.server.shared import servers
from hps.tools.bench.torch_layer import bench_torch_layer
from hps.torch import LookupLayer, close_servers
from tests.support.hugectr_flows import MODEL, Model, ps_config, write_model


@pytest.fixture(autouse=True)
def _close_servers() -> Iterator[None]:
    yield
    close_servers()


@pytest.fixture
def model(tmp_path: Path, rng: np.random.Generator) -> Model:
    return write_model(tmp_path / "model", rng)


@pytest.fixture
def config_file(model: Model, tmp_path: Path) -> Path:
    path = tmp_path / "ps.json"
    path.write_text(json.dumps(ps_config(model.files, max_batchsize=32).to_json()))
    return path


def _keys(model: Model, rng: np.random.Generator, batch: int) -> tuple[torch.Tensor, ...]:
    rows = np.asarray(model.sample(rng, batch)).reshape(batch, -1)
    return torch.as_tensor(rows[:, :2]), torch.as_tensor(rows[:, 2:])


class Ranker(torch.nn.Module):
    """A model as users wrap the plugin's layers: one layer per table, then dense layers."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.wide = LookupLayer(config, MODEL, 0, 1)
        self.deep = LookupLayer(config, MODEL, 1, 16)
        self.mlp = torch.nn.Linear(16, 1)

    def forward(self, wide_keys: torch.Tensor, deep_keys: torch.Tensor) -> torch.Tensor:
        deep = self.mlp(self.deep(deep_keys).mean(dim=1)).squeeze(1)
        return deep + self.wide(wide_keys).sum(dim=(1, 2))


def test_forward_shape_values_and_device(model: Model, config_file: Path,
                                         rng: np.random.Generator) -> None:
    layer = LookupLayer(str(config_file), MODEL, 1, 16)
    _, deep = _keys(model, rng, 32)
    out = layer(deep)
    assert not out.requires_grad and out.grad_fn is None  # served, not trained
    assert out.shape == (32, 26, 16) and out.dtype == torch.float32 and out.device == deep.device
    np.testing.assert_array_equal(out.reshape(-1, 16).numpy(),
                                  model.vectors_of(1, deep.reshape(-1).numpy()))
    assert layer(deep[:0]).shape == (0, 26, 16)
    np.testing.assert_array_equal(layer(deep.to(torch.int32)).numpy(), out.numpy())
    assert "emb_vec_size=16" in repr(layer)


def test_layers_share_one_server_per_config(model: Model, config_file: Path, tmp_path: Path
                                            ) -> None:
    link = tmp_path / "link.json"
    link.symlink_to(config_file)
    by_path = [LookupLayer(p, MODEL, 1, 16) for p in (str(config_file), config_file, link)]
    assert len({layer._handle for layer in by_path}) == 1
    config = ps_config(model.files, max_batchsize=32)
    first, second = LookupLayer(config, MODEL, 0, 1), LookupLayer(config, MODEL, 1, 16)
    assert first._handle == second._handle != by_path[0]._handle
    other = LookupLayer(ps_config(model.files, max_batchsize=32), MODEL, 1, 16)
    assert other._handle not in (first._handle, by_path[0]._handle)


def _rocksdb_config(model: Model, tmp_path: Path, name: str) -> Path:
    raw = ps_config(model.files, max_batchsize=32).to_json()
    raw["persistent_db"] = {"type": "rocks_db", "path": str(tmp_path / "rocksdb")}
    path = tmp_path / name
    path.write_text(json.dumps(raw))
    return path


def test_layer_shares_the_server_of_an_open_hps(model: Model, tmp_path: Path,
                                                rng: np.random.Generator) -> None:
    """An HPS and a layer of the same config share one server: a second one would find
    the RocksDB store locked by the first."""
    config = _rocksdb_config(model, tmp_path, "ps.json")
    hps = HPS(str(config))
    layer = LookupLayer(config, MODEL, 1, 16)  # the same file, spelled as a Path
    assert servers.server(layer._handle) is hps.server
    with HPS(tmp_path / "." / "ps.json") as again:  # a third user, let go at once
        assert again.server is hps.server
    _, deep = _keys(model, rng, 8)
    want = model.vectors_of(1, deep.reshape(-1).numpy())
    np.testing.assert_array_equal(hps.lookup(deep.numpy(), MODEL, 1), want)
    keys = deep.numpy().reshape(-1)  # uint64, as the KeyTypeError message lists it
    np.testing.assert_array_equal(hps.lookup(keys.view(np.uint64), MODEL, 1), want)
    hps.close()  # the layer still holds the server
    hps.close()  # a second close changes nothing
    np.testing.assert_array_equal(layer(deep).reshape(-1, 16).numpy(), want)
    close_servers()  # the last user: the store is closed and can be opened anew
    with HPS(config) as reopened:
        np.testing.assert_array_equal(reopened.lookup(deep.numpy(), MODEL, 1), want)


def test_a_store_open_in_this_process_is_named_so(model: Model, tmp_path: Path) -> None:
    """Two configs naming one RocksDB path cannot share a server: the error says that
    this very process holds the store, not another one."""
    with HPS(_rocksdb_config(model, tmp_path, "first.json")):
        with pytest.raises(TierSetupError, match="this process already has it open") as err:
            LookupLayer(_rocksdb_config(model, tmp_path, "second.json"), MODEL, 1, 16)
        assert "another process" not in str(err.value)
        assert "same config file" in str(err.value)  # the fix
    assert len(servers) == 0  # the failed layer registered nothing


def test_bad_arguments_and_keys(config_file: Path) -> None:
    with pytest.raises(ConfigError, match="emb_vec_size=8 but table 1 .* has width 16"):
        LookupLayer(config_file, MODEL, 1, 8)
    with pytest.raises(UnknownModelError, match="no model named 'other'"):
        LookupLayer(config_file, "other", 0, 1)
    with pytest.raises(UnknownTableError):
        LookupLayer(config_file, MODEL, 2, 16)
    with pytest.raises(UnknownTableError, match="table_id must be the table's index"):
        LookupLayer(config_file, MODEL, "sparse_embedding1", 16)  # type: ignore[arg-type]
    layer = LookupLayer(config_file, MODEL, 1, 16)
    with pytest.raises(KeyTypeError, match=r"integers \(int64, uint64, int32, uint32 or "
                                           r"narrower\), got dtype float32"):
        layer(torch.zeros(4))


def test_compile_fullgraph_traces_the_custom_op(model: Model, config_file: Path,
                                                rng: np.random.Generator) -> None:
    ranker = Ranker(str(config_file))
    wide, deep = _keys(model, rng, 8)
    expected = ranker(wide, deep)
    graphs: list[torch.fx.GraphModule] = []

    def record(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    got = torch.compile(ranker, fullgraph=True, backend=record)(wide, deep)
    assert len(graphs) == 1  # fullgraph: one graph, or an error at a break
    targets = [node.target for node in graphs[0].graph.nodes if node.op == "call_function"]
    assert targets.count(torch.ops.hps.lookup.default) == 2
    torch.testing.assert_close(got, expected)
    # AOTAutograd traces the op with fake tensors: its fake implementation gives the shapes
    aot = torch.compile(ranker, fullgraph=True, backend="aot_eager")
    for batch in (8, 3):
        wide, deep = _keys(model, rng, batch)
        torch.testing.assert_close(aot(wide, deep), ranker(wide, deep))


def test_op_and_its_fake_agree(model: Model, config_file: Path, rng: np.random.Generator
                               ) -> None:
    layer = LookupLayer(config_file, MODEL, 1, 16)
    _, deep = _keys(model, rng, 4)
    args = (deep, layer._handle, MODEL, 1, 16, 0)
    torch.library.opcheck(torch.ops.hps.lookup.default, args)
    np.testing.assert_array_equal(torch.ops.hps.lookup(*args).numpy(), layer(deep).numpy())


def test_concurrent_layers_and_lookups(model: Model, config_file: Path,
                                       rng: np.random.Generator) -> None:
    """Threads racing to build layers from one config start one server; lookups from
    threads and from torch.jit.fork each get their own keys' vectors."""
    layers: list[LookupLayer] = []
    errors: list[BaseException] = []
    start = threading.Barrier(6)

    def build() -> None:
        try:
            start.wait()
            layers.append(LookupLayer(str(config_file), MODEL, 1, 16))
        except BaseException as exc:  # reported by the assert below
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len({layer._handle for layer in layers}) == 1
    assert len(servers) == 1
    batches = [_keys(model, rng, 16)[1] for _ in range(24)]
    expected = [model.vectors_of(1, b.reshape(-1).numpy()).reshape(16, 26, 16) for b in batches]
    results: dict[int, np.ndarray] = {}

    def run(i: int) -> None:
        results[i] = layers[i % len(layers)](batches[i]).numpy()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(batches))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, want in enumerate(expected):
        np.testing.assert_array_equal(results[i], want)
    with warnings.catch_warnings():  # deprecated in PyTorch 2.13, still what plugin users call
        warnings.simplefilter("ignore", DeprecationWarning)
        futures = [torch.jit.fork(layers[0], b) for b in batches]
        forked = [torch.jit.wait(future).numpy() for future in futures]
    for got, want in zip(forked, expected, strict=True):
        np.testing.assert_array_equal(got, want)


def test_closed_servers_are_reported(config_file: Path) -> None:
    layer = LookupLayer(config_file, MODEL, 1, 16)
    close_servers()
    with pytest.raises(ConfigError, match="closed"):
        layer(torch.zeros(2, dtype=torch.int64))


def test_bench_runs_small() -> None:
    rows = bench_torch_layer(keys=200, dim=8, table_keys=1000, rounds=2, calls=2)
    assert [r["name"] for r in rows] == [
        "lookup_fromdlpack", "lookup_fromdlpack + torch.empty", "LookupLayer",
        "torch.ops.hps.lookup", "torch.compile(layer)"]
    assert rows[0]["vs_baseline"] == 1.0 and all(r["us_per_call"] > 0 for r in rows)


def test_hooks_and_tracing_still_see_the_layer(model: Model, config_file: Path,
                                               rng: np.random.Generator) -> None:
    """The layer skips Module.__call__ only where it would do nothing: hooks on the
    layer, global module hooks and Module.compile still take effect."""
    layer = LookupLayer(str(config_file), MODEL, 1, 16)
    keys = torch.as_tensor(np.asarray(model.sample(rng, 3)).reshape(3, -1)[:, 2:])
    plain = layer(keys)
    seen: list[str] = []
    handle = layer.register_forward_pre_hook(lambda m, args: seen.append("pre"))
    doubled = layer.register_forward_hook(lambda m, args, out: out * 2)
    torch.testing.assert_close(layer(keys), plain * 2)
    handle.remove()
    doubled.remove()
    glob = torch.nn.modules.module.register_module_forward_hook(
        lambda m, args, out: seen.append(type(m).__name__))
    try:
        layer(keys)
    finally:
        glob.remove()
    assert seen == ["pre", "LookupLayer"]
    torch.testing.assert_close(layer(keys), plain)  # no hooks left: the plain call again
    layer.compile(fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(layer(keys), plain)
    assert layer._compiled_call_impl is not None
