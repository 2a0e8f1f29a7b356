"""A run measured phase by phase (loading, the first step, the steady steps, a checkpoint):
seconds, peak resident memory, bytes moved, exposed I/O, CPU time, the scratch disk's busy time.

Example:
    phases = Phases(scratch)
    with phases.phase("load"):
        model = ...
    phases.model, phases.opt = model, opt        # their offload stores are counted from now
    with phases.phase("steps"):
        for i in range(steps):
            with phases.part("steps: forward"):
                ...
    phases.records["steps"]["peak_rss"]
"""

from __future__ import annotations

import contextlib
import os
import time

from . import proc
from .disk import IoTrace, offload_stores


class Phases:
    """Per phase: seconds, peak RSS (VmHWM reset at its start), bytes moved, exposed I/O, the
    scratch disk's busy time."""

    def __init__(self, scratch: str | None = None):
        self.records: dict[str, dict] = {}
        self.model = None
        self.opt = None
        self.device = proc.device_of(scratch) if scratch else None
        self.trace: IoTrace | None = None  # on during the steady steps (``--io-trace``)

    def _counters(self) -> dict:
        stores = offload_stores(self.model, self.opt) if self.model is not None else []
        io = proc.proc_io()
        return {
            "store_read": sum(s.bytes_read for s in stores),
            "store_written": sum(s.bytes_written for s in stores),
            "io_s": sum(s.io_seconds for s in stores),
            "wait_s": sum(s.wait_seconds for s in stores),
            "disk_read": io.get("read_bytes", 0),
            "disk_written": io.get("write_bytes", 0),
            # CPU of the training thread and of all the process's threads (I/O threads, the
            # in-backward stepping thread, the kernel's page-cache copies on their behalf)
            "cpu_main_s": proc.cpu_seconds(f"/proc/self/task/{os.getpid()}/stat"),
            "cpu_s": proc.cpu_seconds("/proc/self/stat"),
            "disk_busy_s": proc.disk_busy_ms(self.device) / 1e3,
        }

    @contextlib.contextmanager
    def phase(self, name: str, settle: bool = True):
        """``settle``: collect garbage and return freed memory to the system first (not
        inside a step, where a training loop would not)."""
        if settle:
            proc.settle()
        proc.reset_rss_high_water()
        start_rss = (proc.status_kib("VmRSS") or 0) * 1024
        print(f"[phase] {name}: starts at {start_rss / 1e9:.2f} GB resident", flush=True)
        before = self._counters()
        traced = self.trace is not None and name == "steps"
        if traced:
            self.trace.on = True
        start = time.perf_counter()
        yield
        seconds = time.perf_counter() - start
        if traced:
            self.trace.on = False
        after = self._counters()
        self.records[name] = {
            "seconds": seconds,
            "peak_rss": (proc.status_kib("VmHWM") or 0) * 1024,
            "start_rss": start_rss,
            **{k: after[k] - before[k] for k in after},
        }

    @contextlib.contextmanager
    def part(self, name: str):
        """A part of a measured phase, summed over its repetitions (the steady steps' forward,
        backward and optimizer): seconds and bytes, not memory (the enclosing phase's peak
        stays whole)."""
        before = self._counters()
        start = time.perf_counter()
        yield
        seconds = time.perf_counter() - start
        after = self._counters()
        record = self.records.setdefault(name, {"seconds": 0.0, **dict.fromkeys(after, 0)})
        if self.trace is not None and name == "steps: forward":
            self.trace.marks.append(start)
        record["seconds"] += seconds
        for key in after:
            record[key] += after[key] - before[key]
