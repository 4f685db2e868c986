"""Compact storage in the GPU tiers (hps/rows/gpu_layout.py): for each cache type (dynamic,
static, uvm) and storage type (float16, bfloat16, int8), lookups against hps/rows/storage_types.py's
reference (random and adversarial rows: constant rows, huge ranges, tiny values, an
outlier), bit for bit and within the type's error bound; misses and defaults exact;
16-bit outputs; updates and uvm promotion; memory figures against the device's own
count; the public call with torch outputs; bad options and unencodable rows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hps import write_sparse_model
from hps.api import HPS
from hps.errors import ConfigError, LookupInputError, OutputBufferError
from hps.gpu.dynamic_cache import EMPTY_KEY, EmbeddingCache
from hps.gpu.launch_shape import PIPELINED_AFTER
from hps.gpu.static_table import StaticEmbeddingTable
from hps.gpu.uvm_table import NO_ROW, UvmEmbeddingTable
from hps.rows.gpu_layout import OUTPUT_CODES, stored_row_bytes
from hps.rows.storage_types import decode, encode, error_bound, storage_type

pytestmark = pytest.mark.gpu

COMPACT = ("float16", "bfloat16", "int8")
# a width per cache type: 37 takes the scalar paths (no 16-byte stores), 128 the vector
# ones, 20 float32 vectors but scalar 16-bit outputs (20 % 8 != 0)
DIMS = {"dynamic": 37, "static": 128, "uvm": 20}
DEFAULT = -0.75
# the largest values each type is tested with (below hps/rows/storage_types.py's max_magnitude)
BIG = {"float16": 6.0e4, "bfloat16": 3.0e38, "int8": 1.0e37}


def _open(kind: str, n: int, dim: int, storage: str, **kw: Any) -> Any:
    if kind == "dynamic":  # roomy: no set overflows, every key stays
        return EmbeddingCache(16 * n, dim, storage=storage, **kw)
    if kind == "static":
        return StaticEmbeddingTable(n, dim, storage=storage, **kw)
    kw.setdefault("promotion_interval", 0)
    return UvmEmbeddingTable(n, dim, gpu_rows=n // 2, storage=storage, **kw)


def _fill(table: Any, keys: np.ndarray, rows: np.ndarray) -> None:
    for start in range(0, keys.size, 1500):  # in chunks, as a warm-up does
        part = slice(start, start + 1500)
        if isinstance(table, EmbeddingCache):
            table.insert(keys[part], rows[part])
        else:
            table.build(keys[part], rows[part])


def _keys(rng: np.random.Generator, n: int) -> np.ndarray:
    """n distinct keys below 2**62, the empty-slot key and -1 among them."""
    return np.r_[rng.choice(2**61, n - 2, replace=False), EMPTY_KEY, -1].astype(np.int64)


def _rows(rng: np.random.Generator, n: int, dim: int, storage: str) -> np.ndarray:
    """Random rows, the first ones adversarial for `storage`."""
    big = BIG[storage]
    rows = rng.standard_normal((n, dim)).astype(np.float32)
    rows[0] = 0.0  # constant rows: zero, negative, the largest value
    rows[1] = -3.25
    rows[2] = big
    rows[3] = np.linspace(-big, big, dim)  # the widest range
    rows[4] = rng.standard_normal(dim) * 1e-6  # tiny values (float16: subnormal)
    rows[5, 0] = big  # one outlier in a normal row
    rows[6] = np.where(np.arange(dim) % 2 == 0, big, -big)
    rows[7] = rng.uniform(-1, 1, dim) * 1e-30  # below float16's range: flushed to zero
    return rows.astype(np.float32)


def _check_values(storage: str, got: np.ndarray, rows: np.ndarray, what: str) -> None:
    """`got` (float32) is hps/rows/storage_types.py's decode of its encode of `rows`, each value
    within the type's error bound of the row's."""
    err = np.abs(got.astype(np.float64) - rows)
    over = err > error_bound(storage, rows)
    assert not over.any(), f"{what}: {int(over.sum())} values past the bound, first at " \
        f"{np.argwhere(over)[0].tolist()}"
    np.testing.assert_array_equal(got, decode(storage, encode(storage, rows), rows.shape[1]),
                                  err_msg=f"{what}: not the reference decode")


def _bits16(storage: str, rows: np.ndarray) -> np.ndarray:
    """The 16-bit patterns a table of `storage` (float16, bfloat16) holds for rows."""
    return np.ascontiguousarray(encode(storage, rows)).view(np.uint16)


def _mixed_query(rng: np.random.Generator, keys: np.ndarray, rows: np.ndarray, absent: int,
                 repeated: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A shuffled query of every key, `absent` keys the table lacks and the first
    `repeated` keys again: (query, the rows it should read, missed mask, the absent keys)."""
    n, dim = rows.shape
    lacking = rng.choice(2**61, absent) + 2**61  # disjoint from the table's keys
    order = rng.permutation(n + absent + repeated)
    query = np.r_[keys, lacking, keys[:repeated]].astype(np.int64)[order]
    want = np.r_[rows, np.zeros((absent, dim), np.float32), rows[:repeated]][order]
    missed = np.r_[np.zeros(n, bool), np.ones(absent, bool), np.zeros(repeated, bool)][order]
    return query, want, missed, lacking


def _check_16_bit(storage: str, got: np.ndarray, positions: np.ndarray, want: np.ndarray,
                  missed: np.ndarray, what: str = "") -> None:
    """A 16-bit output of `storage`: the misses where expected, the held rows' encoded bit
    patterns, the default's in the misses."""
    np.testing.assert_array_equal(positions, np.flatnonzero(missed), err_msg=what)
    bits = got.view(np.uint16)
    np.testing.assert_array_equal(bits[~missed], _bits16(storage, want[~missed]))
    default = _bits16(storage, np.full((1, 1), DEFAULT, np.float32))[0, 0]
    assert (bits[missed] == default).all()


def _query(cp: Any, table: Any, keys: np.ndarray, dtype: Any
           ) -> tuple[np.ndarray, np.ndarray]:
    """(rows looked up as `dtype`, sorted miss positions)."""
    out = cp.full((keys.size, table.dim), 0xFFFF if dtype == np.uint16 else np.nan,
                  dtype=dtype)
    positions, count = table.query(cp.asarray(keys), out, default_value=DEFAULT)
    assert count == positions.size
    return out.get(), np.sort(positions.get())


@pytest.mark.parametrize("kind", DIMS)
@pytest.mark.parametrize("storage", COMPACT)
def test_lookups_decode_as_the_reference(cp: Any, rng: np.random.Generator, seed: int,
                                         kind: str, storage: str) -> None:
    n, dim = 3000, DIMS[kind]
    keys, rows = _keys(rng, n), _rows(rng, n, DIMS[kind], storage)
    query, want_rows, missed, absent = _mixed_query(rng, keys, rows, 400, 50)
    with _open(kind, n, dim, storage) as table:
        _fill(table, keys, rows)
        assert table.size() == n, f"seed={seed}"
        got, positions = _query(cp, table, query, np.float32)
        np.testing.assert_array_equal(positions, np.flatnonzero(missed))
        assert (got[missed] == np.float32(DEFAULT)).all()
        _check_values(storage, got[~missed], want_rows[~missed], f"{kind} float32 out")
        if storage != "int8":  # a 16-bit output of the storage's own type: no widening
            got16, positions = _query(cp, table, query,
                                      np.float16 if storage == "float16" else np.uint16)
            _check_16_bit(storage, got16, positions, want_rows, missed)
        # updates are encoded the same way; keys not held are skipped
        fresh = _rows(rng, 600, dim, storage)[::-1].copy()
        upd = np.r_[keys[:500], absent[:100]]
        assert table.update(upd, fresh) == 500
        got, _ = _query(cp, table, keys[:500], np.float32)
        _check_values(storage, got, fresh[:500], f"{kind} after update")


@pytest.mark.parametrize("kind", ["static", "dynamic"])
@pytest.mark.parametrize("dim", [128, 20])
@pytest.mark.parametrize("storage", ["float16", "bfloat16"])
def test_large_batches_into_16_bit_outputs(cp: Any, rng: np.random.Generator, seed: int,
                                           storage: str, dim: int, kind: str) -> None:
    """Batches past PIPELINED_AFTER keys into 16-bit outputs take the pipelined query
    kernels (every warp over several rounds of the batch): the same bits, misses and
    defaults as the reference; 20 takes the scalar 16-bit stores."""
    n = PIPELINED_AFTER + 3000
    keys, rows = _keys(rng, n), _rows(rng, n, dim, storage)
    query, want, missed, _ = _mixed_query(rng, keys, rows, 900, 700)
    with _open(kind, n, dim, storage) as table:
        _fill(table, keys, rows)
        assert table.size() == n
        got, positions = _query(cp, table, query,
                                np.float16 if storage == "float16" else np.uint16)
        assert ("pipelined query", OUTPUT_CODES[storage]) in table._fn, "not the pipelined kernel"
        _check_16_bit(storage, got, positions, want, missed, f"seed={seed}")


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("storage", COMPACT)
def test_uvm_rows_stay_exact_through_promotion(cp: Any, rng: np.random.Generator,
                                               storage: str, grouped: bool) -> None:
    """Also with every batch's host reads grouped by region (uvm_table.py)."""
    n, dim = 2000, DIMS["uvm"]
    keys, rows = _keys(rng, n), _rows(rng, n, dim, storage)
    with _open("uvm", n, dim, storage, max_moves=n,
               grouped_reads_from=1 if grouped else n + 1,
               read_region_bytes=4096) as table:
        _fill(table, keys, rows)
        hot = keys[n // 2:]  # built last: their rows start in host memory
        table.seed_hits(hot, np.full(hot.size, 1000, np.uint32))
        assert table.promote() > 0
        state = table.state()
        owner = state["owner"]
        held = owner != NO_ROW
        # both copies of every promoted row are the same stored row
        np.testing.assert_array_equal(state["gpu_rows"][held],
                                      state["host_rows"][owner[held].astype(np.int64)])
        got, positions = _query(cp, table, keys, np.float32)
        assert positions.size == 0
        _check_values(storage, got, rows, "uvm after promotion")


@pytest.mark.parametrize("kind", DIMS)
@pytest.mark.parametrize("storage", ("float32", *COMPACT))
def test_memory_is_the_bytes_held(cp: Any, kind: str, storage: str) -> None:
    # the uvm table: fewer keys (its rows are pinned host memory), all of them hot
    n, dim = (1 << 18 if kind == "uvm" else 1 << 20), 128
    row = stored_row_bytes(dim, storage_type(storage))
    assert row == {"float32": 512, "float16": 256, "bfloat16": 256, "int8": 136}[storage]

    def table(keys: int) -> Any:
        if kind == "dynamic":
            return EmbeddingCache(keys, dim, storage=storage)
        if kind == "static":
            return StaticEmbeddingTable(keys, dim, storage=storage)
        return UvmEmbeddingTable(keys, dim, gpu_rows=keys, storage=storage,
                                 promotion_interval=0)

    table(64).close()  # CuPy's fill kernel loaded before the count
    rt = cp.cuda.runtime
    free = rt.memGetInfo()[0]
    with table(n) as t:
        taken = free - rt.memGetInfo()[0]
        stats = t.memory_stats()
        slots = t.num_slots
        if kind == "dynamic":
            assert stats["memory_bytes"] == slots * 16 + (slots + 1) * row + 64
        elif kind == "static":
            assert stats["memory_bytes"] == slots * 8 + (slots + 1) * row + 64
        else:  # rows in pinned host memory, their hot copies (and owners) on the GPU
            assert stats["host_memory_bytes"] == (slots + 1) * row
            assert stats["memory_bytes"] == UvmEmbeddingTable.index_bytes(n) + n * (row + 4)
        # what the device lost is what the table reports, up to the driver's 2 MiB pages
        # (each allocation rounded up, or a small one placed in a page already taken)
        assert abs(taken - stats["memory_bytes"]) <= 12 << 20, (taken, stats["memory_bytes"])


@pytest.mark.parametrize("kind", DIMS)
def test_bad_storage_types_and_outputs_are_refused(cp: Any, rng: np.random.Generator,
                                                   kind: str) -> None:
    dim = DIMS[kind]
    with pytest.raises(ConfigError, match="float8"):
        _open(kind, 100, dim, "float8")
    keys = _keys(rng, 100)
    with _open(kind, 100, dim, "float32") as table:  # no 16-bit output of float32 rows
        _fill(table, keys, rng.standard_normal((100, dim)).astype(np.float32))
        with pytest.raises(OutputBufferError, match="float16"):
            table.query(cp.asarray(keys), cp.empty((100, dim), np.float16))
    with _open(kind, 100, dim, "int8") as table:  # int8 rows: float32 outputs only
        with pytest.raises(OutputBufferError, match="float16"):
            table.query(cp.asarray(keys), cp.empty((100, dim), np.float16))
        # rows the type cannot hold: refused, nothing written
        bad = rng.standard_normal((100, dim)).astype(np.float32)
        bad[37, 3] = np.nan
        with pytest.raises(LookupInputError, match="row 37"):
            _fill(table, keys, bad)
        assert table.size() == 0
    with _open(kind, 100, dim, "float16") as table:
        good = rng.standard_normal((100, dim)).astype(np.float32)
        _fill(table, keys, good)
        too_big = good.copy()
        too_big[5, 0] = 70000.0  # past float16's largest value
        with pytest.raises(LookupInputError, match="row 5"):
            table.update(keys, too_big)
        got, _ = _query(cp, table, keys, np.float32)
        _check_values("float16", got, good, "after a refused update")
        with pytest.raises(OutputBufferError):  # a bfloat16 output (bits) of float16 rows
            table.query(cp.asarray(keys), cp.empty((100, dim), np.uint16))


# -- the public call ----------------------------------------------------------------------

PUBLIC_MODES = {
    "dynamic": {"gpucacheper": 0.5, "hit_rate_threshold": 1.0},  # misses inserted, sync
    "static": {"embedding_cache_type": "static", "gpucacheper": 1.0},
    "uvm": {"embedding_cache_type": "uvm", "gpucacheper": 0.3},
}


def _server(folder: Path, keys: np.ndarray, rows: np.ndarray, storage: str,
            **model: Any) -> HPS:
    write_sparse_model(folder / "t0", keys, rows)
    return HPS({
        "supportlonglong": True,
        "models": [{
            "model": "m", "sparse_files": [str(folder / "t0")],
            "embedding_vecsize_per_table": [rows.shape[1]],
            "maxnum_catfeature_query_per_table_per_sample": [1 << 16],
            "default_value_for_each_table": [DEFAULT], "deployed_device_list": [0],
            "max_batch_size": 1, "gpucache": True, "embedding_storage_dtype": storage,
            **model,
        }],
        "volatile_db": {"type": "hash_map"},
    })


@pytest.mark.parametrize("mode", PUBLIC_MODES)
@pytest.mark.parametrize("storage", COMPACT)
def test_public_call_writes_each_output_dtype(tmp_path: Path, rng: np.random.Generator,
                                              mode: str, storage: str) -> None:
    import torch

    dim = DIMS[mode]
    n = 4000
    keys, rows = _keys(rng, n)[:-2], _rows(rng, n - 2, dim, storage)
    absent = rng.choice(2**61, 300) + 2**61
    query = rng.permutation(np.r_[keys, absent]).astype(np.int64)
    at = {k: i for i, k in enumerate(keys.tolist())}
    held = np.array([k in at for k in query.tolist()])
    want = np.zeros((query.size, dim), np.float32)
    want[held] = rows[[at[k] for k in query[held].tolist()]]
    hps = _server(tmp_path, keys, rows, storage, **PUBLIC_MODES[mode])
    try:
        stats = hps.server.model("m").tables[0].gpu[0].stats()
        assert stats["storage_dtype"] == storage
        t_keys = torch.as_tensor(query, device="cuda")
        for attempt in ("misses fetched", "hits"):  # the dynamic cache inserts its misses
            out = torch.full((query.size, dim), np.nan, device="cuda")
            hps.lookup_fromdlpack(t_keys, out, "m", 0)
            got = out.cpu().numpy()
            assert (got[~held] == np.float32(DEFAULT)).all(), attempt
            err = np.abs(got[held].astype(np.float64) - want[held])
            # rows fetched from the hash map come decoded and are stored again: for
            # int8 that may move the scale by an ulp, inside the bound's float32 term
            assert (err <= error_bound(storage, want[held])).all(), f"{attempt} ({mode})"
            if storage != "int8":
                _check_values(storage, got[held], want[held], f"{mode} {attempt}")
                narrow = torch.float16 if storage == "float16" else torch.bfloat16
                out16 = torch.zeros((query.size, dim), dtype=narrow, device="cuda")
                hps.lookup_fromdlpack(t_keys, out16, "m", 0)
                bits = out16.view(torch.int16).cpu().numpy().view(np.uint16)
                np.testing.assert_array_equal(bits[held], _bits16(storage, want[held]))
                default = _bits16(storage, np.full((1, 1), DEFAULT, np.float32))[0, 0]
                assert (bits[~held] == default).all()
        if storage == "int8":
            with pytest.raises(OutputBufferError):
                hps.lookup_fromdlpack(t_keys, torch.empty((query.size, dim),
                                                          dtype=torch.float16,
                                                          device="cuda"), "m", 0)
    finally:
        hps.close()


def test_public_call_refuses_a_narrow_output_of_float32_rows(tmp_path: Path,
                                                             rng: np.random.Generator) -> None:
    import torch

    keys, rows = _keys(rng, 100), rng.standard_normal((100, 16)).astype(np.float32)
    hps = _server(tmp_path, keys, rows, "float32", **PUBLIC_MODES["static"])
    try:
        for dtype in (torch.float16, torch.bfloat16):
            out = torch.zeros((100, 16), dtype=dtype, device="cuda")
            with pytest.raises(OutputBufferError, match="float32"):
                hps.lookup_fromdlpack(torch.as_tensor(keys, device="cuda"), out, "m", 0)
            assert (out == 0).all()
    finally:
        hps.close()
    with pytest.raises(ConfigError, match="embedding_storage_dtype"):
        _server(tmp_path, keys, rows, "float8", **PUBLIC_MODES["static"])
