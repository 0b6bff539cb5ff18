"""Atomic file writes: a reader sees the old file or the new one, never half of one.

Files get the mode a plain open() would give them (0666 less the umask), so a shared results dir
stays readable to the group; a failed write names the file it was for."""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Iterator


def read_umask() -> int:
    mask = os.umask(0)  # the only portable way to read it: set and restore at once
    os.umask(mask)
    return mask


FILE_MODE = 0o666 & ~read_umask()


@contextmanager
def atomic_writer(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """A file opened at a temp name beside `path` (readable too, so a writer can look back at what it
    wrote) that replaces `path` only when the block completes; an exception leaves `path` as it was."""
    path = Path(path)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.fchmod(fd, FILE_MODE)  # mkstemp makes 0600 files whatever the umask
        with os.fdopen(fd, "w+b") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        if e.filename is None or e.filename == tmp:  # a write error knows no file name: give the real one
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise
    except BaseException:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_writer(path) as f:
        f.write(data)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))
