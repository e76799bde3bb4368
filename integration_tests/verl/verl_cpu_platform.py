"""A test-only verl platform for this GPU-less machine, registered as ``cpu_test`` (verl 0.9.1 registers only
nvidia, huawei and amd, and falls back to CUDA): device ``cpu``, gloo, no-op memory statistics. Not ours: a
stand-in for the GPU. Loaded in-process by the conftest, and in Ray's worker processes through verl's own
plugin hooks (``VERL_USE_EXTERNAL_MODULES=verl_cpu_platform``, ``VERL_PLATFORM=cpu_test``)."""

from __future__ import annotations

from verl.plugin.platform.platform_cuda import PlatformCUDA
from verl.plugin.platform.platform_manager import PlatformRegistry

NAME = "cpu_test"


class _CpuMemory:
    """``torch.cuda``'s memory/sync calls verl's workers make, answered for the CPU (no accelerator here)."""

    @staticmethod
    def max_memory_allocated(*args):
        return 0

    max_memory_reserved = memory_allocated = memory_reserved = max_memory_allocated

    @staticmethod
    def mem_get_info(*args):
        return 0, 0

    @staticmethod
    def is_available():
        return False

    @staticmethod
    def get_device_name(*args):
        return "cpu"  # unknown to verl's FLOPS table: mfu is 0

    @staticmethod
    def empty_cache():
        pass

    @staticmethod
    def synchronize(*args):
        pass


@PlatformRegistry.register(platform=NAME)
class CpuPlatform(PlatformCUDA):
    """Ray placement still asks for one ``GPU`` per worker bundle (verl's ``ResourcePoolManager`` always does):
    the test starts Ray with ``num_gpus`` declared (``ray_kwargs.ray_init.num_gpus``), a logical resource."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def device_module(self):
        return _CpuMemory

    def is_available(self) -> bool:
        return True

    def synchronize(self, device_index=None) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def communication_backend_name(self) -> str:
        return "gloo"


def _gloo_process_group():
    """verl's ``initialize_global_process_group_ray`` asks for ``cpu:gloo,<device>:<backend>``, which torch
    refuses when the device is the CPU too (``Duplicate device type cpu``): the stand-in asks for plain gloo.
    Patched at ``import verl`` time (this module is loaded by verl's own ``VERL_USE_EXTERNAL_MODULES`` hook),
    before verl's engine workers import the function by name."""
    from verl.utils import distributed

    original = distributed.initialize_global_process_group_ray

    def initialize_global_process_group_ray(timeout_second=None, backend=None):
        return original(timeout_second=timeout_second, backend=backend or "gloo")

    distributed.initialize_global_process_group_ray = initialize_global_process_group_ray


_gloo_process_group()
