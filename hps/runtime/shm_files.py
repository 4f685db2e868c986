"""What hps finds under the shared-memory base (`$HPS_SHM_DIR`, else /dev/shm) is trusted
only once it is checked to be this user's own.

/dev/shm is writable by every user of the host (mode 1777), and the names hps uses there
are predictable (`hps-mp-<pid>`, `hps-gpu-cache-<uid>/<key>.table`), so anyone can plant
a file, a symbolic link or a folder of theirs under one of them first. Every folder hps
makes there is therefore mode 0700 and checked after it is made or found: a real folder
(not a link), owned by this process's user, closed to everyone else. Every file of such a
folder that hps maps is opened without following a link (O_NOFOLLOW) and checked before it
is trusted: a regular file of this user's, with one name, that others cannot write. What
fails a check is refused with `NotOurs`, whose message says why; callers wrap it in the
error of their layer.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

#: the permission bits a folder of ours may not have: anything for the group or others
_OPEN_TO_OTHERS = 0o077
#: those a file of ours may not have: writing by the group or others (its folder, 0700,
#: keeps others from reading it)
_WRITABLE_BY_OTHERS = 0o022


class NotOurs(Exception):
    """A path under the shared-memory base that this process must not trust; the message
    says why (its type, owner or mode)."""


def me() -> int:
    """The user whose files this process trusts (its effective uid)."""
    return os.geteuid()


def user_name(uid: int) -> str:
    """`uid` with its login name where the host knows it: `65534 (nobody)`."""
    import pwd

    try:
        return f"{uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return str(uid)


def _problem(st: os.stat_result, what: str) -> str | None:
    """Why a path whose lstat/fstat is `st` is not a `what` ('folder' or 'file') of this
    user's, closed to others (a folder) or that others cannot write (a file); None when it
    is."""
    mode = st.st_mode
    if stat.S_ISLNK(mode):
        return "is a symbolic link"
    if what == "folder" and not stat.S_ISDIR(mode):
        return "is not a folder"
    if what == "file" and not stat.S_ISREG(mode):
        return "is not a regular file"
    if st.st_uid != me():
        return f"belongs to user {user_name(st.st_uid)}, not to this process's {user_name(me())}"
    if mode & (_OPEN_TO_OTHERS if what == "folder" else _WRITABLE_BY_OTHERS):
        return f"has mode {stat.S_IMODE(mode):04o}, open to other users"
    if what == "file" and st.st_nlink != 1:
        return f"has {st.st_nlink} names (a hard link)"
    return None


def check_folder(path: Path) -> None:
    """Raises NotOurs unless `path` is a folder (not a link) of this user's, mode 0700 or
    narrower; FileNotFoundError when it is absent."""
    problem = _problem(os.lstat(path), "folder")
    if problem:
        raise NotOurs(f"{path} {problem}")


def private_folder(path: Path) -> Path:
    """`path`, made (mode 0700) unless it exists, then checked (check_folder). Its parent
    (the shared-memory base, the user's choice) is made if missing, not checked."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    check_folder(path)
    return path


def open_file(path: Path, flags: int) -> tuple[int, os.stat_result]:
    """An fd of `path` opened with `flags` plus O_NOFOLLOW and O_NONBLOCK (a FIFO planted
    there does not block the open), and its fstat, once checked to be a regular file of
    this user's with one name that others cannot write. Raises NotOurs otherwise (the fd
    closed), FileNotFoundError when it is absent."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        if os.path.islink(path):
            raise NotOurs(f"{path} is a symbolic link") from None
        raise NotOurs(f"{path} cannot be opened ({exc.strerror})") from None
    st = os.fstat(fd)
    problem = _problem(st, "file")
    if problem:
        os.close(fd)
        raise NotOurs(f"{path} {problem}")
    return fd, st


def clear_stale(path: Path) -> bool:
    """Removes what is at `path` when it is this user's (a folder with its contents, or a
    file or link itself, never what a link points to); True if something was removed,
    False if nothing was there. Raises NotOurs, leaving it, when it is another user's."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if st.st_uid != me():
        kind = ("a symbolic link" if stat.S_ISLNK(st.st_mode) else "a folder"
                if stat.S_ISDIR(st.st_mode) else "a file")
        raise NotOurs(f"{path} is in the way: {kind} of user {user_name(st.st_uid)}, not "
                      f"of this process's {user_name(me())}")
    if stat.S_ISDIR(st.st_mode):
        import shutil

        shutil.rmtree(path)
    else:
        path.unlink()
    return True


def mapped_by(folder: Path) -> list[int]:
    """PIDs of this user's processes that map a file of `folder` (their /proc/<pid>/maps
    name it), this process's own included. A process whose maps this user cannot read is
    not among them: one made not dumpable (setuid programs, key agents) or of another user
    namespace (a container's init), never a plain process of this user's such as hps's.
    Empty where there is no /proc."""
    prefix = os.path.realpath(folder).encode() + b"/"  # maps name files by their real path
    users: list[int] = []
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):  # a loop over the host's processes, once a run
            if not entry.name.isdigit():
                continue
            try:
                if entry.stat(follow_symlinks=False).st_uid != me():
                    continue
                maps = Path(entry.path, "maps").read_bytes()
            except OSError:
                continue  # gone meanwhile, or not readable (see above)
            if b" " + prefix in maps:
                users.append(int(entry.name))
    return users
