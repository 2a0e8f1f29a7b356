"""A CPU platform for verl: ``VERL_PLATFORM=cpu``, or picked on a machine with no accelerator.

verl 0.9 reaches the device through a platform object (``verl.plugin.platform``) and knows CUDA,
NPU and ROCm only: on a machine without them it falls back to CUDA and fails at the first
``.to(device)``. This platform names the device ``cpu``, the collective backend ``gloo``, and
gives verl's memory reports the process's resident memory (CPU allocators keep no statistics).
It is registered when ``zero3_compile.verl`` is imported (at ``import verl``, through the
``verl.plugins`` entry point), before verl first asks which platform it runs on; auto-detection
tries it after the accelerators, so a GPU machine still gets CUDA.

verl 0.9.1 starts its process group with the backend string ``"cpu:gloo,<device>:<backend>"``,
which torch refuses when the device is the CPU (``cpu`` named twice); on this platform the two
functions that build it (``verl.utils.distributed``) start plain ``gloo`` instead.
"""

from __future__ import annotations

import contextlib
import functools
import os
import types
from datetime import timedelta

import torch
import torch.distributed as dist
from verl.plugin.platform import PlatformBase, PlatformRegistry


def _status_bytes(field: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _memory_info() -> tuple[int, int]:
    """(available, total) bytes of host memory."""
    import psutil

    memory = psutil.virtual_memory()
    return memory.available, memory.total


class _CPUDeviceModule(types.ModuleType):
    """What verl calls on ``torch.<device>`` (``get_torch_device()``), for the CPU: torch.cpu's
    functions, and the allocator functions CPU lacks answered from the process's memory."""

    def __init__(self):
        super().__init__("zero3_compile.verl.cpu_device")

    def __getattr__(self, name):
        return getattr(torch.cpu, name)

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def current_device() -> str:
        return "cpu"

    @staticmethod
    def set_device(device) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def ipc_collect() -> None:
        return None

    @staticmethod
    def memory_allocated(device=None) -> int:
        return _status_bytes("VmRSS")

    @staticmethod
    def max_memory_allocated(device=None) -> int:
        return _status_bytes("VmHWM")

    memory_reserved = memory_allocated
    max_memory_reserved = max_memory_allocated

    @staticmethod
    def reset_peak_memory_stats(device=None) -> None:
        return None

    @staticmethod
    def mem_get_info(device=None) -> tuple[int, int]:
        return _memory_info()

    @staticmethod
    def get_rng_state(device=None) -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state, device=None) -> None:
        torch.set_rng_state(state)

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    manual_seed_all = manual_seed

    @staticmethod
    def get_device_name(device=None) -> str:
        return "cpu"

    @staticmethod
    def set_per_process_memory_fraction(fraction, device=None) -> None:
        return None


CPU_DEVICE = _CPUDeviceModule()


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformBase):
    """verl's platform interface for a machine without accelerators (gloo, host memory)."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> types.ModuleType:
        return CPU_DEVICE

    def is_available(self) -> bool:
        return True

    def current_device(self) -> str:  # verl passes it to .to(): the device itself
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index) -> None:
        return None

    def synchronize(self, device_index=None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0):
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def ray_resource_options(self, num_gpus: float) -> dict:
        return {}

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self):
        return None


def _on_cpu() -> bool:
    from verl.utils.device import get_device_name

    return get_device_name() == "cpu"


def _gloo_on_cpu() -> None:
    """verl's process-group starters, with the plain ``gloo`` backend on the cpu platform."""
    import verl.utils.distributed as distributed

    if getattr(distributed, "_zero3_gloo_on_cpu", False):
        return
    global_start = distributed.initialize_global_process_group
    ray_start = distributed.initialize_global_process_group_ray

    @functools.wraps(global_start)
    def initialize_global_process_group(timeout_second=36000):
        if not _on_cpu():
            return global_start(timeout_second)
        dist.init_process_group(
            backend="gloo",
            timeout=timedelta(seconds=timeout_second),
            init_method=os.environ.get("DIST_INIT_METHOD", None),
        )
        return int(os.environ["LOCAL_RANK"]), int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    @functools.wraps(ray_start)
    def initialize_global_process_group_ray(timeout_second=None, backend=None):
        if backend is None and _on_cpu():
            backend = "gloo"
        return ray_start(timeout_second=timeout_second, backend=backend)

    distributed.initialize_global_process_group = initialize_global_process_group
    distributed.initialize_global_process_group_ray = initialize_global_process_group_ray
    distributed._zero3_gloo_on_cpu = True


_gloo_on_cpu()
