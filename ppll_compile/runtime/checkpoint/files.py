"""The file operations of a checkpoint save: files created exclusively under random names, fsynced before they are
renamed into place; one writer per checkpoint root (a lock file); leftovers removed where the directory allows it;
a failed save's operating-system error told in words.

Every file a save creates is opened with ``O_CREAT | O_EXCL | O_NOFOLLOW``: a name that already exists, a
symbolic link included, is never opened, so nobody who can write into the checkpoint root can make a save write
through a planted link. Temporary names carry a random part (:func:`temp_name`), so they cannot be guessed.

Every file a load reads goes through :func:`read_regular`: a FIFO, a device, a socket or a directory is refused
without being opened for reading, so is a file that resolves out of the checkpoint root (a planted link to
``/dev/zero`` or to another user's file), and a file larger than its reader expects is refused before a byte of it
is read.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import shutil
import stat
import time
import warnings
from collections.abc import Callable
from pathlib import Path

from ... import documents
from ...documents import NotRegular, TooLarge

try:
    import fcntl
except ImportError:  # not a POSIX system: saves are not locked
    fcntl = None  # type: ignore[assignment]

LOCK = ".lock"
"""The lock file in a checkpoint root; it exists only while a save holds it (or after a save was killed)."""
TEMP_MARK = ".tmp-"
"""What the name of every temporary entry of a save holds: ``.NAME.tmp-RANDOM``."""

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_TEMP = re.compile(r"^\.(?P<name>.+)\.tmp-[0-9a-f]{16}$")
STALE_SECONDS = 24 * 3600
"""On a file system without locks, how long a temporary file must be untouched to count as a killed write's."""
_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # opening a FIFO for reading returns at once instead of waiting


class RefusedFile(Exception):
    """A file :func:`read_regular` will not read: ``why`` says what it is, in words (never what it holds)."""

    def __init__(self, path: Path, why: str) -> None:
        super().__init__(f"{str(path)!r} {why}")
        self.path, self.why = path, why


def kind(mode: int) -> str:
    """What a file of ``st_mode`` ``mode`` is, in words (``a FIFO (named pipe)``, ``a directory``, ...)."""
    for test, words in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                        (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                        (stat.S_ISSOCK, "a socket"), (stat.S_ISREG, "a regular file")):
        if test(mode):
            return words
    return "a special file"


def read_regular(path: Path, root: Path, most: int) -> bytes:
    """The bytes of the regular file ``path``, which lies in the directory ``root`` (after every link is followed)
    and holds at most ``most`` bytes. Anything else raises :class:`RefusedFile` before a byte is read: a FIFO,
    device, socket or directory is never opened for reading (checked with ``stat`` first, then opened with
    ``O_NONBLOCK`` and checked again, so a file swapped in between cannot block), a file resolving out of ``root``
    (a link) is never opened, and the size is checked before reading. ``FileNotFoundError`` when it is missing."""
    real, base = Path(os.path.realpath(path)), Path(os.path.realpath(root))
    if real != base and not real.is_relative_to(base):
        os.lstat(path)  # a name that is not there at all: FileNotFoundError
        raise RefusedFile(path, f"resolves to {str(real)!r}, outside the checkpoint root {str(root)!r} (a symbolic "
                                f"link)")
    try:
        return documents.read_regular(path, most)
    except NotRegular as e:
        raise RefusedFile(path, f"is {kind(e.mode)}, not a regular file") from None
    except TooLarge as e:
        raise RefusedFile(path, f"has {e.size} bytes, more than the {most} expected" if e.size is not None else
                          f"grew past {most} bytes while it was read") from None


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


def open_held(path: Path) -> tuple[Path, int]:
    """A fresh temporary file beside ``path`` (:func:`temp_name`, created by :func:`open_new`), locked (``flock``)
    for as long as the descriptor is open: its name and a descriptor open for writing. A process killed while it
    writes leaves the file unlocked, so :func:`clean_dead_temps` tells it from a write still going on."""
    while True:
        temp = path.with_name(temp_name(path.name))
        fd = open_new(temp)
        try:
            if fcntl is not None:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in _NO_LOCKS:  # a fresh random name nobody else opened: should not happen
                os.close(fd)
                raise OSError(e.errno, e.strerror, str(temp)) from None
        try:
            if os.stat(temp, follow_symlinks=False).st_ino == os.fstat(fd).st_ino:
                return temp, fd
        except FileNotFoundError:
            pass  # a cleaner took it for a killed write's between the create and the lock: take another name
        os.close(fd)


def clean_dead_temps(directory: Path, names: Callable[[str], bool]) -> list[Path]:
    """Remove from ``directory`` the temporary files that killed writes left: entries named ``.NAME.tmp-`` and 16
    hex digits (:func:`temp_name`) with ``names(NAME)`` true, that are regular files (anything else is left, never
    opened) and that no writer holds (:func:`open_held`: a file whose lock this process can take has no live
    writer). On a file system without locks, only those untouched for :data:`STALE_SECONDS` go. What was removed."""
    removed = []
    try:
        entries = [e for e in directory.iterdir() if (m := _TEMP.match(e.name)) and names(m.group("name"))]
    except OSError:
        return removed
    for entry in entries:
        try:
            if not stat.S_ISREG(os.lstat(entry).st_mode):
                continue
            fd = os.open(entry, os.O_RDONLY | _NOFOLLOW | _NONBLOCK | _CLOEXEC)
        except OSError:
            continue
        try:
            info = os.fstat(fd)
            if stat.S_ISREG(info.st_mode) and _unheld(fd, info) \
                    and os.stat(entry, follow_symlinks=False).st_ino == info.st_ino:
                os.unlink(entry)  # while this process holds its lock: no writer can have taken it since
                removed.append(entry)
        except OSError:
            pass  # gone already, or the directory does not allow it
        finally:
            os.close(fd)
    return removed


def _unheld(fd: int, info: os.stat_result) -> bool:
    """Whether no writer holds the file open as ``fd`` (its lock taken here), or, without locks, it is stale."""
    if fcntl is None:
        return time.time() - info.st_mtime > STALE_SECONDS
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        return e.errno in _NO_LOCKS and time.time() - info.st_mtime > STALE_SECONDS
    return True


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
    """A descriptor of the regular file ``path`` (created when missing; a link is not followed; a FIFO, device or
    socket there is refused without being opened for reading)."""
    flags = os.O_RDONLY | _NOFOLLOW | _NONBLOCK | _CLOEXEC
    try:
        _refuse_special(path, os.lstat(path).st_mode)
        fd = os.open(path, flags)
    except FileNotFoundError:
        try:
            fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:  # another writer created it just now
            fd = os.open(path, flags)
    try:
        _refuse_special(path, os.fstat(fd).st_mode)
    except OSError:
        os.close(fd)
        raise
    return fd


def _refuse_special(path: Path, mode: int) -> None:
    if not stat.S_ISREG(mode) and not stat.S_ISLNK(mode):  # a link: the open refuses it (ELOOP)
        raise OSError(errno.EEXIST, f"{kind(mode)} stands there, not a regular file", str(path))


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
