"""Large host tensors that reuse their memory: a caching CPU allocator for torch (host_cache.cpp).

torch allocates CPU tensors with glibc's malloc, which maps every block of at least its mmap
threshold afresh and unmaps it when freed (offloading fixes that threshold, see allocator.py).
Offloaded training allocates such blocks all the time: a gathered layer, its casts, gloo's own
staging of each collective, the gradients, the optimizer's tiles. A fresh block costs the kernel
a page fault and a zeroed 4 KiB page on first touch, and an unmapping when freed: measured on a
3B-parameter step on 2 cores (2 ranks, `perf record -a`), a third of the machine's CPU time went
to those faults.

The cache keeps freed blocks of at least ``min_bytes`` (one mapping each, 32 size classes per
power of two: at most 3.1% rounded up) and hands them to the next request of their class. It keeps
at most ``cap_bytes`` of freed blocks, the least recently freed given back first, and never more
than the most bytes its blocks ever held in use less those in use now (a request it cannot serve
from its class maps a new block and gives kept blocks back before returning it, so before any
of its pages is touched): the blocks in use and kept
together never exceed the high-water mark of the blocks in use, so the cache does not raise the
process's peak memory. Smaller requests go to the allocator it replaced.

It is C++ (torch's ``c10::Allocator``), compiled with the system's C++ compiler on first use into
``ZERO3_HOST_CACHE_DIR`` (default ``~/.cache/zero3_compile``), keyed by its source and torch's
version. Installed once per process, when offloading creates its first disk store (with glibc's
threshold, see ``settle_host_allocator``); ``ZERO3_HOST_CACHE_MB`` sets the cap (``0`` leaves
torch's allocator alone). Without a compiler it logs why and leaves torch's allocator as it was.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading

import torch

log = logging.getLogger(__name__)

CAP_MB = 1024  # default cap on the freed blocks kept, per process
MIN_BYTES = 1 << 20  # smaller blocks stay with the allocator the cache replaced
_ENV_CAP = "ZERO3_HOST_CACHE_MB"
_ENV_DIR = "ZERO3_HOST_CACHE_DIR"
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "host_cache.cpp")

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_installed = False


def install(cap_bytes: int | None = None, min_bytes: int = MIN_BYTES) -> bool:
    """Make torch allocate CPU tensors through the cache (idempotent; a second call sets the cap
    and threshold again). ``cap_bytes`` defaults to ``ZERO3_HOST_CACHE_MB`` or 1 GiB; 0 leaves
    torch's allocator alone. Returns whether torch now allocates through the cache."""
    global _installed
    if cap_bytes is None:
        cap_bytes = cap_from_env()
    if cap_bytes <= 0:
        return False
    with _lock:
        lib = _load()
        if lib is None:
            return False
        _installed = bool(lib.zero3_host_cache_install(cap_bytes, min_bytes))
        if not _installed:
            log.info("zero3: torch's CPU allocator was set by someone else; host cache not used")
        return _installed


def uninstall() -> None:
    """Give torch its previous allocator back and the kept blocks to the system (blocks in use
    stay valid and return to the system when freed)."""
    global _installed
    with _lock:
        if _lib is not None:
            _lib.zero3_host_cache_uninstall()
        _installed = False


def trim() -> None:
    """Give every kept block back to the system."""
    if _lib is not None:
        _lib.zero3_host_cache_trim()


def installed() -> bool:
    return _installed


def stats() -> dict[str, int]:
    """hits / misses (requests served by a kept block / by a new mapping), released (blocks given
    back), kept_bytes, live_bytes and peak_live_bytes (the cache's blocks in use, now and at most);
    all zeros before the cache was loaded."""
    values = (ctypes.c_uint64 * 6)()
    if _lib is not None:
        _lib.zero3_host_cache_stats(values)
    names = ("hits", "misses", "released", "kept_bytes", "live_bytes", "peak_live_bytes")
    return dict(zip(names, (int(v) for v in values), strict=True))


def cap_from_env() -> int:
    """``ZERO3_HOST_CACHE_MB`` in bytes (1 GiB if unset; 0: leave torch's allocator alone)."""
    raw = os.environ.get(_ENV_CAP, "").strip()
    try:
        return int(float(raw) * 2**20) if raw else CAP_MB * 2**20
    except ValueError:
        raise ValueError(
            f"zero3: {_ENV_CAP}={raw!r} must be a number of MiB (0 leaves torch's CPU allocator "
            "alone)"
        ) from None


def _load() -> ctypes.CDLL | None:
    """The compiled cache, built once per source and torch version (holds _lock)."""
    global _lib
    if _lib is not None:
        return _lib
    try:
        path = _build()
    except (OSError, subprocess.SubprocessError, RuntimeError) as error:
        log.warning("zero3: host cache not built (%s); torch's CPU allocator left as it is", error)
        return None
    lib = ctypes.CDLL(path)
    lib.zero3_host_cache_install.argtypes = [ctypes.c_uint64, ctypes.c_uint64]
    lib.zero3_host_cache_install.restype = ctypes.c_int
    lib.zero3_host_cache_stats.argtypes = [ctypes.POINTER(ctypes.c_uint64)]
    _lib = lib
    return lib


def _build() -> str:
    with open(_SOURCE, "rb") as f:
        source = f.read()
    torch_dir = os.path.dirname(torch.__file__)
    abi = int(torch.compiled_with_cxx11_abi())
    built_for = f"{torch.__version__}|{torch_dir}|{abi}".encode()
    key = hashlib.sha256(source + built_for).hexdigest()[:16]
    folder = os.environ.get(_ENV_DIR) or os.path.join(
        os.path.expanduser("~"), ".cache", "zero3_compile"
    )
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"host_cache-{key}.so")
    if os.path.exists(path):
        return path
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++ or $CXX) found")
    with open(path + ".lock", "w") as lock:  # ranks of one machine build it once
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.exists(path):
            return path
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
        os.close(fd)
        lib_dir = os.path.join(torch_dir, "lib")
        command = [
            compiler, "-O2", "-std=c++17", "-shared", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            "-I", os.path.join(torch_dir, "include"), _SOURCE, "-o", tmp,
            f"-L{lib_dir}", "-lc10", f"-Wl,-rpath,{lib_dir}",
        ]  # fmt: skip
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=300)
            if done.returncode != 0:
                raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-2000:]}")
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return path


__all__ = ["cap_from_env", "install", "installed", "stats", "trim", "uninstall"]
