"""The file operations of a checkpoint save: files created exclusively under random names, fsynced before they are
renamed into place; one writer per checkpoint root (a lock file); leftovers removed where the directory allows it;
a failed save's operating-system error told in words.

Every file a save creates is opened with ``O_CREAT | O_EXCL | O_NOFOLLOW``: a name that already exists, a
symbolic link included, is never opened, so nobody who can write into the checkpoint root can make a save write
through a planted link. Temporary names carry a random part (:func:`temp_name`), so they cannot be guessed.
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
import stat
import warnings
from pathlib import Path

try:
    import fcntl
except ImportError:  # not a POSIX system: saves are not locked
    fcntl = None  # type: ignore[assignment]

LOCK = ".lock"
"""The lock file in a checkpoint root; it exists only while a save holds it (or after a save was killed)."""
TEMP_MARK = ".tmp-"
"""What the name of every temporary entry of a save holds: ``.NAME.tmp-RANDOM``."""

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def temp_name(name: str) -> str:
    """A fresh temporary name for ``name`` (``.NAME.tmp-`` and 16 random hex digits): never the same twice and
    never predictable, so a link planted in advance cannot stand in its way."""
    return f".{name}{TEMP_MARK}{secrets.token_hex(8)}"


def fsync_dir(path: Path) -> None:
    """Make the entries of the directory ``path`` (renames, new files) durable."""
    fd = os.open(path, os.O_RDONLY | _CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open_new(path: Path) -> int:
    """A descriptor, open for writing, of the file ``path`` created now: it must not exist (a link there is not
    followed: ``FileExistsError`` or ``ELOOP``); mode 0o644 (less the umask)."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o644)


def write_new(path: Path, data: bytes) -> None:
    """Create the file ``path`` (see :func:`open_new`), write ``data``, flush and fsync it. An error names ``path``."""
    fd = open_new(path)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(path)) from e
    finally:
        os.close(fd)


def replace_with(path: Path, data: bytes) -> None:
    """Replace the file ``path`` atomically by one holding ``data``: written under a fresh temporary name beside it
    (:func:`write_new`), renamed over ``path``, then the directory fsynced. A reader sees the old file or the new
    one, never a part; a killed writer leaves only a temporary file."""
    temp = path.with_name(temp_name(path.name))
    try:
        write_new(temp, data)
        os.replace(temp, path)
    except BaseException:
        remove_quietly(temp)
        raise
    fsync_dir(path.parent)


def remove_quietly(path: Path) -> bool:
    """Remove the file, link or directory tree ``path`` (a link itself, never what it points to); whether it is
    gone. A directory that does not allow it (read-only, permissions) leaves it where it is, without an error."""
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    except OSError:
        return False
    return True


class RootLock:
    """The exclusive lock on a checkpoint root a save holds from start to end: ``flock`` on ``root/.lock``,
    never waited for. A second writer (another trainer, thread or process) fails at once with ``BlockingIOError``
    naming the lock file. :meth:`release` removes the file while it still holds the lock, so the root keeps no
    trace of a save that finished."""

    def __init__(self, root: Path) -> None:
        self.path = root / LOCK
        while True:
            fd = _open_lock(self.path)
            try:
                if fcntl is not None:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno in _NO_LOCKS:  # a file system without locks: saves go on, unguarded
                    warnings.warn(f"{str(root)!r} is on a file system without file locks ({e.strerror}): a second "
                                  f"trainer saving into it at the same time is not detected; give every trainer "
                                  f"its own checkpoint directory", stacklevel=2)
                    self._fd = fd
                    return
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise BlockingIOError(errno.EWOULDBLOCK, "another save holds the lock", str(self.path)) from None
                raise OSError(e.errno, e.strerror, str(self.path)) from None
            try:
                same = os.stat(self.path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:  # not a file its last holder removed after this process opened it: the root's lock
                self._fd: int | None = fd
                return
            os.close(fd)

    def release(self) -> None:
        """Remove the lock file (where the directory allows it) and unlock; a second call does nothing."""
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)
        except OSError:
            pass  # a read-only root: the next save locks the same file
        finally:
            os.close(self._fd)  # closing the last descriptor unlocks
            self._fd = None


def _open_lock(path: Path) -> int:
    """A descriptor of the regular file ``path`` (created when missing; a link is not followed)."""
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _CLOEXEC)
    except FileNotFoundError:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o644)
        except FileExistsError:  # another writer created it just now
            fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EEXIST, "not a regular file", str(path))
    return fd


_CAUSES = {
    errno.ENOSPC: ("the disk is full", "free space on that disk or save into another directory"),
    errno.EDQUOT: ("the disk quota of this user is used up", "free space or save into another directory"),
    errno.EFBIG: ("a file would grow larger than the file system or the process's file-size limit allows (file "
                  "too large)", "save onto a file system that takes larger files, or raise the limit (ulimit -f)"),
    errno.EROFS: ("the directory is on a read-only file system", "save into a writable directory"),
    errno.EACCES: ("this process may not write there (permission denied)",
                   "save into a directory this user may write, or change its permissions"),
    errno.EPERM: ("this process may not write there (operation not permitted)",
                  "save into a directory this user may write, or change its permissions"),
    errno.ENOTDIR: ("a part of the path is a file, not a directory", "pass the path of a directory"),
    errno.ENAMETOOLONG: ("the path is too long for the file system", "pass a shorter path"),
    errno.ELOOP: ("a symbolic link stands where the save creates a file (links are never followed there)",
                  "remove that link, or save into a directory only you can write"),
    errno.EEXIST: ("something already stands where the save creates a file (it is never overwritten)",
                   "remove it, or save into a directory only you can write"),
    errno.EWOULDBLOCK: ("another save into this directory is in progress (another trainer or process holds its "
                        "lock)", "wait until that save has finished and save again, or save into another directory"),
    errno.EIO: ("the storage reported an input/output error", "check the disk, or save into another directory"),
}


def cause(error: BaseException, root: Path) -> tuple[str, str]:
    """``error`` (of a save into ``root``) in words, and the way out."""
    if isinstance(error, OSError) and error.errno is not None:
        words, way = _CAUSES.get(error.errno, ("the operating system refused it", "save into another directory"))
        if error.errno == errno.ENOTDIR and error.filename is not None and Path(error.filename) == root \
                and root.is_file():
            words, way = "the path is a file; a checkpoint is a directory (one file per stage plus manifest.json)", \
                "pass the path of a directory"
        code = errno.errorcode.get(error.errno, str(error.errno))
        where = ""
        if error.filename is not None:
            file = Path(os.fsdecode(error.filename))
            where = f" on {str(file.relative_to(root)) if file.is_relative_to(root) and file != root else str(file)!r}"
        return f"{words} ({code}: {error.strerror}{where})", way
    return f"{error}", "pass the path of a directory"
