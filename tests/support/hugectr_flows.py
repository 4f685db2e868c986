"""HugeCTR's HPS test flows (its test/inference/hps scripts), re-created for our tests.

The model has HugeCTR's test shape: model "hps_demo", two tables of widths 1 and 16,
whose keys per sample are 2 (table 0: slots C1_C2 and C3_C4) and 26 (table 1: slots
C1..C26). Each slot owns a contiguous key range; a sample's keys are the slot values
shifted by the slots' cumulative sizes, as the scripts compute `cat_input`. The slot sizes
and vectors here are synthetic (and smaller), written in HugeCTR's sparse folder format.

Used by tests/test_hugectr_compat.py (CPU) and tests/test_hugectr_compat_gpu.py (GPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hps import write_sparse_model
from hps.inference import EmbeddingCacheType_t, InferenceParams, ParameterServerConfig

MODEL = "hps_demo"
TABLES = ("sparse_embedding0", "sparse_embedding1")
WIDTHS = (1, 16)
KEYS_PER_SAMPLE = (2, 26)
CACHE_TYPES = (EmbeddingCacheType_t.Dynamic, EmbeddingCacheType_t.UVM,
               EmbeddingCacheType_t.Static)


@dataclass
class Model:
    """The files of a synthetic hps_demo model and what they hold."""

    files: list[str]
    slot_sizes: np.ndarray  # keys per slot, 2 + 26 slots
    shift: np.ndarray  # first key of each slot
    tables: list[tuple[np.ndarray, np.ndarray]]  # (keys, vectors) per table

    def vectors_of(self, table: int, keys: Any) -> np.ndarray:
        """The rows the files hold for `keys` (all present)."""
        file_keys, vectors = self.tables[table]
        order = np.argsort(file_keys)
        at = order[np.searchsorted(file_keys, np.asarray(keys, np.int64), sorter=order)]
        assert np.array_equal(file_keys[at], np.asarray(keys, np.int64))
        return vectors[at]

    def sample(self, rng: np.random.Generator, batch_size: int) -> list[Any]:
        """`cat_input` of a batch: one value per slot, shifted, flattened to a list of
        NumPy integers (as `list((df[columns] + shift).values.flatten())` gives)."""
        values = rng.integers(0, self.slot_sizes, size=(batch_size, self.slot_sizes.size))
        return list((values + self.shift).flatten())


def write_model(folder: Path, rng: np.random.Generator) -> Model:
    """Write the two tables; every key of every slot is in its table, in shuffled order."""
    slot_sizes = rng.integers(3, 400, size=sum(KEYS_PER_SAMPLE))
    shift = np.insert(np.cumsum(slot_sizes), 0, 0)[:-1]
    files, tables = [], []
    first = 0
    for name, width, slots in zip(TABLES, WIDTHS, KEYS_PER_SAMPLE, strict=True):
        count = int(slot_sizes[first:first + slots].sum())
        keys = rng.permutation(np.arange(shift[first], shift[first] + count, dtype=np.int64))
        vectors = rng.standard_normal((count, width)).astype(np.float32)
        write_sparse_model(folder / name, keys, vectors)
        files.append(str(folder / name))
        tables.append((keys, vectors))
        first += slots
    return Model(files, slot_sizes, shift, tables)


def ps_config(files: list[str], *, max_batchsize: int = 64, enable_cache: bool = True,
              cache_type: EmbeddingCacheType_t | None = None, **params: Any
              ) -> ParameterServerConfig:
    """The scripts' ParameterServerConfig: hpsdlpack.py's (max_batchsize 64, no cache type)
    or lookup_session_test.py's (max_batchsize 10 and a cache type)."""
    if cache_type is not None:
        params["embedding_cache_type"] = cache_type
    return ParameterServerConfig(
        emb_table_name={MODEL: list(TABLES)},
        embedding_vec_size={MODEL: list(WIDTHS)},
        max_feature_num_per_sample_per_emb_table={MODEL: list(KEYS_PER_SAMPLE)},
        inference_params_array=[
            InferenceParams(
                model_name=MODEL,
                max_batchsize=max_batchsize,
                hit_rate_threshold=1.0,
                dense_model_file="",
                sparse_model_files=files,
                deployed_devices=[0],
                use_gpu_embedding_cache=enable_cache,
                cache_size_percentage=0.5,
                i64_input_key=True,
                **params,
            )
        ],
    )


def native_lookup(hps: Any, cat_input: list[Any], batch_size: int = 1
                  ) -> tuple[np.ndarray, np.ndarray]:
    """The scripts' `hps.lookup` calls: table 0 reshaped (batch, 2, 1), table 1 (batch, 26, 16).

    For the scripts' batch of one these are `cat_input[0:2]` and `cat_input[2:]`, lists of
    NumPy integers; larger batches pass each table's columns as lists too."""
    if batch_size == 1:
        first, second = cat_input[0:2], cat_input[2:]
    else:
        rows = np.asarray(cat_input).reshape(batch_size, -1)
        first, second = list(rows[:, :2].flatten()), list(rows[:, 2:].flatten())
    embedding1 = hps.lookup(first, MODEL, 0).reshape(batch_size, 2, 1)
    embedding2 = hps.lookup(second, MODEL, 1).reshape(batch_size, 26, 16)
    return embedding1, embedding2


def torch_dlpack_lookup(hps: Any, cat_input: list[Any], device: str) -> np.ndarray:
    """hpsdlpack.py's torch step: legacy capsules of a key tensor and a (1, 26 × 16) output,
    looked up in table 1, the output read back from its capsule after the call."""
    import torch.utils.dlpack

    key = torch.tensor(cat_input[2:], dtype=torch.int64, device=torch.device(device))
    out = torch.empty((1, 26 * 16), dtype=torch.float32, device=torch.device(device))
    key_capsule = torch.utils.dlpack.to_dlpack(key)
    out_capsule = torch.utils.dlpack.to_dlpack(out)
    hps.lookup_fromdlpack(key_capsule, out_capsule, MODEL, 1)
    out_put = torch.utils.dlpack.from_dlpack(out_capsule)
    assert out_put.device == key.device
    return out_put.cpu().numpy()
