"""What one `sparse_files` entry says: where a table is, in which format, read how.

An entry of `sparse_files` is a plain string (the format then comes from the path's
suffix or the folder's contents) or an object with `path`, `format` and the options of
that format:

    format          options (defaults)
    sparse_folder   none: HugeCTR's `key` + `emb_vector` folder
    parquet         key_column ("key"), vector_column ("vector")
    numpy           none: a folder with keys.npy + vectors.npy, or one .npz holding both
    safetensors     tensor (the only 2-D tensor, else "weight"), keys_tensor (none: keys
                    are the row index + key_offset), key_offset (0)
    torch           a torch.save state_dict: the same options as safetensors, `tensor`
                    being the state_dict key ("embedding.weight",
                    "ebc.embedding_bags.<table>.weight")
    dcp             a torch.distributed.checkpoint folder (`.metadata`): tensor (the
                    state_dict key; default the only 2-D tensor), key_offset (0)

This module is a leaf (it imports nothing from hps but errors) so that the config can
validate entries with it.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass, fields
from typing import Literal

FormatName = Literal["sparse_folder", "parquet", "numpy", "safetensors", "torch", "dcp"]
FORMATS: tuple[str, ...] = ("sparse_folder", "parquet", "numpy", "safetensors", "torch", "dcp")

#: the options each format takes; any other option set for it is a mistake
FORMAT_OPTIONS: dict[str, tuple[str, ...]] = {
    "sparse_folder": (),
    "parquet": ("key_column", "vector_column"),
    "numpy": (),
    "safetensors": ("tensor", "keys_tensor", "key_offset"),
    "torch": ("tensor", "keys_tensor", "key_offset"),
    "dcp": ("tensor", "key_offset"),
}

#: file suffixes that name a format (a path without one is a folder, read by its contents)
SUFFIX_FORMATS: dict[str, str] = {
    ".parquet": "parquet",
    ".pq": "parquet",
    ".npz": "numpy",
    ".safetensors": "safetensors",
    ".pt": "torch",
    ".pth": "torch",
    ".bin": "torch",
    ".ckpt": "torch",
}

#: suffixes of plain pickles, refused: unpickling runs arbitrary code (torch.save's zip
#: files are read without it: torch_state.py)
PICKLE_SUFFIXES = (".pkl", ".pickle")

#: why a pickle is refused, and how to save the weights instead
PICKLE_HINT = (
    "is a pickled PyTorch file; hps does not unpickle (loading a pickle can run any code). "
    "Save the weights as safetensors instead: `from safetensors.torch import save_file; "
    "save_file(model.state_dict(), 'table.safetensors')` (for one nn.Embedding: "
    "save_file({'weight': emb.weight.detach().contiguous()}, 'table.safetensors'))"
)


@dataclass(frozen=True)
class TableSpec:
    """One table's model files: `path` (a local path or URI), `format` and its options.

    `format=None` means: infer it from the suffix or the folder's contents. Options left
    as None take the format's defaults. Raises ValueError (a ConfigError in a config)
    when an option belongs to another format than the one named.
    """

    path: str
    format: FormatName | None = None
    key_column: str | None = None
    vector_column: str | None = None
    tensor: str | None = None
    keys_tensor: str | None = None
    key_offset: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path.strip():
            raise ValueError("a sparse_files entry needs a non-empty 'path'")
        for name in ("key_column", "vector_column", "tensor", "keys_tensor"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a string, got {getattr(self, name)!r}")
        offset = self.key_offset
        if offset is not None and (not isinstance(offset, int) or isinstance(offset, bool)):
            raise ValueError(f"key_offset must be an integer, got {offset!r}")
        if self.format is not None and self.format not in FORMATS:
            raise ValueError(f"format {self.format!r} is not one of {', '.join(FORMATS)}")
        if self.format is not None:
            wrong = [name for name in self.options_set() if name not in FORMAT_OPTIONS[self.format]]
            if wrong:
                raise ValueError(self.misplaced(wrong, self.format))
        if self.key_offset is not None and self.key_offset < 0:
            raise ValueError(f"key_offset must be >= 0, got {self.key_offset}")

    @staticmethod
    def misplaced(options: list[str], fmt: str) -> str:
        """The message for options set on a format that does not take them."""
        takes = ", ".join(FORMAT_OPTIONS[fmt]) or "no options"
        return f"{', '.join(options)} do(es) not apply to format {fmt!r} (it takes {takes})"

    @classmethod
    def of(cls, entry: str | TableSpec) -> TableSpec:
        """An entry as a TableSpec (a plain string is a path with every default)."""
        return entry if isinstance(entry, TableSpec) else cls(path=entry)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def options_set(self) -> list[str]:
        """The format options given (not left to their defaults)."""
        return [
            f.name
            for f in fields(self)
            if f.name not in ("path", "format") and getattr(self, f.name) is not None
        ]

    @property
    def suffix(self) -> str:
        """The lower-case suffix of the path's last component ('' for none)."""
        return posixpath.splitext(self.path.rstrip("/"))[1].lower()
