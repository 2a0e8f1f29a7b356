"""Memory figures: bytes of the tensors a rank holds, allocator peaks, the RSS high-water mark.

On CUDA the caching allocator counts everything (``torch.cuda.max_memory_allocated``). The CPU
allocator keeps no totals, so a CPU step's allocator peak is rebuilt from two parts:

* the bytes live when the step starts: every tensor storage reachable from Python (a ``gc``
  scan, storages counted once), plus buffers a contender holds in C++ only (DDP's gradient
  buckets), which the scan cannot see;
* the step's transient peak: ``torch.profiler`` (``profile_memory=True``) records every
  allocation and free during the step; replaying them in time order gives the highest point
  above the starting level.
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor

from .proc import status_kib


def _storage_key_and_bytes(tensor: torch.Tensor) -> tuple[int, int] | None:
    """(data pointer, bytes) of the storage behind ``tensor``; None if it has no real storage."""
    try:
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None  # wrapper subclasses (DTensor) and fake tensors have no storage of their own
    if pointer == 0 or tensor.device.type == "meta":
        return None
    return pointer, storage.nbytes()


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (DTensors count their local shard)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        if tensor is None:
            continue
        if isinstance(tensor, DTensor):
            tensor = tensor.to_local()
        key = _storage_key_and_bytes(tensor)
        if key is not None:
            seen[key[0]] = key[1]
    return sum(seen.values())


def live_tensor_bytes(device_type: str) -> int:
    """Bytes of every distinct tensor storage on ``device_type`` reachable from Python."""
    from torch._subclasses.fake_tensor import FakeTensor

    gc.collect()
    seen: dict[int, int] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated module attributes warn on isinstance
        for obj in gc.get_objects():
            try:
                if not isinstance(obj, torch.Tensor) or isinstance(obj, FakeTensor):
                    continue  # fake tensors (compile-time stand-ins) own no memory
                if obj.device.type != device_type:
                    continue
            except Exception:  # objects whose __class__ or device lookups raise
                continue
            key = _storage_key_and_bytes(obj)
            if key is not None:
                seen[key[0]] = key[1]
    return sum(seen.values())


def transient_peak_bytes(prof: torch.profiler.profile, device_type: str) -> int:
    """Highest level above the starting one that the profiled allocations reached."""
    from torch._C._profiler import _EventType

    deltas: list[tuple[int, int]] = []
    pending = list(prof.profiler.kineto_results.experimental_event_tree())
    while pending:
        event = pending.pop()
        pending.extend(event.children)
        if event.typed[0] == _EventType.Allocation:
            fields = event.typed[1]
            if fields.device.type == device_type:
                deltas.append((event.start_time_ns, fields.alloc_size))
    level = peak = 0
    for _, delta in sorted(deltas):
        level += delta
        peak = max(peak, level)
    return peak


def rss_high_water_bytes() -> int | None:
    """The process's peak resident set size (VmHWM; ru_maxrss where /proc is missing)."""
    kib = status_kib("VmHWM")
    if kib is None:
        import resource

        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return kib * 1024


class StepMemoryProbe:
    """Allocator-level peak of one step: ``start()`` before it, ``finish(prof)`` after it."""

    def __init__(self, device: torch.device, held_in_cpp_bytes: int = 0):
        self.device = device
        self.held_in_cpp_bytes = held_in_cpp_bytes
        self.base = 0

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self.base = live_tensor_bytes(self.device.type) + self.held_in_cpp_bytes

    def finish(self, prof: torch.profiler.profile) -> dict[str, int]:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
            return {"start": self.base, "peak": peak, "transient": peak - self.base}
        transient = transient_peak_bytes(prof, self.device.type)
        return {"start": self.base, "peak": self.base + transient, "transient": transient}
