"""Files written whole or not at all.

``atomic_write(path)`` yields a temporary file in ``path``'s directory; when
the ``with`` block ends normally the file is flushed, fsynced and renamed onto
``path`` (``os.replace``, atomic on POSIX and Windows). On any exception,
KeyboardInterrupt included, the temporary file is removed and ``path`` keeps
its old content (or stays absent). A process killed outright (SIGKILL, power
loss) can leave the temporary file behind: it is hidden and named
``.NAME.XXXXXXXX.tmp``, so it is never mistaken for ``NAME``; delete it.

Failures raise ``WriteError``, an ``OSError`` (same ``errno``) whose message is
one line naming the file and the reason.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Iterator
from typing import IO, Any, Union

PathLike = Union[str, "os.PathLike[str]"]

__all__ = ["WriteError", "atomic_write", "check_writable", "make_directory"]


class WriteError(OSError):
    """``path`` could not be written (or created, for a directory).

    ``str()`` is one line: ``cannot write PATH: REASON``.
    """

    def __init__(self, path: PathLike, cause: OSError, action: str = "write") -> None:
        super().__init__(cause.errno, cause.strerror or str(cause), os.fspath(path))
        self.path, self.action = os.fspath(path), action

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.path, OSError(self.errno, self.strerror), self.action)

    def __str__(self) -> str:
        parent = os.path.dirname(os.path.abspath(self.path))
        if self.errno == errno.ENOENT and not os.path.isdir(parent):
            reason = f"directory {parent} does not exist"
        elif self.errno == errno.ENOTDIR:
            reason = f"{_first_file(parent)} is not a directory"
        else:
            reason = self.strerror or f"error {self.errno}"
        return f"cannot {self.action} {self.path}: {reason}"


def _first_file(directory: str) -> str:
    """The first component of ``directory`` that exists and is not a directory."""
    parts = os.path.abspath(directory).split(os.sep)
    for i in range(2, len(parts) + 1):
        head = os.sep.join(parts[:i]) or os.sep
        if os.path.exists(head) and not os.path.isdir(head):
            return head
    return directory


def _create_temp(target: str) -> tuple[int, str]:
    """(fd, name) of a new, empty file beside ``target``, mode 0o666 less the umask."""
    head, tail = os.path.split(target)
    while True:
        name = os.path.join(head, f".{tail}.{secrets.token_hex(4)}.tmp")
        try:
            return os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), name
        except FileExistsError:
            continue


def _target(path: PathLike) -> str:
    """The file that writing ``path`` replaces (links followed); raise
    ``WriteError`` for a name that is not, or must not become, a regular file:
    a trailing slash (a directory's name), a directory, a FIFO, a device, a
    socket. ``--force`` style callers must never replace those."""
    name = os.fspath(path)
    target = os.path.realpath(name)
    try:
        mode = os.stat(target).st_mode
    except OSError:
        mode = None
    if mode is not None and stat.S_ISDIR(mode):
        raise WriteError(path, OSError(errno.EISDIR, "Is a directory"))
    if name.endswith(tuple(filter(None, (os.sep, os.altsep)))):
        raise WriteError(path, OSError(errno.EISDIR, "a trailing slash names a directory"))
    if mode is not None and not stat.S_ISREG(mode):
        raise WriteError(path, OSError(errno.EEXIST, f"it is {_kind(mode)}, not a regular file"))
    return target


def _kind(mode: int) -> str:
    for test, kind in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return kind
    return "a special file"


def _fsync_directory(directory: str) -> None:
    """Make the rename durable; not every system can open a directory."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_write(
    path: PathLike, mode: str = "wb", encoding: str | None = None
) -> Iterator[IO[Any]]:
    """Yield a file (opened with ``mode``, "wb" or "w") whose content replaces
    ``path`` only when the block completes; see the module's docstring.

    A symbolic link at ``path`` is followed: its target is replaced. Replacing
    an existing file keeps that file's permission bits. Only a regular file is
    ever replaced: a directory, FIFO, device or socket at ``path``, or a name
    ending in a slash, raises ``WriteError`` and is left alone.
    """
    if mode not in ("wb", "w"):
        raise ValueError(f"mode: expected 'wb' or 'w', got {mode!r}")
    target = _target(path)
    try:
        fd, temp = _create_temp(target)
    except OSError as exc:
        raise WriteError(path, exc) from exc
    try:
        with open(fd, mode, encoding=encoding if mode == "w" else None) as f:
            with contextlib.suppress(FileNotFoundError):
                os.chmod(temp, stat.S_IMODE(os.stat(target).st_mode))
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, target)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        if isinstance(exc, OSError) and not isinstance(exc, WriteError):
            raise WriteError(path, exc) from exc
        raise
    _fsync_directory(os.path.dirname(target))


def check_writable(path: PathLike) -> None:
    """Raise ``WriteError`` now, unless a file can be created beside ``path``
    (for a command that would otherwise find out only after its work), and
    unless ``path`` may be replaced (see ``atomic_write``)."""
    target = _target(path)
    try:
        fd, temp = _create_temp(target)
    except OSError as exc:
        raise WriteError(path, exc) from exc
    os.close(fd)
    os.unlink(temp)


def make_directory(path: PathLike) -> None:
    """Create the directory ``path`` unless it exists; its parent must exist."""
    try:
        os.mkdir(path)
    except FileExistsError as exc:
        if not os.path.isdir(path):
            raise WriteError(
                path, OSError(errno.EEXIST, "it exists and is not a directory"), "create directory"
            ) from exc
    except OSError as exc:
        raise WriteError(path, exc, "create directory") from exc
