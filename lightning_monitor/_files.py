"""How the monitor writes a file: whole files atomically, appends never through a symbolic link.

A whole file (the settings, a bundle's README, a rewritten alerts file) is written to a temporary file in the same
folder and moved over the old one with ``os.replace``: a full disk or a killed run leaves the old file or the new
one, never half of one, and a symbolic link in its place is replaced, never followed. An append opens the file with
``O_NOFOLLOW`` where the system has it, so a link planted in a run folder (one received from someone else) cannot
make the monitor write to the link's target.
"""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import IO, BinaryIO

__all__ = ["AppendFile", "SymlinkError", "append_bytes", "open_for_append", "write_atomic"]

#: ``O_NOFOLLOW`` where the system has it (not on Windows, where links need privileges to make).
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


class SymlinkError(OSError):
    """The file to append to is a symbolic link, which the monitor does not follow."""


def write_atomic(
    path: str | os.PathLike[str], write: bytes | str | Callable[[IO[bytes]], None], *, sync: bool = True
) -> None:
    r"""Write a whole file at once: into a temporary file beside ``path``, then moved over it.

    ``write`` is the content (text is written as UTF-8), or a function that writes it to the open binary file
    (``torch.save``, say). ``sync`` flushes the file to the disk before the move (not worth it for a large file
    that only this run reads back). On any failure the temporary file is removed and ``path`` is as it was; the
    error is raised as it came (``OSError``, or ``RuntimeError`` from ``torch.save`` on a full disk). The file gets
    the permissions a new file gets (the umask's), not the temporary file's owner-only ones.

    Example:
        >>> folder = Path(tempfile.mkdtemp())
        >>> write_atomic(folder / "a.txt", "one\n")
        >>> (folder / "link.txt").symlink_to(folder / "a.txt")
        >>> write_atomic(folder / "link.txt", "two\n")  # replaces the link, not its target
        >>> (folder / "a.txt").read_text(), (folder / "link.txt").is_symlink(), sorted(p.name for p in folder.iterdir())
        ('one\n', False, ['a.txt', 'link.txt'])
    """
    path = Path(path)
    fd, temp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            os.chmod(temp, 0o666 & ~_umask())
            if callable(write):
                write(f)
            else:
                f.write(write.encode("utf-8") if isinstance(write, str) else write)
            f.flush()
            if sync:
                os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise


@functools.cache
def _umask() -> int:
    """The process's umask (read once: reading it means setting it)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def append_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    r"""Append ``data`` to ``path`` (created if missing), never through a symbolic link.

    A last line a killed run left without its newline is ended first, so ``data`` starts a line of its own.

    Raises:
        SymlinkError: If ``path`` is a symbolic link (nothing is written).
        OSError: If the file cannot be written.

    Example:
        >>> path = Path(tempfile.mkdtemp()) / "log.jsonl"
        >>> _ = path.write_bytes(b'{"a": 1')  # cut short
        >>> append_bytes(path, b'{"a": 2}\n')
        >>> path.read_bytes()
        b'{"a": 1\n{"a": 2}\n'
    """
    with open_for_append(path) as f:
        f.write(data)
        f.flush()


def open_for_append(path: str | os.PathLike[str]) -> BinaryIO:
    """Open ``path`` to append whole lines (created if missing), never through a symbolic link.

    A last line a killed run left without its newline is ended first. The caller closes the file.

    Raises:
        SymlinkError: If ``path`` is a symbolic link (nothing is opened).
        OSError: If the file cannot be opened.
    """
    path = Path(path)
    link = f"{str(path)!r} is a symbolic link, which TrainingMonitor does not write through"
    if path.is_symlink():  # also where O_NOFOLLOW is missing
        raise SymlinkError(link)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | _NOFOLLOW, 0o666)
    except OSError as err:
        if path.is_symlink():  # made between the check and the open
            raise SymlinkError(link) from err
        raise
    f = os.fdopen(fd, "a+b")
    try:
        # In append mode every write goes to the end, wherever the read position is.
        if f.seek(0, os.SEEK_END) > 0:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                f.write(b"\n")
    except OSError:
        f.close()
        raise
    return f


class AppendFile:
    r"""A file appended to in whole lines, opened once at the first append and kept open; never a symbolic link.

    The folder is made and the file opened (:func:`open_for_append`) at the first append, so a later append costs one
    write: no folder made, no file opened. :meth:`close` (or the object going away) closes it; the next append opens it
    again. The alerts file and the history are appended to this way.

    Args:
        path: The file. Its folder is made at the first append when missing.

    Example:
        >>> path = Path(tempfile.mkdtemp()) / "run" / "log.jsonl"
        >>> log = AppendFile(path)
        >>> log.append(b'{"step": 1}\n'), log.append(b'{"step": 2}\n'), log.close()
        (None, None, None)
        >>> path.read_bytes()
        b'{"step": 1}\n{"step": 2}\n'
        >>> log.set_aside().name, path.exists()
        ('log.jsonl.1', False)
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._file: BinaryIO | None = None
        self._closer: weakref.finalize | None = None  # closes it when the object goes, if `close` was not called

    def append(self, data: bytes) -> None:
        """Append ``data`` (whole lines) and flush it; the first call makes the folder and opens the file, once.

        Raises:
            SymlinkError: If the file is a symbolic link (nothing is written).
            OSError: When the folder cannot be made or the file cannot be opened or written.
        """
        f = self._file
        if f is None:  # a run killed mid-write left a line without its newline: it is ended first
            self.path.parent.mkdir(parents=True, exist_ok=True)
            f = open_for_append(self.path)  # never through a symbolic link
            self._file, self._closer = f, weakref.finalize(self, f.close)
        f.write(data)
        f.flush()

    def close(self) -> None:
        """Close the file (the next append opens it again)."""
        if self._closer is not None:
            self._closer()
        self._file = self._closer = None

    def set_aside(self) -> Path | None:
        """Move the file an earlier run left out of the way, to the first free ``<name>.<n>``; return where, if moved.

        For a run that starts afresh in a folder an earlier run wrote to (``logger=False``, or a fixed logger
        ``version``), as Lightning's CSV logger starts its ``metrics.csv`` afresh. A symbolic link stays where it is
        (the first append then raises :class:`SymlinkError`); a file that cannot be moved stays too, and is appended to.
        """
        self.close()
        try:  # a path the system cannot look up (too long) has no earlier file to move, like a missing one
            if self.path.is_symlink() or not self.path.is_file():
                return None
            n = 1
            while (aside := self.path.with_name(f"{self.path.name}.{n}")).exists():
                n += 1
            self.path.rename(aside)
        except OSError:
            return None
        return aside
