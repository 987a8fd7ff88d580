"""Large CPU buffers backed by transparent huge pages, so that their first touch is not a page fault per 4 KiB.

>>> buf = advise(torch.empty(200_000_000))      # doctest: +SKIP (Linux; a no-op elsewhere)

Writing a fresh 754 MB tensor the first time costs 1.0-2.2 s on this project's 2-core VM (one page fault per
4 KiB page) and 0.10 s once its range is marked ``MADV_HUGEPAGE`` (2 MiB pages), against 0.04 s for every
later write (docs/benchmarks.md). The circuit runs allocate such buffers per call (sender outputs
[S, b, p, d], summed gradients [R, b, p, d]), so ``record.reuse`` advises each new one. Advice only: where
the kernel has no transparent huge pages (``never``), the platform is not Linux, the tensor is small or not
on the CPU, nothing happens; the memory and its contents are the same either way.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from functools import lru_cache
from typing import Optional

from torch import Tensor

MADV_HUGEPAGE = 14
HUGE = 2 << 20
MIN_BYTES = 32 << 20          # below this, page faults are not worth a system call


@lru_cache(maxsize=None)
def _madvise():
    """libc's madvise, or None (not Linux, transparent huge pages off, no libc)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            if "[never]" in f.read():
                return None
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.madvise
        fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
        return fn
    except (OSError, AttributeError):
        return None


def advise(t: Tensor) -> Tensor:
    """``t`` itself, its memory (the 2 MiB-aligned part of it) advised ``MADV_HUGEPAGE`` when that can help:
    call it before the first write."""
    n = t.numel() * t.element_size()
    fn: Optional[object] = _madvise() if t.device.type == "cpu" and n >= MIN_BYTES else None
    if fn is not None:
        lo = (t.data_ptr() + HUGE - 1) & ~(HUGE - 1)
        hi = (t.data_ptr() + n) & ~(HUGE - 1)
        if hi > lo:
            fn(lo, hi - lo, MADV_HUGEPAGE)          # advice: a refusal (EINVAL, ENOMEM) changes nothing
    return t
