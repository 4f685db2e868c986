"""`hps convert SRC DST`: one table from any format into any other, streamed.

The source is read through the ModelReader contract (any URI), a chunk at a time, and
written by the destination format's ModelWriter to a local path; the same tally as `hps
inspect` is kept on the way (duplicates, non-finite values). Rows are float32 on both
sides, so a conversion and its way back give the same bits; float16 and bfloat16 sources
are widened exactly. A conversion that fails leaves no destination behind.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hps.modelfiles.formats import ReadOptions, TableSpec, open_model, open_writer
from hps.modelfiles.inspect import InspectReport, TableStats, describe
from hps.modelfiles.read_ahead import read_ahead
from hps.modelfiles.source import SourceOptions

if TYPE_CHECKING:
    from hps.server.loader import LoadProgress


def convert(
    source: str | TableSpec,
    destination: str,
    to_format: str | None = None,
    *,
    vec_size: int | None = None,
    options: ReadOptions | None = None,
    source_options: SourceOptions | None = None,
    progress: LoadProgress | None = None,
) -> InspectReport:
    """Copy the table at `source` to the local path `destination` in `to_format`.

    `to_format` None: from the destination's suffix (.parquet, .npz, .safetensors), else
    a HugeCTR sparse folder. Returns the source's report (rows, width, key range,
    duplicates, non-finite values). Raises ModelFileError naming the file and what is
    wrong; the destination is then left as it was before.
    """
    read = options or ReadOptions(vec_size)
    with open_model(source, read, source_options) as reader:
        stats = TableStats(reader.num_keys)
        bytes_per_row = reader.num_bytes / max(1, reader.num_keys)
        if progress is not None:
            progress.start_table(reader.uri, reader.num_keys, reader.num_bytes)
        with open_writer(destination, to_format, reader.num_keys, reader.vec_size) as writer:
            for keys, rows in read_ahead(reader.chunks()):
                stats.observe(keys, rows)
                writer.write(keys, rows)
                if progress is not None:
                    progress.advance(len(keys), int(len(keys) * bytes_per_row))
        if progress is not None:
            progress.finish_table(reader.uri, 0.0)
        return describe(reader, stats)
