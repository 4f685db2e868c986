"""`hps inspect`: what a table's files hold, in any format, and whether they are sound.

Reads the table in chunks through the ModelReader contract (bounded memory apart from
the key set needed to count duplicates) and reports format, keys, width, stored dtypes,
files and sizes, key range, duplicate keys and non-finite values. `TableStats` is the
same tally `hps convert` keeps while it copies.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from hps.modelfiles.formats import ModelReader, ReadOptions, TableSpec, open_model
from hps.modelfiles.source import SourceOptions


@dataclass
class TableStats:
    """Key range, duplicates and non-finite values of a table, tallied chunk by chunk."""

    num_keys: int
    key_min: int | None = None
    key_max: int | None = None
    non_finite_values: int = 0
    _keys: np.ndarray = field(init=False, repr=False)
    _seen: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        self._keys = np.empty(self.num_keys, dtype=np.int64)

    def observe(self, keys: np.ndarray, rows: np.ndarray) -> None:
        """Count one chunk of (keys int64[n], rows float32[n, dim])."""
        if not len(keys):
            return
        self._keys[self._seen : self._seen + len(keys)] = keys
        self._seen += len(keys)
        low, high = int(keys.min()), int(keys.max())
        self.key_min = low if self.key_min is None else min(self.key_min, low)
        self.key_max = high if self.key_max is None else max(self.key_max, high)
        self.non_finite_values += int(np.count_nonzero(~np.isfinite(rows)))

    @property
    def duplicate_keys(self) -> int:
        """Rows whose key an earlier row already has (the last of them wins in a load)."""
        keys = np.sort(self._keys[: self._seen])
        return int(np.count_nonzero(keys[1:] == keys[:-1]))


@dataclass
class InspectReport:
    uri: str
    format: str
    num_keys: int
    vec_size: int
    dtype: str
    key_dtype: str
    files: list[tuple[str, int]]
    key_min: int | None
    key_max: int | None
    duplicate_keys: int
    non_finite_values: int

    @property
    def valid(self) -> bool:
        return self.duplicate_keys == 0 and self.non_finite_values == 0

    def rows(self) -> list[tuple[str, str]]:
        mib = 1 << 20
        key_range = "-" if self.key_min is None else f"{self.key_min:,} … {self.key_max:,}"
        total = sum(size for _, size in self.files)
        return [
            ("format", self.format),
            ("keys", f"{self.num_keys:,}"),
            ("width", str(self.vec_size)),
            ("vector dtype", self.dtype if self.dtype == "float32" else f"{self.dtype} (served "
                                                                         "as float32)"),
            ("key dtype", self.key_dtype),
            *((f"file {uri}", f"{size:,} bytes") for uri, size in self.files),
            ("size", f"{total:,} bytes ({total / mib:,.1f} MiB)"),
            ("key range", key_range),
            ("duplicate keys", f"{self.duplicate_keys:,}"),
            ("non-finite values", f"{self.non_finite_values:,}"),
            ("valid", "yes" if self.valid else "NO"),
        ]


def describe(reader: ModelReader, stats: TableStats) -> InspectReport:
    """The report of a table read wholly into `stats`."""
    return InspectReport(
        uri=reader.uri,
        format=reader.format,
        num_keys=reader.num_keys,
        vec_size=reader.vec_size,
        dtype=reader.dtype,
        key_dtype=reader.key_dtype,
        files=[(reader.source.describe(name), size) for name, size in reader.files],
        key_min=stats.key_min,
        key_max=stats.key_max,
        duplicate_keys=stats.duplicate_keys,
        non_finite_values=stats.non_finite_values,
    )


def inspect_model(
    entry: str | TableSpec,
    vec_size: int | None = None,
    source_options: SourceOptions | None = None,
) -> InspectReport:
    """Inspect one table's files; raises ModelFileError naming what is wrong with them."""
    with open_model(entry, ReadOptions(vec_size), source_options) as reader:
        stats = TableStats(reader.num_keys)
        for keys, rows in reader.chunks():
            stats.observe(keys, rows)
        return describe(reader, stats)
