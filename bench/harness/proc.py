"""The process's own counters from /proc: resident memory, I/O bytes, CPU seconds, and the
scratch disk's busy time; ``settle`` and ``reset_rss_high_water`` to start a measured phase.

Example:
    settle()
    reset_rss_high_water()
    before = proc_io()
    ...  # the phase
    peak = status_kib("VmHWM") * 1024
    read = proc_io()["read_bytes"] - before["read_bytes"]
"""

from __future__ import annotations

import ctypes
import gc
import os


def status_kib(field: str) -> int | None:
    """A field of ``/proc/self/status`` in KiB (``VmRSS``, ``VmHWM``, ``RssAnon``); None where
    there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def reset_rss_high_water() -> bool:
    """Restart VmHWM from the current RSS (Linux: write 5 to clear_refs); False if refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def settle() -> None:
    """Collect garbage and hand freed heap memory back to the system (glibc's malloc_trim)."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def proc_io() -> dict[str, int]:
    """``/proc/self/io``: bytes the process read and wrote (``read_bytes``: from the disk)."""
    values = {}
    with open("/proc/self/io") as f:
        for line in f:
            key, value = line.split(":")
            values[key] = int(value)
    return values


def cpu_seconds(path: str = "/proc/self/stat") -> float:
    """User + system CPU seconds of a /proc stat file (a process's or one thread's)."""
    with open(path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def disk_busy_ms(device: tuple[int, int] | None) -> int:
    """Milliseconds the block device ``(major, minor)`` had requests in flight since boot
    (``/proc/diskstats``' io_ticks; the whole device: every rank's I/O, not one process's)."""
    if device is None:
        return 0
    with open("/proc/diskstats") as f:
        for line in f:
            fields = line.split()
            if (int(fields[0]), int(fields[1])) == device:
                return int(fields[12])
    return 0


def device_of(folder: str) -> tuple[int, int] | None:
    """The block device whose /proc/diskstats line counts ``folder``'s I/O (the whole disk of a
    partition); None where there is none (an overlay, tmpfs)."""
    os.makedirs(folder, exist_ok=True)
    dev = os.stat(folder).st_dev
    device = (os.major(dev), os.minor(dev))
    sys_path = f"/sys/dev/block/{device[0]}:{device[1]}"
    if not os.path.exists(sys_path):
        return None
    if os.path.exists(os.path.join(sys_path, "partition")):  # the disk it is a part of
        with open(os.path.join(os.path.realpath(sys_path), "..", "dev")) as f:
            major, minor = f.read().split(":")
        device = (int(major), int(minor))
    return device
