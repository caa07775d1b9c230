"""`--workers W`: the policy as W FSDP2 ranks in a Ray worker group (veRL's ``RayWorkerGroup``), the same calls as
the in-process ``PolicyEngine``.

Each rank is a veRL ``TrainingWorker`` (a Ray actor) with the few methods our loop adds: freezing a tied embedding
and writing the weights as vLLM loads them (every rank gathers, rank 0 writes). veRL's dispatch splits a batch
across the data-parallel ranks and gathers the outputs; a batch whose row count W does not divide gets rows with an
empty loss mask, which add nothing to the loss (token-mean aggregation) and are cut from the outputs.

On a CPU the ranks talk over gloo (``trainer.cpu_platform``, loaded in every Ray worker through
``VERL_USE_EXTERNAL_MODULES``); on GPUs over NCCL, one GPU per rank. ``ray.init`` joins a cluster when
``RAY_ADDRESS`` names one, else starts a small local Ray (W CPUs, an object store of at most 1 GB) that ``close``
shuts down.
"""

import os
from functools import partial
from pathlib import Path
from typing import Any

import torch

from trainer import cpu_platform, packing
from trainer.engine import (
    EngineSettings,
    freeze_tied_embedding,
    init_distributed,
    save_weights,
    to_engine_input,
    worker_config,
)

cpu_platform.enable()

OBJECT_STORE_BYTES = 1 << 30
_WORKER_ENV = ("VERL_USE_EXTERNAL_MODULES", "VERL_PLATFORM", "VERL_ENGINE_DEVICE", "VERL_LOGGING_LEVEL",
               "TOKENIZERS_PARALLELISM", "HF_HUB_OFFLINE")  # fmt: skip


def _forge_worker_class() -> type:
    from verl.single_controller.base.decorator import Dispatch, register
    from verl.workers.engine_workers import TrainingWorker

    one_to_all = Dispatch.ONE_TO_ALL  # type: ignore[attr-defined]  # veRL adds its members at import

    class ForgeTrainingWorker(TrainingWorker):
        """veRL's TrainingWorker plus what publishing needs on every rank."""

        def __init__(self, config: Any) -> None:
            if not cpu_platform.on_gpu():  # veRL would ask for "cpu:gloo,cpu:gloo": one gloo group, from Ray's env
                init_distributed()
            super().__init__(config)

        @register(dispatch_mode=one_to_all)
        def freeze_tied_embedding(self, settings: EngineSettings) -> bool:
            return freeze_tied_embedding(self, settings)

        @register(dispatch_mode=one_to_all)
        def install_packing(self) -> None:
            packing.install(self.engine)

        @register(dispatch_mode=one_to_all)
        def take_packing_stats(self) -> dict[str, Any]:
            return packing.take_stats(self.engine).as_metrics()

        @register(dispatch_mode=one_to_all)
        def save_weights(self, folder: str, lora: bool, base_model: str) -> None:
            save_weights(self, Path(folder), lora, Path(base_model))

    return ForgeTrainingWorker


def summed(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """The ranks' packing metrics added up (counts; ``packing/reasons`` merged)."""
    out: dict[str, Any] = {}
    for metrics in per_rank:
        for key, value in metrics.items():
            if isinstance(value, dict):
                merged = out.setdefault(key, {})
                for reason, n in value.items():
                    merged[reason] = merged.get(reason, 0) + n
            else:
                out[key] = out.get(key, 0) + value
    return out


class RayPolicyEngine:
    """``PolicyEngine``'s interface over W ranks in a Ray worker group."""

    def __init__(self, settings: EngineSettings, workers: int, per_node: int = 0) -> None:
        import ray
        from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
        from verl.workers.utils.losses import ppo_loss

        self.settings, self.workers = settings, workers
        self.started_ray = not ray.is_initialized()
        if self.started_ray:
            env = {name: os.environ[name] for name in _WORKER_ENV if name in os.environ}
            if os.environ.get("RAY_ADDRESS"):
                ray.init(runtime_env={"env_vars": env}, log_to_driver=False)
            else:
                ray.init(num_cpus=max(2, workers), object_store_memory=OBJECT_STORE_BYTES, include_dashboard=False,
                         runtime_env={"env_vars": env}, log_to_driver=False, _node_ip_address="127.0.0.1")  # fmt: skip
        gpu = cpu_platform.on_gpu()
        worker_cfg, self.actor_config = worker_config(settings)
        # max_colocate_count=1: one rank per placement bundle (veRL's default of 10 hangs on a CPU).
        per_node = per_node or workers  # ranks per node (GPUs per node on a cluster); 0: all on one node
        pool = RayResourcePool(process_on_nodes=[per_node] * (workers // per_node), use_gpu=gpu, max_colocate_count=1)
        group: Any = RayWorkerGroup(
            resource_pool=pool, ray_cls_with_init=RayClassWithInitArgs(ray.remote(_forge_worker_class()),
                                                                       config=worker_cfg),
            device_name="cuda" if gpu else "cpu",
        )  # fmt: skip
        self.group = group  # its methods are bound from the worker class at run time
        self.group.reset()
        self.group.set_loss_fn(partial(ppo_loss, config=self.actor_config))
        self.group.install_packing()
        self.frozen_tied_embedding = bool(self.group.freeze_tied_embedding(settings)[0])

    def _padded(self, tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], int]:
        """Rows up to a multiple of W: copies of the first row with an empty loss mask."""
        n = tensors["responses"].shape[0]
        extra = -n % self.workers
        if not extra:
            return tensors, n
        out = {}
        for key, value in tensors.items():
            filler = value[:1].repeat(extra, *([1] * (value.dim() - 1)))
            if key in ("response_mask", "advantages", "rollout_is_weights"):
                filler = torch.zeros_like(filler)
            out[key] = torch.cat([value, filler])
        return out, n

    def log_probs(self, tensors: dict[str, torch.Tensor], reference: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.padding import no_padding_2_padding

        tensors, n = self._padded(tensors)
        meta = {"no_lora_adapter": True} if reference and self.settings.lora_rank else {}
        data = to_engine_input(
            tensors, self.settings.max_token_len, compute_loss=False, calculate_entropy=not reference,
            prefix_packing=self.settings.prefix_packing, **meta,
        )  # fmt: skip
        output = self.group.infer_batch(data).get()
        log_probs = no_padding_2_padding(tu.get(output, "log_probs"), data).float()
        entropy = tu.get(output, "entropy")
        entropy = no_padding_2_padding(entropy, data).float() if entropy is not None else torch.zeros_like(log_probs)
        return log_probs[:n], entropy[:n]

    def update(self, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
        from verl.utils import tensordict_utils as tu

        tensors, _ = self._padded(tensors)
        n = tensors["responses"].shape[0]
        data = to_engine_input(
            tensors, self.settings.max_token_len, compute_loss=True, calculate_entropy=True, global_batch_size=n,
            mini_batch_size=n, epochs=self.settings.epochs, seed=self.settings.seed,
            dataloader_kwargs={"shuffle": False}, prefix_packing=self.settings.prefix_packing,
        )  # fmt: skip
        self.group.take_packing_stats()
        output = self.group.train_mini_batch(data).get()
        return {**tu.get(output, "metrics"), **summed(self.group.take_packing_stats())}

    def save_weights(self, folder: Path) -> None:
        self.group.save_weights(str(folder), bool(self.settings.lora_rank), str(self.settings.model_dir))

    def save(self, directory: Path, step: int) -> None:
        self.group.save_checkpoint(str(directory), global_step=step)

    def load(self, directory: Path) -> None:
        self.group.load_checkpoint(str(directory), del_local_after_load=False)

    def close(self) -> None:
        import ray

        for worker in getattr(self.group, "_workers", []):
            ray.kill(worker)
        if self.started_ray:
            ray.shutdown()
