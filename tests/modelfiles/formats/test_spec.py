"""sparse_files entries: plain strings or objects, the format from suffix or contents."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest

from hps.config import UnknownConfigKeyWarning, load_config
from hps.errors import ConfigError, ModelFileError
from hps.modelfiles.formats import TableSpec, detect_format, open_model
from hps.modelfiles.uri import LocalSource
from tests.conftest import make_table, model_config, write_table


def config_file(tmp_path: Path, entries: list[object]) -> Path:
    path = tmp_path / "ps.json"
    path.write_text(json.dumps({"models": [model_config(entries, [4] * len(entries))]}))
    return path


def test_object_entries_parse_and_resolve_relative_paths(tmp_path: Path) -> None:
    path = config_file(tmp_path, [
        "t0",
        {"path": "t1.parquet", "key_column": "id", "vector_column": "emb"},
        {"path": "s3://b/emb.safetensors", "format": "safetensors", "tensor": "weight",
         "key_offset": 7},
    ])
    model = load_config(path).models[0]
    assert model.table_spec(0) == TableSpec(str(tmp_path / "t0"))
    assert model.table_spec(1) == TableSpec(str(tmp_path / "t1.parquet"), key_column="id",
                                            vector_column="emb")
    assert model.table_spec(2).key_offset == 7 and model.table_spec(2).path.startswith("s3://")


def test_bad_entries_name_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"key_column do\(es\) not apply to format "
                       r"'safetensors' \(it takes tensor, keys_tensor, key_offset\)"):
        load_config(config_file(tmp_path, [{"path": "x", "format": "safetensors",
                                            "key_column": "id"}]))
    with pytest.raises(ConfigError, match=r"sparse_files\[0\]: format 'csv' is not one of"):
        load_config(config_file(tmp_path, [{"path": "x", "format": "csv"}]))
    with pytest.raises(ConfigError, match="key_offset must be >= 0"):
        load_config(config_file(tmp_path, [{"path": "x", "key_offset": -1}]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config(config_file(tmp_path, [{"path": "x", "key_column": "id",
                                            "key_colum": "id"}]))
    assert any(issubclass(w.category, UnknownConfigKeyWarning)
               and "sparse_files[0].key_colum" in str(w.message)
               and "key_column" in str(w.message) for w in caught)
    with pytest.raises(ConfigError, match=r"sparse_files\[0\]\.key_colum' is not a config "
                       r"key: did you mean '.*sparse_files\[0\]\.key_column'"):
        load_config(config_file(tmp_path, [{"path": "x", "key_colum": "id"}]))


def test_options_of_another_format_are_refused_after_detection(tmp_path: Path,
                                                              rng: np.random.Generator) -> None:
    folder = write_table(tmp_path / "t", *make_table(rng, 10, 4))
    with pytest.raises(ModelFileError, match="tensor do\\(es\\) not apply to format "
                       "'sparse_folder'"):
        open_model(TableSpec(str(folder), tensor="weight"))


def test_detection_by_suffix_and_contents(tmp_path: Path, rng: np.random.Generator) -> None:
    keys, vectors = make_table(rng, 10, 4)
    write_table(tmp_path / "hugectr.v2", keys, vectors)  # a dot in a folder's name
    (tmp_path / "np").mkdir()
    np.save(tmp_path / "np" / "keys.npy", keys)
    np.save(tmp_path / "np" / "vectors.npy", vectors)
    for name, fmt in (("hugectr.v2", "sparse_folder"), ("np", "numpy")):
        spec = TableSpec(str(tmp_path / name))
        assert detect_format(spec, LocalSource(spec.path)) == fmt
        with open_model(spec) as reader:
            assert reader.format == fmt
            np.testing.assert_array_equal(next(reader.chunks())[1], vectors)
    assert detect_format(TableSpec("s3://b/x/t.PARQUET")) == "parquet"
    assert detect_format(TableSpec("/m/t.npz")) == "numpy"
    assert detect_format(TableSpec("/m/t.safetensors")) == "safetensors"
    assert detect_format(TableSpec("/m/folder")) == ""  # read its contents
