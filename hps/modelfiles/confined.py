"""Local model folders read beneath an allowed root: files opened, not paths checked.

A model added or reloaded over HTTP names its folders; the server may read only beneath
its allowed roots (hps.http.roots). Checking a resolved path and then opening it leaves a
window: a symbolic link swapped between the check and the open (or a file in the folder
that is itself a link out) makes the open read outside. Here nothing is checked and then
opened: the root is opened once as a directory handle, the folder is opened relative to
it by the kernel with every component resolved beneath it, each file is opened relative
to the folder's handle the same way, and what the readers read is that file descriptor
(`os.pread`), never a path. A file swapped after its open is not seen; one whose
resolution leaves the root is refused (SourceAccessError, naming the path only: nothing
of a file outside, not even its size, reaches an answer).

    open_beneath(dir_fd, path)     openat2(RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS) where
                                   the kernel has it (Linux 5.6+); else
    open_by_components(dir_fd, path)   one O_NOFOLLOW open per component (no link is
                                   followed at all, `..` refused): stricter, same promise
    ConfinedSource                 a ModelSource over those handles (not a LocalSource, so
                                   formats read it through the ranged-read contract, never
                                   by path: no memory map of a path that could be swapped)
    confined(roots, fn, *args)     `fn(*args)` with every local source opened meanwhile
                                   (in this context) confined to `roots`

Which sources are confined travels in a ContextVar set by `confined`: the HTTP layer
wraps only the loads a request named sources for; models of the config (trusted) are
read by LocalSource as before. A source captures the roots when it is opened, so reads
on other threads later (read-ahead) stay confined. A version keeps the roots its files
were read beneath (hps.server.registry): a plain reload of the same files and a refill
of the volatile tier on a background thread open them beneath those roots again.
"""

from __future__ import annotations

import contextvars
import ctypes
import errno
import os
import stat
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import TypeVar

from hps.errors import SourceAccessError, SourceError, SourceNotFoundError
from hps.modelfiles.source import ModelSource, check_length, file_size

T = TypeVar("T")

#: openat2's number is the same on every Linux architecture (new syscalls share one table)
_SYS_OPENAT2 = 437
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_BENEATH = 0x08
_ESCAPES = (errno.EXDEV, errno.ELOOP)
_READ = os.O_RDONLY | os.O_CLOEXEC

_roots: contextvars.ContextVar[tuple[str, ...] | None] = contextvars.ContextVar(
    "hps_confined_roots", default=None)


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                ("resolve", ctypes.c_uint64)]


def _load_syscall() -> Callable[..., int] | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        call = libc.syscall
    except (OSError, AttributeError):
        return None
    call.restype = ctypes.c_long
    return call  # type: ignore[no-any-return]


_syscall = _load_syscall()
_openat2_missing = _syscall is None


class Escape(SourceAccessError):
    """A path whose resolution leaves the directory it is opened beneath."""


def open_by_components(dir_fd: int, path: str, *, directory: bool = False) -> int:
    """A descriptor of `path` (relative) opened beneath `dir_fd` one component at a time,
    each with O_NOFOLLOW: a symbolic link anywhere, or a `..`, is an Escape. OSError for
    what the file system says otherwise (FileNotFoundError, NotADirectoryError...)."""
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise Escape(f"{path!r}: '..' may not lead out of the allowed root")
    if not parts:
        return os.open(".", _READ | os.O_DIRECTORY, dir_fd=dir_fd)
    current = dir_fd
    try:
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            flags = _READ | os.O_NOFOLLOW | (os.O_DIRECTORY if directory or not last else 0)
            try:
                opened = os.open(part, flags, dir_fd=current)
            except OSError as exc:
                if exc.errno == errno.ELOOP or (exc.errno == errno.ENOTDIR and _is_link(
                        part, current)):
                    raise Escape(f"{path!r}: {part!r} is a symbolic link (links are not "
                                 "followed beneath an allowed root here)") from None
                raise
            if current != dir_fd:
                os.close(current)
            current = opened
    except BaseException:
        if current != dir_fd:
            os.close(current)
        raise
    return current


def _is_link(name: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def open_beneath(dir_fd: int, path: str, *, directory: bool = False) -> int:
    """A descriptor of `path` (relative) resolved by the kernel beneath `dir_fd`
    (openat2 RESOLVE_BENEATH; links that stay beneath are followed), else, where the
    kernel lacks openat2 or a sandbox refuses it, `open_by_components`. Escape when the
    resolution would leave `dir_fd`; OSError for what the file system says otherwise."""
    global _openat2_missing
    if _openat2_missing or _syscall is None:
        return open_by_components(dir_fd, path, directory=directory)
    how = _OpenHow(_READ | (os.O_DIRECTORY if directory else 0), 0,
                   _RESOLVE_BENEATH | _RESOLVE_NO_MAGICLINKS)
    fd = _syscall(_SYS_OPENAT2, dir_fd, os.fsencode(path or "."), ctypes.byref(how),
                  ctypes.sizeof(how))
    if fd >= 0:
        return int(fd)
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EPERM):  # old kernel, or seccomp refusing the call
        _openat2_missing = True
        return open_by_components(dir_fd, path, directory=directory)
    if err in _ESCAPES:
        raise Escape(f"{path!r} leads out of the allowed root (through '..' or a "
                     "symbolic link)")
    raise OSError(err, os.strerror(err), path)


def confined(roots: Sequence[str] | None, fn: Callable[..., T], *args: object) -> T:
    """`fn(*args)`, with every local model source opened meanwhile in this context
    confined beneath one of `roots` (resolved local folders; URI roots are ignored
    here). `roots` None: `fn(*args)` as it is."""
    if roots is None:
        return fn(*args)
    token = _roots.set(tuple(r for r in roots if "://" not in r))
    try:
        return fn(*args)
    finally:
        _roots.reset(token)


def current_roots() -> tuple[str, ...] | None:
    """The roots local sources opened now are confined to; None when unconfined."""
    return _roots.get()


def _relative(path: str, roots: Sequence[str]) -> tuple[str, str]:
    """(root, `path` relative to it) for the first root `path` lies under, textually
    (normalised), else as resolved now: either way the open is beneath the root, so a
    resolution that changes later cannot lead out. SourceAccessError under none."""
    for candidate in (os.path.normpath(path), os.path.realpath(path)):
        for root in roots:
            base = root.rstrip(os.sep) or os.sep
            if candidate == base:
                return root, ""
            if candidate.startswith(base.rstrip(os.sep) + os.sep):
                return root, candidate[len(base.rstrip(os.sep)) + 1:]
    raise SourceAccessError(f"{path!r} is not under an allowed root "
                            f"(allowed: {', '.join(roots) or 'none'})")


def _close_all(fds: dict[str, int], folder: list[int]) -> None:
    for fd in [*fds.values(), *folder]:
        try:
            os.close(fd)
        except OSError:
            pass
    fds.clear()
    folder.clear()


class ConfinedSource(ModelSource):
    """A local model folder beneath one of `roots`, read through file descriptors.

    The folder and each file are opened once (on first use) beneath the root's handle
    and kept open until `close()`; `size` is the open file's, `read` reads it with
    `os.pread`. A file of the folder must lie in the folder (a link to a sibling folder
    is refused too). Escapes raise SourceAccessError (403 over HTTP) naming the path
    only; a missing folder or file SourceNotFoundError.
    """

    def __init__(self, uri: str, path: str, roots: Sequence[str]) -> None:
        super().__init__(uri)
        self.path = path
        self.root, self._relative = _relative(path, roots)
        self._lock = threading.Lock()
        self._fds: dict[str, int] = {}
        self._folder: list[int] = []
        self._finalizer = weakref.finalize(self, _close_all, self._fds, self._folder)

    def _folder_fd(self) -> int:
        if self._folder:
            return self._folder[0]
        try:
            root_fd = os.open(self.root, _READ | os.O_DIRECTORY)
        except OSError as exc:
            raise SourceError(f"cannot open the allowed root {self.root!r}: "
                              f"{exc.strerror}") from exc
        try:
            self._folder.append(open_beneath(root_fd, self._relative, directory=True))
        except FileNotFoundError:
            raise SourceNotFoundError(f"model folder {self.path!r} does not exist") from None
        except NotADirectoryError:
            raise SourceError(f"{self.path!r} is not a folder") from None
        except Escape as exc:
            raise SourceAccessError(f"model folder {self.path!r} leads out of the allowed "
                                    f"root {self.root!r}") from exc
        except OSError as exc:
            raise SourceError(f"cannot open {self.path!r}: {exc.strerror}") from exc
        finally:
            os.close(root_fd)
        return self._folder[0]

    def _fd(self, name: str) -> int:
        with self._lock:
            fd = self._fds.get(name)
            if fd is not None:
                return fd
            if "/" in name or name in ("", ".", ".."):
                raise SourceAccessError(f"{self.describe(name)}: not a file name of the folder")
            folder = self._folder_fd()
            where = os.path.join(self.path, name)
            try:
                fd = open_beneath(folder, name)
            except FileNotFoundError:
                raise SourceNotFoundError(f"{where!r} does not exist") from None
            except Escape:
                raise SourceAccessError(f"{where!r} leads out of its model folder (a "
                                        "symbolic link): refused beneath an allowed root"
                                        ) from None
            except OSError as exc:
                raise SourceError(f"cannot read {where!r}: {exc.strerror}") from exc
            self._fds[name] = fd
            return fd

    def size(self, name: str) -> int:
        return file_size(os.fstat(self._fd(name)), self.describe(name))

    def read(self, name: str, offset: int, length: int) -> bytes:
        if offset < 0 or length < 0:
            raise SourceError(f"{self.describe(name)}: invalid range offset={offset} "
                              f"length={length}")
        fd = self._fd(name)
        parts = []
        done = 0
        try:
            while done < length:
                part = os.pread(fd, length - done, offset + done)
                if not part:
                    break
                parts.append(part)
                done += len(part)
        except OSError as exc:
            raise SourceError(f"cannot read {self.describe(name)!r}: {exc.strerror}") from exc
        return check_length(self, name, offset, length, b"".join(parts))

    def names(self) -> list[str]:
        with self._lock:
            folder = self._folder_fd()
            listing = os.open(".", _READ | os.O_DIRECTORY, dir_fd=folder)
        try:
            with os.scandir(listing) as entries:  # its own handle: its own read position
                return sorted(e.name for e in entries if e.is_file(follow_symlinks=False))
        except OSError as exc:
            raise SourceError(f"cannot list {self.path!r}: {exc.strerror}") from exc
        finally:
            os.close(listing)

    def close(self) -> None:
        with self._lock:
            self._finalizer()
