"""Terminal output: rich consoles that print text as it is, and the one-line form of errors.

Paths and config values are user text: `runs/[draft]` or `[/x]` must print as typed, so no relpos
console parses rich markup; style comes from `style=` and `Text`, never from brackets in a string."""

from __future__ import annotations

import errno
import os
from contextlib import contextmanager
from typing import Iterator

from rich.console import Console
from rich.text import Text

from relpos_cli.errors import RelposError
from relpos_cli.interrupt import leave


def plain_console(stderr: bool = False, **kwargs) -> Console:
    return Console(stderr=stderr, markup=False, highlight=False, **kwargs)


err_console = plain_console(stderr=True)


def print_error(message: str) -> None:
    err_console.print(Text.assemble(("error:", "bold red"), " ", message), soft_wrap=True)


def print_note(message: str) -> None:
    """One line on stderr about something relpos did on its own (a fallback, a skipped step)."""
    err_console.print(Text.assemble(("note:", "yellow"), " ", message), soft_wrap=True)


# errno -> what to do about it; the path comes first in the line
_OS_ERROR_HINTS = {
    errno.ENOSPC: "no space left on the device: free some space, or put the run (hydra.run.dir) or the token "
                  "cache (RELPOS_CACHE) on another disk",
    errno.EDQUOT: "disk quota exceeded: free some space, or use another disk",
    errno.EACCES: "permission denied: check its permissions, or work in (or on a copy in) a directory you can write",
    errno.EPERM: "operation not permitted: check its permissions, or work in a directory you own",
    errno.EROFS: "read-only file system: work in (or on a copy in) a writable directory",
    errno.ENOTDIR: "a part of this path is a file, not a directory: pick another path",
    errno.EISDIR: "is a directory, where a file was expected: pick another path",
    errno.EEXIST: "exists and is not a directory: pick another path (or move the file away)",
    errno.ENOENT: "no such file or directory",
    errno.ENAMETOOLONG: "file name too long: pick a shorter path",
    errno.EMFILE: "too many open files: raise the limit (ulimit -n)",
    errno.EIO: "input/output error: the disk or network file system failed; check it and retry",
}


def describe_os_error(e: OSError) -> str:
    """OSError (ENOSPC, EACCES, ENOTDIR, EISDIR, ...) -> '<path>: <what happened and what to do>'."""
    hint = _OS_ERROR_HINTS.get(e.errno, e.strerror or type(e).__name__)
    where = e.filename if e.filename is not None else None
    if e.filename2 is not None:
        where = f"{e.filename} -> {e.filename2}"
    return f"{os.fspath(where)}: {hint}" if where is not None else hint


def describe_decode_error(e: UnicodeDecodeError) -> str:
    return (f"cannot read text as UTF-8 ({e.reason} at byte {e.start}); relpos reads UTF-8 text: "
            f"convert the file (e.g. iconv -f latin1 -t utf-8) or leave it out")


def as_relpos_error(e: BaseException) -> BaseException:
    """Faults of the environment (a full disk, a read-only dir, a file that is not UTF-8) as the one
    line that names the path and what to do; other exceptions as they are."""
    if isinstance(e, OSError):
        return RelposError(describe_os_error(e))
    if isinstance(e, UnicodeDecodeError):
        return RelposError(describe_decode_error(e))
    return e


@contextmanager
def clear_errors() -> Iterator[None]:
    """RelposError, OSError, UnicodeDecodeError -> one line on stderr and exit 2, no traceback;
    Ctrl-C -> exit 130."""
    try:
        yield
    except RelposError as e:
        print_error(str(e))
        leave(e.exit_code)
    except (OSError, UnicodeDecodeError) as e:
        print_error(str(as_relpos_error(e)))
        leave(2)
    except KeyboardInterrupt:
        print_error("interrupted")
        leave(130)
