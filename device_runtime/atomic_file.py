"""The one way this project writes a file that must survive a crash whole: a temporary file beside it,
flushed and fsynced, renamed over it, and the directory fsynced, so a kill or power loss leaves the old
version or the new one, never a mix."""
from __future__ import annotations

import os
from pathlib import Path

TMP_PREFIX = ".tmp-"


def write_atomic(path: str | os.PathLike, data: bytes, mode: int = 0o666) -> None:
    """``mode`` (before the umask) is the new file's: 0o600 for keys and authentication state."""
    path = Path(path)
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}")
    tmp.unlink(missing_ok=True)  # a leftover would keep its own mode
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode), "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_directory(path.parent)


def fsync_directory(path: str | os.PathLike) -> None:
    """Make a rename or a new file in ``path`` durable (where the file system opens directories at all)."""
    try:
        directory = os.open(path, os.O_RDONLY)
    except OSError:  # some file systems do not open directories; the rename is still atomic
        return
    try:
        os.fsync(directory)
    except OSError:
        pass
    finally:
        os.close(directory)
