"""`hps convert SRC DST`: one table from any format into any other, streamed.

The source is read through the ModelReader contract (any URI), a chunk at a time, and
written by the destination format's ModelWriter to a local path; the same tally as `hps
inspect` is kept on the way (duplicates, non-finite values). Rows are float32 on both
sides, so a conversion and its way back give the same bits; float16 and bfloat16 sources
are widened exactly. A conversion that fails leaves no destination behind.

Everything that can be told before reading is checked first, so a mistake costs no
minutes of conversion: the destination's format (named, or told by a known suffix: an
unknown one is refused, not taken for a folder's name), an existing destination (kept
unless `force`), and the packages both formats need (pyarrow for Parquet).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from hps.errors import MissingExtraError, ModelFileError, UnsupportedFormatError
from hps.modelfiles.formats import ReadOptions, TableSpec, detect_format, open_model, open_writer
from hps.modelfiles.formats.spec import SUFFIX_FORMATS
from hps.modelfiles.inspect import InspectReport, TableStats, describe
from hps.modelfiles.read_ahead import read_ahead
from hps.modelfiles.source import SourceOptions

if TYPE_CHECKING:
    from hps.server.loader import LoadProgress


#: the formats hps convert writes
WRITABLE = ("sparse_folder", "parquet", "numpy", "safetensors")


def destination_format(destination: str, to_format: str | None = None) -> str:
    """The format written to `destination`: `to_format`, else the one its suffix names
    (.parquet, .npz, .safetensors), else (no suffix) a HugeCTR sparse folder.
    UnsupportedFormatError for any other suffix or format: the fix is to name one."""
    if to_format is not None:
        if to_format not in WRITABLE:
            raise UnsupportedFormatError(f"hps convert writes {', '.join(WRITABLE)}; "
                                         f"not {to_format!r}")
        return to_format
    suffix = os.path.splitext(destination.rstrip("/"))[1].lower()
    if not suffix:
        return "sparse_folder"
    if SUFFIX_FORMATS.get(suffix) in WRITABLE:
        return SUFFIX_FORMATS[suffix]
    raise UnsupportedFormatError(
        f"{destination}: the suffix {suffix!r} names no format hps convert writes (.parquet, "
        ".npz, .safetensors, or no suffix for a HugeCTR folder); name the format with --to "
        f"({', '.join(WRITABLE)})")


def _check_extras(source: TableSpec, fmt: str) -> None:
    """MissingExtraError, before anything is read, when a format's package is missing."""
    for side, name in (("reading", detect_format(source)), ("writing", fmt)):
        if name == "parquet":
            try:
                import pyarrow.parquet  # noqa: F401
            except ImportError:
                raise MissingExtraError("pyarrow", "parquet",
                                        f"{side} Parquet model files") from None


def convert(
    source: str | TableSpec,
    destination: str,
    to_format: str | None = None,
    *,
    vec_size: int | None = None,
    options: ReadOptions | None = None,
    source_options: SourceOptions | None = None,
    progress: LoadProgress | None = None,
    force: bool = False,
) -> InspectReport:
    """Copy the table at `source` to the local path `destination` in `to_format`.

    `to_format` None: as `destination_format` tells. Returns the source's report (rows,
    width, key range, duplicates, non-finite values). Before reading anything, raises
    UnsupportedFormatError for a destination of no known format, ModelFileError for an
    existing destination unless `force` (it is then replaced once the copy is complete),
    MissingExtraError for a format whose package is missing. Raises ModelFileError naming
    the file and what is wrong; the destination is then left as it was before.
    """
    spec = TableSpec.of(source)
    fmt = destination_format(destination, to_format)
    if os.path.lexists(destination.removeprefix("file://")) and not force:
        raise ModelFileError(f"{destination} exists: pass --force to replace it, or choose "
                             "another destination")
    _check_extras(spec, fmt)
    read = options or ReadOptions(vec_size)
    with open_model(spec, read, source_options) as reader:
        stats = TableStats(reader.num_keys)
        bytes_per_row = reader.num_bytes / max(1, reader.num_keys)
        if progress is not None:
            progress.start_table(f"writing {destination}", reader.num_keys, reader.num_bytes)
        with open_writer(destination, fmt, reader.num_keys, reader.vec_size) as writer:
            for keys, rows in read_ahead(reader.chunks()):
                stats.observe(keys, rows)
                writer.write(keys, rows)
                if progress is not None:
                    progress.advance(len(keys), int(len(keys) * bytes_per_row))
        if progress is not None:
            progress.finish_table(f"writing {destination}", 0.0)
        return describe(reader, stats)
