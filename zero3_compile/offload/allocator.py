"""Host memory that offloading actually gives back: glibc's malloc with a fixed mmap threshold.

glibc serves an allocation below its mmap threshold from a heap, and raises that threshold (up to
32 MiB) each time a larger mmapped block is freed. Offloaded training then allocates tensors of
16-32 MiB that live for one tile of the optimizer step (the first step's new optimizer state, a
gradient read back) between small tensors that live much longer. Each small one is carved out of
the hole a freed large one left, so the next large one no longer fits there and the heap grows
instead: measured at 3B (llama, 2 ranks), each rank's resident memory rose by 5.4 GB during the
first optimizer step and fell back when the step ended, well above what it keeps on disk.

A fixed threshold (``mallopt(M_MMAP_THRESHOLD)``, which also stops glibc from moving it) serves
every allocation of at least ``MMAP_THRESHOLD`` bytes with its own mapping, returned to the
system when freed, so freed large tensors never leave holes. Set once per process, when the first
disk store is created (host memory is then what the user is saving); ``ZERO3_MMAP_THRESHOLD``
(bytes; ``0`` leaves the allocator alone) overrides it. A threshold the user gave glibc
(``MALLOC_MMAP_THRESHOLD_``, or ``glibc.malloc.mmap_threshold`` in ``GLIBC_TUNABLES``) and
another allocator (jemalloc or tcmalloc preloaded) are left alone too.

Blocks of 1 MiB and more then go to torch through a cache of freed blocks (host_cache.py), so
the large tensors that come and go every step reuse memory instead of mapping it afresh;
``ZERO3_HOST_CACHE_MB`` caps what it keeps (``0``: not used).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading

from . import host_cache

log = logging.getLogger(__name__)

MMAP_THRESHOLD = 8 * 2**20
_M_MMAP_THRESHOLD = -3  # glibc's malloc.h
_ENV = "ZERO3_MMAP_THRESHOLD"

_lock = threading.Lock()
_settled: int | None = None  # the threshold set (0: left alone), once decided


def settle_host_allocator() -> int:
    """Fix glibc's mmap threshold (see the module docstring); returns the threshold set in bytes,
    or 0 where the allocator was left alone. Idempotent."""
    global _settled
    with _lock:
        if _settled is None:  # a bad ZERO3_MMAP_THRESHOLD or cap raises here, at every store
            cap = host_cache.cap_from_env()
            threshold = _settle()
            if cap and _glibc() is not None:  # under jemalloc or tcmalloc, theirs is the policy
                host_cache.install(cap)
            _settled = threshold
        return _settled


def _settle() -> int:
    raw = os.environ.get(_ENV, "").strip()
    try:
        threshold = int(raw) if raw else MMAP_THRESHOLD
    except ValueError:
        raise ValueError(
            f"zero3: {_ENV}={raw!r} must be a number of bytes (0 leaves the allocator alone)"
        ) from None
    libc = None if threshold <= 0 or _user_threshold() else _glibc()
    if libc is None:
        return 0
    if libc.mallopt(_M_MMAP_THRESHOLD, threshold) != 1:
        log.info("zero3: mallopt(M_MMAP_THRESHOLD, %d) refused; allocator unchanged", threshold)
        return 0
    log.info(
        "zero3: glibc mmap threshold fixed at %d bytes (host memory of freed large tensors "
        "goes back to the system; %s=0 leaves it alone)",
        threshold,
        _ENV,
    )
    return threshold


def _user_threshold() -> bool:
    """Whether the user set glibc's threshold at start (their choice stands)."""
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    return "MALLOC_MMAP_THRESHOLD_" in os.environ or "glibc.malloc.mmap_threshold" in tunables


def _glibc():
    """This process's C library if it is glibc's malloc (not a preloaded other allocator)."""
    try:
        libc = ctypes.CDLL(None)
        if not hasattr(libc, "gnu_get_libc_version"):  # not glibc (musl, macOS)
            return None
        malloc = ctypes.cast(libc.malloc, ctypes.c_void_p).value
        own = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        if malloc != ctypes.cast(own.malloc, ctypes.c_void_p).value:
            return None  # jemalloc, tcmalloc... interposed: their own policy
        return own
    except (AttributeError, OSError):
        return None


__all__ = ["MMAP_THRESHOLD", "settle_host_allocator"]
