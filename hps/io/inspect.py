"""`hps inspect`: what a sparse model folder holds and whether it is sound.

Reads the folder in chunks (bounded memory apart from the key set needed to count
duplicates) and reports keys, width, sizes, key range, duplicate keys and non-finite
values.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hps.io.sparse_model import SparseModelReader


@dataclass
class InspectReport:
    uri: str
    num_keys: int
    vec_size: int
    key_bytes: int
    vector_bytes: int
    key_min: int | None
    key_max: int | None
    duplicate_keys: int
    non_finite_values: int
    has_slot_id: bool

    @property
    def valid(self) -> bool:
        return self.duplicate_keys == 0 and self.non_finite_values == 0

    def rows(self) -> list[tuple[str, str]]:
        mib = 1 << 20
        key_range = "-" if self.key_min is None else f"{self.key_min:,} … {self.key_max:,}"
        return [
            ("keys", f"{self.num_keys:,}"),
            ("width", str(self.vec_size)),
            ("key file", f"{self.key_bytes:,} bytes"),
            ("emb_vector file", f"{self.vector_bytes:,} bytes "
                                f"({self.vector_bytes / mib:,.1f} MiB)"),
            ("key range", key_range),
            ("duplicate keys", f"{self.duplicate_keys:,}"),
            ("non-finite values", f"{self.non_finite_values:,}"),
            ("slot_id file", "present (ignored)" if self.has_slot_id else "absent"),
            ("valid", "yes" if self.valid else "NO"),
        ]


def inspect_folder(uri: str, vec_size: int | None = None) -> InspectReport:
    """Inspect a sparse model folder; raises ModelFileError if its sizes are inconsistent."""
    reader = SparseModelReader(uri, vec_size)
    key_min: int | None = None
    key_max: int | None = None
    non_finite = 0
    all_keys = np.empty(reader.num_keys, dtype=np.int64)
    for start, stop in reader.chunk_bounds():
        keys = reader.read_keys(start, stop)
        all_keys[start:stop] = keys
        non_finite += int(np.count_nonzero(~np.isfinite(reader.read_vectors(start, stop))))
    if reader.num_keys:
        key_min, key_max = int(all_keys.min()), int(all_keys.max())
    all_keys.sort()
    duplicates = int(np.count_nonzero(all_keys[1:] == all_keys[:-1]))
    return InspectReport(
        uri=uri, num_keys=reader.num_keys, vec_size=reader.vec_size,
        key_bytes=reader.info.key_bytes, vector_bytes=reader.info.vector_bytes,
        key_min=key_min, key_max=key_max, duplicate_keys=duplicates,
        non_finite_values=non_finite, has_slot_id=reader.source.exists("slot_id"),
    )
