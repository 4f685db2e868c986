"""hps.tensorflow on CPU TensorFlow: Init, LookupLayer (dense and ragged keys, eager, inside
tf.function, in a Keras model), SparseLookupLayer's combiners, errors, and the TensorFlow
step of HugeCTR's hpsdlpack.py (capsules of a key tensor and of a tf.zeros output)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's start-up chatter
import tensorflow as tf  # noqa: E402

import hps.tensorflow as hps_tf  # noqa: E402
from hps import ConfigError, KeyTypeError  # noqa: E402
from hps.inference import HPS  # noqa: E402
from hps.server.shared import servers  # noqa: E402
from tests.support.hugectr_flows import MODEL, Model, native_lookup, ps_config, write_model  # noqa: E402


@pytest.fixture(autouse=True)
def _close_servers() -> Iterator[None]:
    yield
    servers.close_all()


@pytest.fixture
def model(tmp_path: Path, rng: np.random.Generator) -> Model:
    return write_model(tmp_path / "model", rng)


@pytest.fixture
def config_file(model: Model, tmp_path: Path) -> str:
    path = tmp_path / "ps.json"
    path.write_text(json.dumps(ps_config(model.files, max_batchsize=64).to_json()))
    return str(path)


def _rows(model: Model, rng: np.random.Generator, batch: int) -> np.ndarray:
    return np.asarray(model.sample(rng, batch)).reshape(batch, -1)


def test_init_then_lookup_eager_and_in_tf_function(model: Model, config_file: str,
                                                   rng: np.random.Generator) -> None:
    assert hps_tf.Init(global_batch_size=64, ps_config_file=config_file) == "OK"
    layer = hps_tf.LookupLayer(model_name=MODEL, table_id=1, emb_vec_size=16,
                               emb_vec_dtype=tf.float32)
    rows = _rows(model, rng, 8)
    keys = tf.constant(rows[:, 2:])
    out = layer(keys)
    assert out.shape == (8, 26, 16) and out.dtype == tf.float32
    np.testing.assert_array_equal(out.numpy().reshape(-1, 16),
                                  model.vectors_of(1, rows[:, 2:].flatten()))
    np.testing.assert_array_equal(layer(tf.cast(keys, tf.int32)).numpy(), out.numpy())
    traced = tf.function(lambda k: layer(k))
    np.testing.assert_array_equal(traced(keys).numpy(), out.numpy())
    other = _rows(model, rng, 3)[:, 2:]  # another batch size through the same trace
    np.testing.assert_array_equal(traced(tf.constant(other)).numpy().reshape(-1, 16),
                                  model.vectors_of(1, other.flatten()))


def test_layers_share_the_server_of_an_open_hps(model: Model, tmp_path: Path,
                                                rng: np.random.Generator) -> None:
    raw = ps_config(model.files, max_batchsize=64).to_json()
    raw["persistent_db"] = {"type": "rocks_db", "path": str(tmp_path / "rocksdb")}
    config = tmp_path / "rocks.json"
    config.write_text(json.dumps(raw))
    with HPS(str(config)) as hps:  # holds the RocksDB store: the layer must share it
        layer = hps_tf.LookupLayer(MODEL, 1, 16, tf.float32, ps_config_file=str(config))
        assert servers.server(layer._handle) is hps.server
        rows = _rows(model, rng, 4)[:, 2:]
        np.testing.assert_array_equal(layer(tf.constant(rows)).numpy().reshape(-1, 16),
                                      hps.lookup(rows, MODEL, 1))
        assert not layer.trainable_weights  # lookups carry no gradient


def test_ragged_keys_and_a_keras_model(model: Model, config_file: str,
                                       rng: np.random.Generator) -> None:
    layer = hps_tf.LookupLayer(MODEL, 1, 16, tf.float32, ps_config_file=config_file)
    rows = _rows(model, rng, 4)[:, 2:]
    ragged = tf.ragged.constant([list(rows[0, :3]), [], list(rows[1, :1])], dtype=tf.int64)
    got = layer(ragged)
    assert isinstance(got, tf.RaggedTensor) and got.shape.as_list() == [3, None, 16]
    np.testing.assert_array_equal(got.flat_values.numpy(),
                                  model.vectors_of(1, ragged.flat_values.numpy()))
    keys = tf.keras.Input(shape=(26,), dtype=tf.int64)
    pooled = tf.keras.layers.GlobalAveragePooling1D()(layer(keys))
    ranker = tf.keras.Model(keys, pooled)
    want = model.vectors_of(1, rows.flatten()).reshape(4, 26, 16).mean(axis=1)
    np.testing.assert_allclose(ranker.predict(rows, verbose=0), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("combiner", ["mean", "sum", "sqrtn"])
def test_sparse_lookup_combiners(model: Model, config_file: str, rng: np.random.Generator,
                                 combiner: str) -> None:
    layer = hps_tf.SparseLookupLayer(MODEL, 1, 16, tf.float32, ps_config_file=config_file)
    ids = _rows(model, rng, 3)[:, 2:]
    # rows of 3, 0 and 2 ids (one repeated), out of canonical order
    indices = [[2, 1], [0, 0], [0, 1], [0, 2], [2, 0]]
    values = [ids[2, 1], ids[0, 0], ids[0, 1], ids[0, 0], ids[2, 0]]
    weights = [0.5, 1.0, 2.0, 3.0, 1.5]
    sp_ids = tf.sparse.SparseTensor(indices, tf.constant(values, tf.int64), [3, 4])
    sp_weights = tf.sparse.SparseTensor(indices, tf.constant(weights, tf.float32), [3, 4])
    vectors = model.vectors_of(1, values)
    w = np.asarray(weights, np.float32)[:, None]
    rows = np.asarray([i for i, _ in indices])
    want = np.zeros((3, 16), np.float32)
    for r in (0, 2):
        mine = rows == r
        total = (vectors[mine] * w[mine]).sum(axis=0)
        scale = {"sum": 1.0, "mean": w[mine].sum(),
                 "sqrtn": np.sqrt((w[mine] ** 2).sum())}[combiner]
        want[r] = total / scale
    got = layer(sp_ids, sp_weights, combiner=combiner)
    # float32 sums of signed terms cancel: near zero only an absolute bound is meaningful
    tol = {"rtol": 1e-5, "atol": 1e-6}
    np.testing.assert_allclose(got.numpy(), want, **tol)
    traced = tf.function(lambda s, t: layer(s, t, combiner=combiner))
    np.testing.assert_allclose(traced(sp_ids, sp_weights).numpy(), want, **tol)
    if combiner == "mean":  # no weights: a plain mean; max_norm clips each vector first
        plain = layer(sp_ids, None).numpy()
        np.testing.assert_allclose(plain[0], vectors[rows == 0].mean(axis=0), **tol)
        clipped = layer(sp_ids, None, max_norm=0.5).numpy()
        norms = np.linalg.norm(vectors, axis=1, keepdims=True)
        capped = vectors * np.minimum(1.0, 0.5 / norms)
        np.testing.assert_allclose(clipped[2], capped[rows == 2].mean(axis=0), **tol)
        ragged = tf.RaggedTensor.from_value_rowids(
            tf.constant(values, tf.int64)[1:4], [0, 0, 0], nrows=1)
        np.testing.assert_allclose(layer(ragged, None).numpy()[0],
                                   vectors[1:4].mean(axis=0), **tol)


def test_errors(model: Model, config_file: str) -> None:
    hps_tf._default_config.clear()  # as in a fresh process: no Init yet
    lazy = hps_tf.LookupLayer(MODEL, 1, 16, tf.float32)
    with pytest.raises(ConfigError, match="call hps.tensorflow.Init"):
        lazy(tf.constant([1], tf.int64))
    with pytest.raises(ConfigError, match="global_batch_size must be a positive integer"):
        hps_tf.Init(global_batch_size=0, ps_config_file=config_file)
    with pytest.raises(ConfigError, match="emb_vec_dtype must be tf.float32"):
        hps_tf.LookupLayer(MODEL, 1, 16, tf.float16, ps_config_file=config_file)
    with pytest.raises(ConfigError, match="emb_vec_size=8 but table 1"):
        hps_tf.LookupLayer(MODEL, 1, 8, tf.float32, ps_config_file=config_file)
    layer = hps_tf.SparseLookupLayer(MODEL, 1, 16, tf.float32, ps_config_file=config_file)
    with pytest.raises(KeyTypeError, match="integer"):
        hps_tf.LookupLayer(MODEL, 1, 16, tf.float32, ps_config_file=config_file)(
            tf.constant([1.0]))
    with pytest.raises(ValueError, match="combiner must be one of"):
        layer(tf.sparse.from_dense(tf.constant([[1]], tf.int64)), None, combiner="max")
    with pytest.raises(TypeError, match="sp_ids must be a SparseTensor"):
        layer(tf.constant([[1]], tf.int64), None)
    assert len(servers) == 1  # every layer of this config shares one server


def test_hpsdlpack_tensorflow_step(model: Model, rng: np.random.Generator) -> None:
    """hpsdlpack.py's TensorFlow CPU step: the keys' capsule and the capsule of a tf.zeros
    output are passed to lookup_fromdlpack; the output is read back from its capsule."""
    cat_input = model.sample(rng, 1)
    with HPS(ps_config(model.files)) as server:
        embedding1, _ = native_lookup(server, cat_input)
        with tf.device("/CPU:0"):
            key_tensor = tf.constant(cat_input[0:2], dtype=tf.int64)
            out_tensor = tf.zeros([1, 2], dtype=tf.float32)
            key_capsule = tf.experimental.dlpack.to_dlpack(key_tensor)
            out_dlcapsule = tf.experimental.dlpack.to_dlpack(out_tensor)
        server.lookup_fromdlpack(key_capsule, out_dlcapsule, MODEL, 0)
        out = tf.experimental.dlpack.from_dlpack(out_dlcapsule)
        np.testing.assert_array_equal(out.numpy(), embedding1.reshape(1, 2))
