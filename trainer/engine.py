"""veRL's engine, driven from our loop: a ``TrainingWorker`` (FSDP2) with veRL's ``ppo_loss``.

Everything that learns is veRL's: the FSDP2 engine computes logprobs and gradients, ``ppo_loss`` the policy loss
chosen by name from ``core_algos``' registry (vanilla PPO-clip, gspo, cispo, ...), the optimizer and its state are
the engine's. This module only builds the configs, lays rows out the way veRL's own trainer does
(``left_right_2_no_padding``) and reads the weights back out for publishing.
"""

import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from trainer import cpu_platform, packing

cpu_platform.enable()


@dataclass
class EngineSettings:
    model_dir: Path
    lora_rank: int = 0
    lora_alpha: int = 16
    lr: float = 1e-5
    loss_mode: str = "vanilla"  # a name in verl.trainer.ppo.core_algos' policy-loss registry
    clip_ratio: float = 0.2
    entropy_coeff: float = 0.0
    kl_coef: float = 0.0  # > 0: KL to the initial weights (the LoRA base, or a reference copy) in the loss
    kl_type: str = "low_var_kl"  # a name veRL's core_algos.kl_penalty knows: kl/k1, abs, mse/k2, low_var_kl/k3, ...
    # Tokens per micro-batch (veRL's dynamic batch size); a row longer than this gets a micro-batch of its own.
    max_token_len: int = 16384
    # Recompute each layer's activations in the backward pass (~1.3x the compute): without it a micro-batch keeps
    # ~1.2 MB of activations per token for SmolLM2 (a 4,096-token micro-batch: ~5 GB besides its logits).
    gradient_checkpointing: bool = False
    grad_clip: float = 1.0
    freeze_tied_embedding: bool = True  # see PolicyEngine._freeze_tied_embedding
    seed: int = 1
    # Passes over a step's batch (veRL's ppo_epochs), each an optimizer step: the first on-policy, the next ones
    # off it by the previous passes' updates (the PPO clip bounds how far).
    epochs: int = 1
    # Rows sharing a token prefix computed once per micro-batch (trainer.packing); veRL's own path where the model's
    # attention takes no 4-D mask.
    prefix_packing: bool = True


def init_distributed() -> None:
    """One gloo process group (rank 0 of 1) unless a launcher (Ray, torchrun) made one already."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    rank, world = int(os.environ.setdefault("RANK", "0")), int(os.environ.setdefault("WORLD_SIZE", "1"))
    os.environ.setdefault("LOCAL_RANK", "0")
    dist.init_process_group("gloo" if not cpu_platform.on_gpu() else "cpu:gloo,cuda:nccl", rank=rank, world_size=world)


def worker_config(settings: EngineSettings) -> tuple[Any, Any]:
    """veRL's TrainingWorkerConfig and ActorConfig (the loss's config) for the policy."""
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import (
        FSDPActorConfig,
        FSDPEngineConfig,
        FSDPOptimizerConfig,
        HFModelConfig,
        PolicyLossConfig,
        TrainingWorkerConfig,
    )

    gpu = cpu_platform.on_gpu()
    model = HFModelConfig(
        path=str(settings.model_dir), use_remove_padding=False,
        enable_gradient_checkpointing=settings.gradient_checkpointing,
        lora_rank=settings.lora_rank, lora_alpha=settings.lora_alpha, target_modules="all-linear",
        override_config={"attn_implementation": "sdpa"},
    )  # fmt: skip
    precision = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
    engine = FSDPEngineConfig(
        strategy="fsdp2", model_dtype="fp32", use_torch_compile=False, use_dynamic_bsz=True,
        max_token_len_per_gpu=settings.max_token_len, infer_max_token_len_per_gpu=settings.max_token_len,
        mixed_precision=None if gpu else precision, seed=settings.seed,
        entropy_checkpointing=settings.gradient_checkpointing,
    )  # fmt: skip
    optim = FSDPOptimizerConfig(lr=settings.lr, weight_decay=0.0, clip_grad=settings.grad_clip)
    checkpoint = CheckpointConfig(
        save_contents=["model", "optimizer", "extra"], load_contents=["model", "optimizer", "extra"]
    )
    worker = TrainingWorkerConfig(
        model_type="language_model", model_config=model, engine_config=engine, optimizer_config=optim,
        checkpoint_config=checkpoint,
    )  # fmt: skip
    actor = FSDPActorConfig(
        policy_loss=PolicyLossConfig(loss_mode=settings.loss_mode), strategy="fsdp2", ppo_mini_batch_size=1,
        rollout_n=1, use_dynamic_bsz=True, fsdp_config=engine, optim=optim,
        clip_ratio=settings.clip_ratio, clip_ratio_low=settings.clip_ratio, clip_ratio_high=settings.clip_ratio,
        entropy_coeff=settings.entropy_coeff, use_kl_loss=settings.kl_coef > 0, kl_loss_coef=settings.kl_coef,
        kl_loss_type=settings.kl_type,
        ppo_max_token_len_per_gpu=settings.max_token_len,
    )  # fmt: skip
    return worker, actor


def to_engine_input(tensors: dict[str, torch.Tensor], max_token_len: int | None = None, **meta: Any) -> Any:
    """Padded tensors → veRL's no-padding TensorDict (nested input ids), with per-call settings as non-tensors.

    ``temperature``: per row (``trainer.batch.padded``: each segment's sampling temperature; veRL divides that row's
    logits by it), 1 for all where the tensors have none. ``max_token_len``: tokens per micro-batch, raised to the
    longest row (veRL asserts every row fits one)."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    if max_token_len is not None:
        meta["max_token_len_per_gpu"] = max(max_token_len, int(tensors["attention_mask"].sum(-1).max()))
    data = tu.get_tensordict(dict(tensors))
    data = left_right_2_no_padding(data)
    if "temperature" not in tensors:
        meta["temperature"] = 1.0
    tu.assign_non_tensor(data, **meta)
    return data


def freeze_tied_embedding(worker: Any, settings: EngineSettings) -> bool:
    """Keep a tied input/output embedding fixed: vLLM's (0.32, CPU) ``reload_weights`` updates every weight but
    a tied ``lm_head``, which keeps the values it started with (measured: after a reload the server equals the new
    body with the old lm_head to 8e-6, and the new weights only to 1.8e-3 after four steps). A publish could then
    never land exactly; with the embedding fixed it does. Untied models and LoRA train everything as usual."""
    module = worker.engine.module
    config = getattr(module, "config", None)
    if not settings.freeze_tied_embedding or not getattr(config, "tie_word_embeddings", False) or settings.lora_rank:
        return False
    module.get_input_embeddings().weight.requires_grad_(False)
    return True


def save_weights(worker: Any, folder: Path, lora: bool, base_model: Path) -> None:
    """The weights as vLLM loads them, into ``folder``: ``model.safetensors`` (full weights, HF names) or a LoRA
    adapter (``adapter_model.safetensors`` + ``adapter_config.json``). Every rank gathers (FSDP2's full tensors are
    a collective); rank 0 writes, straight from the gathered tensors (``trainer.publish.save_safetensors``)."""
    import json

    import torch.distributed as dist

    from trainer.publish import json_value, save_safetensors

    engine: Any = worker.engine
    params, peft_config = engine.get_per_tensor_param(base_sync_done=True) if lora else engine.get_per_tensor_param()
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in params:
        tensor = tensor.detach().to("cpu").contiguous()
        if tensor.data_ptr() in seen:  # tied weights (SmolLM2's lm_head is its embedding): stored once
            continue
        seen.add(tensor.data_ptr())
        tensors[name] = tensor
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    if lora:
        save_safetensors(tensors, folder / "adapter_model.safetensors", metadata={"format": "pt"})
        config = peft_config.to_dict() if hasattr(peft_config, "to_dict") else dict(peft_config)
        config["base_model_name_or_path"] = str(base_model)
        (folder / "adapter_config.json").write_text(json.dumps(config, indent=1, default=json_value))
    else:
        save_safetensors(tensors, folder / "model.safetensors", metadata={"format": "pt"})


class PolicyEngine:
    """One FSDP2 TrainingWorker in this process (rank 0 of 1); with ``kl_coef`` and full weights, a second one
    holding the reference (the initial weights, never updated). With LoRA the reference is the adapter disabled."""

    def __init__(self, settings: EngineSettings) -> None:
        from verl.workers.engine_workers import TrainingWorker
        from verl.workers.utils.losses import ppo_loss

        init_distributed()
        self.settings = settings
        self.workers = 1
        worker_cfg, self.actor_config = worker_config(settings)
        self.worker = TrainingWorker(worker_cfg)
        self.worker.reset()
        self.worker.set_loss_fn(partial(ppo_loss, config=self.actor_config))
        self.frozen_tied_embedding = freeze_tied_embedding(self.worker, settings)
        packing.install(self.worker.engine)
        self.reference: Any = None
        if settings.kl_coef > 0 and not settings.lora_rank:
            self.reference = TrainingWorker(worker_config(settings)[0])
            self.reference.reset()
            packing.install(self.reference.engine)

    def log_probs(self, tensors: dict[str, torch.Tensor], reference: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The current (or the reference) weights' logprobs and entropies of each response token, padded like
        ``responses``."""
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.padding import no_padding_2_padding

        meta = {"no_lora_adapter": True} if reference and self.settings.lora_rank else {}
        data = to_engine_input(
            tensors, self.settings.max_token_len, compute_loss=False, calculate_entropy=not reference,
            prefix_packing=self.settings.prefix_packing, **meta,
        )  # fmt: skip
        worker = self.reference if reference and self.reference is not None else self.worker
        output = worker.infer_batch(data)
        log_probs = no_padding_2_padding(tu.get(output, "log_probs"), data).float()
        entropy = tu.get(output, "entropy")
        entropy = no_padding_2_padding(entropy, data).float() if entropy is not None else torch.zeros_like(log_probs)
        return log_probs, entropy

    def update(self, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
        """``epochs`` optimizer steps over the whole batch (one mini-batch): veRL's train_mini_batch."""
        from verl.utils import tensordict_utils as tu

        n = tensors["responses"].shape[0]
        data = to_engine_input(
            tensors, self.settings.max_token_len, compute_loss=True, calculate_entropy=True, global_batch_size=n,
            mini_batch_size=n, epochs=self.settings.epochs, seed=self.settings.seed,
            dataloader_kwargs={"shuffle": False}, prefix_packing=self.settings.prefix_packing,
        )  # fmt: skip
        packing.take_stats(self.worker.engine)
        output = self.worker.train_mini_batch(data)
        return {**tu.get(output, "metrics"), **packing.take_stats(self.worker.engine).as_metrics()}

    def weights(self) -> tuple[Iterator[tuple[str, torch.Tensor]], Any]:
        """The full weights (names as in the HF checkpoint), or the LoRA adapter's and its peft config."""
        engine: Any = self.worker.engine
        if self.settings.lora_rank:
            params, peft_config = engine.get_per_tensor_param(base_sync_done=True)
            return iter(params), peft_config
        params, _ = engine.get_per_tensor_param()
        return params, None

    def save_weights(self, folder: Path) -> None:
        save_weights(self.worker, folder, bool(self.settings.lora_rank), self.settings.model_dir)

    def save(self, directory: Path, step: int) -> None:
        """Model shards, optimizer state and RNG (veRL's checkpoint manager), for --resume."""
        self.worker.save_checkpoint(str(directory), global_step=step)

    def load(self, directory: Path) -> None:
        self.worker.load_checkpoint(str(directory), del_local_after_load=False)

    def close(self) -> None:
        pass
