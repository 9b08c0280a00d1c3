"""Incomplete messages kept in files instead of memory (stdlib only): the reassembler's spill.

A thousand devices answering within seconds have hundreds of multi-frame updates half-received at the server at once
(the broker interleaves the frames of concurrent publishers, one frame per publisher in turn). Held in memory they
need hundreds of megabytes; pushed out of a smaller budget, each is asked for again and sent twice. Past its memory
budget the ``framing.Reassembler`` writes the chunks of an authenticated message here instead, each at its offset in
one file per message, and reads the file back whole once the message is complete. What is written is bounded by the
reassembler (``max_spill_bytes``); the page cache holds it, not the process.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path


class FileSpill:
    """One file per spilled message in ``folder`` (created; files left by an earlier process removed)."""

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        for stale in self.folder.glob("*.part"):
            stale.unlink(missing_ok=True)

    def _path(self, key: tuple[str, str]) -> Path:
        name = hashlib.sha256("\0".join(key).encode()).hexdigest()[:32]
        return self.folder / f"{name}.part"

    def write(self, key: tuple[str, str], offset: int, data: memoryview | bytes) -> None:
        """Put ``data`` at ``offset`` of message ``key``'s file; raises OSError (a full disk)."""
        fd = os.open(self._path(key), os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            written = os.pwrite(fd, data, offset)
            if written != len(data):
                raise OSError(f"short write to the spill file of {key[1]!r}: {written} of {len(data)} bytes")
        finally:
            os.close(fd)

    def take(self, key: tuple[str, str], size: int) -> bytearray:
        """The ``size`` bytes of message ``key``, its file removed; raises OSError."""
        path = self._path(key)
        out = bytearray(size)
        with open(path, "rb", buffering=0) as f:
            got = f.readinto(out)
        path.unlink(missing_ok=True)
        if got != size:
            raise OSError(f"the spill file of {key[1]!r} holds {got} of {size} bytes")
        return out

    def drop(self, key: tuple[str, str]) -> None:
        """Forget message ``key`` (pushed out, expired, or refused)."""
        self._path(key).unlink(missing_ok=True)
