"""One file of a ModelSource as a read-only, seekable binary file object.

Libraries that parse a container (pyarrow's Parquet footer, `zipfile` for `.npz`) want a
file object; this one turns each `read` into a ranged read of the source, so a remote
file is never downloaded whole: only the byte ranges the parser asks for travel. Wrap it
in `io.BufferedReader` when the parser makes many small reads.
"""

from __future__ import annotations

import io

from hps.modelfiles.source import ModelSource


class SourceFile(io.RawIOBase):
    """File `name` of `source`, `size` bytes long, read through ranged reads."""

    def __init__(self, source: ModelSource, name: str, size: int | None = None) -> None:
        super().__init__()
        self.source = source
        self.name = name
        self.size = source.size(name) if size is None else size
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence]
        if base + offset < 0:
            raise ValueError(f"{self.source.describe(self.name)}: seek before the start")
        self._pos = base + offset
        return self._pos

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        view = memoryview(buffer).cast("B")
        length = max(0, min(len(view), self.size - self._pos))
        if length:
            view[:length] = self.source.read(self.name, self._pos, length)
            self._pos += length
        return length

    def readall(self) -> bytes:
        length = max(0, self.size - self._pos)
        data = self.source.read(self.name, self._pos, length) if length else b""
        self._pos += length
        return data
