"""veRL on a CPU, without editing veRL: a CPU platform for veRL's platform registry, and the switches around it.

veRL 0.9.1 knows CUDA, NPU and ROCm. Its platform registry (``verl.plugin.platform``) takes external platforms,
loaded through ``VERL_USE_EXTERNAL_MODULES``; the FSDP engine is registered for device "cuda" only, and
``VERL_ENGINE_DEVICE=cuda`` (the engine registry's own override) picks it while every tensor stays on the CPU.
Collectives go through gloo. ``enable()`` sets all of it before veRL is imported; on a GPU it does nothing.
"""

import os
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch

PLATFORM = "openforge_cpu"


def on_gpu() -> bool:
    return torch.cuda.is_available()


def enable() -> None:
    """Make veRL run on this process's CPU (idempotent; a no-op where CUDA is available)."""
    if on_gpu():
        return
    os.environ.setdefault("VERL_USE_EXTERNAL_MODULES", "trainer.cpu_platform")
    os.environ.setdefault("VERL_PLATFORM", PLATFORM)
    os.environ.setdefault("VERL_ENGINE_DEVICE", "cuda")
    os.environ.setdefault("VERL_LOGGING_LEVEL", "WARN")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    register()


class _CPUDevice(ModuleType):
    """``torch.cpu`` plus the memory queries veRL asks a device module for (peak RSS on a CPU; nothing cached)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    @staticmethod
    def max_memory_allocated(*args: Any, **kwargs: Any) -> int:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    max_memory_reserved = max_memory_allocated

    @staticmethod
    def memory_allocated(*args: Any, **kwargs: Any) -> int:
        return 0

    memory_reserved = memory_allocated

    @staticmethod
    def mem_get_info(*args: Any, **kwargs: Any) -> tuple[int, int]:
        import psutil

        memory = psutil.virtual_memory()
        return memory.available, memory.total

    @staticmethod
    def empty_cache(*args: Any, **kwargs: Any) -> None:
        pass  # no device cache on a CPU

    @staticmethod
    def get_rng_state(*args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.get_rng_state()  # the "device" RNG is the CPU's: veRL's checkpoints restore it

    @staticmethod
    def set_rng_state(state: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        torch.set_rng_state(state)

    @staticmethod
    def get_device_name(*args: Any, **kwargs: Any) -> str:
        return "CPU"  # veRL's FLOPs table has no CPU entry: MFU reads 0

    @staticmethod
    def reset_peak_memory_stats(*args: Any, **kwargs: Any) -> None:
        pass


CPU_DEVICE = _CPUDevice("openforge_cpu_device")


def register() -> None:
    from verl.plugin.platform.platform_base import PlatformBase
    from verl.plugin.platform.platform_manager import PlatformRegistry

    if PlatformRegistry.get(PLATFORM) is not None:
        return

    @PlatformRegistry.register(platform=PLATFORM)
    class PlatformCPU(PlatformBase):
        """Tensors on the CPU, collectives over gloo, no device memory to manage."""

        @property
        def device_name(self) -> str:
            return "cpu"

        @property
        def vendor_name(self) -> str:
            return "cpu"

        @property
        def device_module(self) -> ModuleType:
            return CPU_DEVICE

        def is_available(self) -> bool:
            return True

        def current_device(self) -> Any:
            return "cpu"  # veRL moves tensors with `.to(get_device_id())`: an index would mean cuda:N

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            pass

        def synchronize(self, device_index: int | None = None) -> None:
            pass

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            pass

        def empty_cache(self) -> None:
            pass

        def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"

        @contextmanager
        def nvtx_range(self, msg: str):
            yield

        def profiler_start(self) -> None:
            pass

        def profiler_stop(self) -> None:
            pass

        def ray_resource_name(self) -> str:
            return "CPU"

        def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
            return {}

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self) -> Any:
            return None


# veRL imports this module by name (VERL_USE_EXTERNAL_MODULES) in every process it starts, Ray workers too.
register()
