"""Process-level CPU settings that make a measurable difference to training and decoding speed."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
_configured = False


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory for reuse instead of returning it to the OS.

    By default every allocation above 32 MB (logits, FFN activations and their gradients) is a
    fresh mmap whose pages the kernel must fault in and zero on first touch, and is unmapped
    again when freed — every step. Serving all allocations from the heap and never trimming it
    makes a 4k-token CPU training step ~15% faster here. No-op where glibc is not the allocator.
    """
    global _configured
    if _configured or not sys.platform.startswith("linux"):
        return _configured
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(_M_MMAP_MAX, 0) == 1 and mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1
    _configured = ok
    return ok
