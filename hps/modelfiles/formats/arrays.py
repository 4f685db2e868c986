"""A typed array stored raw at an offset of a source file, read by row ranges.

`.npy` data, `.npz` members stored without compression, safetensors tensors and HugeCTR's
`key`/`emb_vector` files are all the same thing: a C-ordered array of a known dtype and
shape at a byte offset of a file. Local files are memory-mapped (a chunk is a slice of
the map); remote files are read with one ranged read per chunk.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from hps.modelfiles.source import ModelSource


@dataclass
class RawArray:
    """`shape` (rows first) of `dtype`, C order, at byte `offset` of file `name`."""

    source: ModelSource
    name: str
    offset: int
    dtype: np.dtype
    shape: tuple[int, ...]
    _map: np.ndarray | None = field(default=None, repr=False)

    @property
    def row_bytes(self) -> int:
        return int(np.prod(self.shape[1:], dtype=np.int64)) * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.row_bytes

    def rows(self, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) as an array of `dtype` (a view of the map when local)."""
        from hps.modelfiles.uri import LocalSource

        if isinstance(self.source, LocalSource) and self.nbytes:
            if self._map is None:
                self._map = np.memmap(
                    f"{self.source.path}/{self.name}", self.dtype, "r", self.offset, self.shape
                )
            return self._map[start:stop]
        raw = self.source.read(
            self.name, self.offset + start * self.row_bytes, (stop - start) * self.row_bytes
        )
        return np.frombuffer(raw, self.dtype).reshape((stop - start, *self.shape[1:]))


def row_ranges(num_rows: int, step: int) -> Iterator[tuple[int, int]]:
    """[start, stop) bounds of `step` rows each (the last fewer) over `num_rows` rows."""
    for start in range(0, num_rows, step):
        yield start, min(start + step, num_rows)
