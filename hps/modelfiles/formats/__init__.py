"""Model file formats behind one contract (`ModelReader`, see base.py): `open_model`.

    sparse_folder   HugeCTR's `key` + `emb_vector` folder            sparse_folder.py
    parquet         a .parquet file, or a folder of part files       parquet.py
    numpy           keys.npy + vectors.npy folder, or one .npz       numpy.py
    safetensors     a .safetensors file (nn.Embedding, TorchRec)     safetensors.py
    torch           a torch.save state_dict (.pt, .pth, .bin, .ckpt)  torch_state.py
    dcp             a torch.distributed.checkpoint folder            dcp.py

Any of them may be local, on HDFS or on S3 (the URI layer, hps.modelfiles.uri). A path names its
format by suffix (.parquet/.pq, .npz, .safetensors); a path without one is a folder read
by its contents: `key` → sparse_folder, `keys.npy` → numpy, `.metadata` → dcp, `*.parquet`
parts → parquet. `format` in a sparse_files entry overrides the guess. torch.save files are
read without unpickling (torch_state.py); plain pickles (.pkl) and pre-1.6 torch.save
files are refused with how to save them as safetensors. `hps convert` writes the first
four formats only.
"""

from __future__ import annotations

import posixpath

from hps.errors import ModelFileError, SourceNotFoundError, UnsupportedFormatError
from hps.modelfiles.formats.base import (
    DEFAULT_CHUNK_BYTES,
    ModelReader,
    ModelWriter,
    ReadOptions,
)
from hps.modelfiles.formats.spec import (
    FORMAT_OPTIONS,
    FORMATS,
    PICKLE_HINT,
    PICKLE_SUFFIXES,
    SUFFIX_FORMATS,
    TableSpec,
)
from hps.modelfiles.source import ModelSource, SourceOptions

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "FORMATS",
    "ModelReader",
    "ModelWriter",
    "ReadOptions",
    "TableSpec",
    "detect_format",
    "open_model",
    "open_writer",
]

#: formats read but not written (PyTorch writes them)
READ_ONLY_FORMATS = ("torch", "dcp")



def split_file(path: str) -> tuple[str, str]:
    """(folder URI, file name) of a file path or URI."""
    stripped = path.rstrip("/")
    folder, name = posixpath.split(stripped)
    if not folder and "://" not in stripped:
        folder = "."  # a bare file name: the current folder
    if not name or not folder:
        raise ModelFileError(f"{path!r} does not name a file in a folder")
    return folder, name


def detect_format(spec: TableSpec, source: ModelSource | None = None) -> str:
    """The format of `spec`: named, else from the suffix, else from the folder `source`.

    Without a `source`, a path that names no format by its suffix gives '' (a folder,
    to be read by its contents). Raises UnsupportedFormatError for pickled PyTorch files
    and lone .npy files, ModelFileError for a folder that holds no known layout.
    """
    if spec.format is not None:
        return spec.format
    suffix = spec.suffix
    if suffix in PICKLE_SUFFIXES:
        raise UnsupportedFormatError(f"{spec.path} {PICKLE_HINT}")
    if suffix in SUFFIX_FORMATS:
        return SUFFIX_FORMATS[suffix]
    if suffix == ".npy":
        raise UnsupportedFormatError(
            f"{spec.path}: a single .npy holds one array; put keys.npy and vectors.npy in a "
            "folder and name the folder, or save both in one .npz"
        )
    if source is None:  # any other suffix is part of a folder's name ("table.v2")
        return ""
    return folder_format(source)[0]


def folder_format(source: ModelSource) -> tuple[str, list[str]]:
    """(format, Parquet part names) of a folder by what it holds; ModelFileError if none."""
    if source.exists("key"):
        return "sparse_folder", []
    if source.exists("keys.npy"):
        return "numpy", []
    if source.exists(".metadata"):
        return "dcp", []
    from hps.modelfiles.formats.parquet import part_names

    try:
        names = source.names()
    except SourceNotFoundError:
        raise SourceNotFoundError(f"sparse folder {source.uri!r} does not exist") from None
    if part_names(names):
        return "parquet", part_names(names)
    found = f"it holds {', '.join(names[:8])}" if names else "it holds no files"
    raise ModelFileError(
        f"sparse folder {source.uri!r} has no 'key' file, no keys.npy and no *.parquet part "
        f"files ({found}): expected a HugeCTR folder "
        "(key, emb_vector), a NumPy folder (keys.npy, vectors.npy), a DCP checkpoint "
        "(.metadata), Parquet part files, or a file ending in .parquet, .npz, .safetensors "
        "or .pt"
    )


def open_model(
    entry: str | TableSpec,
    options: ReadOptions | None = None,
    source_options: SourceOptions | None = None,
) -> ModelReader:
    """A reader for one table's files, validated (see each format's module docstring).

    Raises ModelFileError (or UnsupportedFormatError) naming the file and what is wrong,
    SourceError when the files cannot be reached, MissingExtraError when the format's
    package is not installed. The caller closes the reader.
    """
    from hps.modelfiles.uri import open_source

    spec = TableSpec.of(entry)
    options = options or ReadOptions()
    fmt = detect_format(spec)  # from the name alone: '' for a folder (read its contents)
    folder, name = split_file(spec.path) if is_file_of(fmt, spec) else (spec.path, "")
    source = open_source(folder, source_options)
    try:
        parts: list[str] = []
        if not fmt:
            fmt, parts = folder_format(source)
        misplaced = [o for o in spec.options_set() if o not in FORMAT_OPTIONS[fmt]]
        if misplaced:
            raise ModelFileError(f"{spec.path}: {TableSpec.misplaced(misplaced, fmt)}")
        return _open(fmt, spec, source, [name] if name else parts, options)
    except BaseException:
        source.close()
        raise


def _open(fmt: str, spec: TableSpec, source: ModelSource, names: list[str],
          options: ReadOptions) -> ModelReader:
    """The reader of `fmt`: of file `names[0]` for file formats, else of the folder
    (`names` then lists Parquet parts when the folder was already listed)."""
    name = names[0] if is_file_of(fmt, spec) else ""
    if fmt == "sparse_folder":
        from hps.modelfiles.formats.sparse_folder import SparseModelReader

        return SparseModelReader(
            source, options.vec_size, chunk_bytes=options.chunk_bytes,
            uint32_keys=options.uint32_keys,
        )
    if fmt == "numpy":
        from hps.modelfiles.formats.numpy import NumpyReader

        return NumpyReader(source, name or None, options)
    if fmt == "safetensors":
        from hps.modelfiles.formats.safetensors import SafetensorsReader

        return SafetensorsReader(
            source, name, options, spec.tensor, spec.keys_tensor, spec.key_offset
        )
    if fmt == "torch":
        from hps.modelfiles.formats.torch_state import TorchStateReader

        return TorchStateReader(
            source, name, options, spec.tensor, spec.keys_tensor, spec.key_offset
        )
    if fmt == "dcp":
        from hps.modelfiles.formats.dcp import DcpReader

        return DcpReader(source, options, spec.tensor, spec.key_offset)
    from hps.modelfiles.formats.parquet import ParquetReader, part_names

    names = names or part_names(source.names())
    return ParquetReader(
        source, names, options, folder=not name,
        key_column=spec.key_column, vector_column=spec.vector_column,
    )


def is_file_of(fmt: str, spec: TableSpec) -> bool:
    """Whether `spec` names one file of `fmt` (else a folder)."""
    return fmt in ("safetensors", "torch") or (
        fmt != "" and SUFFIX_FORMATS.get(spec.suffix) == fmt)


def writer_format(path: str, fmt: str | None) -> str:
    """The format `hps convert` writes to `path`: named, else by suffix, else sparse_folder."""
    if fmt is not None:
        if fmt not in FORMATS:
            raise UnsupportedFormatError(f"format {fmt!r} is not one of {', '.join(FORMATS)}")
    else:
        fmt = detect_format(TableSpec(path=path)) or "sparse_folder"
    if fmt in READ_ONLY_FORMATS:
        raise UnsupportedFormatError(
            f"{path}: hps convert reads {fmt} but does not write it; write safetensors, "
            "parquet, numpy or sparse_folder"
        )
    return fmt


def open_writer(path: str, fmt: str | None, num_keys: int, vec_size: int) -> ModelWriter:
    """A streaming writer of `num_keys` rows of width `vec_size` at the local `path`.

    numpy writes a keys.npy + vectors.npy folder, or an .npz when the path ends so.
    """
    fmt = writer_format(path, fmt)
    if fmt == "parquet":
        from hps.modelfiles.formats.parquet import ParquetWriter

        return ParquetWriter(path, num_keys, vec_size)
    if fmt == "safetensors":
        from hps.modelfiles.formats.safetensors import SafetensorsWriter

        return SafetensorsWriter(path, num_keys, vec_size)
    if fmt == "numpy":
        from hps.modelfiles.formats.numpy import NpzWriter, NumpyFolderWriter

        if path.lower().endswith(".npz"):
            return NpzWriter(path, num_keys, vec_size)
        return NumpyFolderWriter(path, num_keys, vec_size)
    from hps.modelfiles.formats.sparse_folder import SparseFolderWriter

    return SparseFolderWriter(path, num_keys, vec_size)
