"""Byte buffers whose every byte is written before it is read: allocated without zero-filling them.

``bytearray(n)`` writes n zeros, so every page of a fresh allocation is faulted in and filled twice (the zeros, then
the bytes received into it): 1.2 ms for a 2.2 MB update's buffer here, more than the socket's own copy. Resized from
empty instead (CPython's ``PyByteArray_Resize``), a buffer takes pages only as they are written: what it holds in
memory is what was written to it, and a buffer of a message still arriving costs no more than the bytes that came.
The caller must write every byte before any is read (stale bytes of this process's heap would otherwise show).
"""
from __future__ import annotations

import ctypes

_resize = ctypes.pythonapi.PyByteArray_Resize
_resize.argtypes = (ctypes.py_object, ctypes.c_ssize_t)
_resize.restype = ctypes.c_int


def unfilled(size: int) -> bytearray:
    """A bytearray of ``size`` bytes, their values undefined until written; raises MemoryError."""
    buffer = bytearray()
    if size and _resize(buffer, size) != 0:  # CPython sets MemoryError itself; ctypes raises it
        raise MemoryError(f"no memory for a buffer of {size} bytes")
    return buffer
