"""Prefix packing: the rows of a micro-batch that share a token prefix are computed once (issue 24).

The G rollouts of a task share their system prompt and task text; the forked segments of one episode share
everything up to the fork. Plain veRL computes every row whole. Here a micro-batch's rows go into one prefix tree
(token-exact: the ids as they are, a node per distinct (parent, token, position)); the tree is one packed sequence in
which each node follows its parent, with a 4-D attention mask that lets a token see only its ancestors (its own
path) and each token's own position id, so every token's hidden state is the one it has in its own row. Logits are
computed only where the loss reads them (before each trainable response token), per row, at the row's temperature,
by veRL's own ``logprobs_from_logits``/``entropy_from_logits``; they are laid out as veRL's no-padding model
output, and veRL's loss (``ppo_loss``, the same masks, advantages, old logprobs and global token mean) takes it from
there. The micro-batches are planned by packed tokens (rows sorted by their ids, so rows sharing a prefix are
neighbours); veRL's ppo_loss normalizes by the whole mini-batch, so how rows are split does not change the update.

The engine takes this path when the data says ``prefix_packing`` and its model's attention takes a 4-D mask
(``sdpa``, ``eager``); otherwise it is veRL's own path, counted (``PackingStats``).
"""

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

# Attention implementations that take a custom 4-D mask as it is (transformers' masking_utils returns one as-is).
MASKED_ATTENTION = ("sdpa", "eager")


@dataclass
class PackedRows:
    """Rows as one prefix tree laid out as one sequence."""

    input_ids: torch.Tensor  # (L,) one token per tree node
    position_ids: torch.Tensor  # (L,) each node's position in its rows
    parent: torch.Tensor  # (L,) the node before it on its path; -1 at a root
    paths: list[torch.Tensor]  # per row: the node of each of its tokens

    def __len__(self) -> int:
        return len(self.input_ids)

    def attention_mask(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """(1, 1, L, L): node i sees node j iff j is on i's path up to i. Bool (True: attend), or additive in
        ``dtype`` (0 / the dtype's minimum) for attention that adds its mask to the scores (eager)."""
        n = len(self)
        allowed = torch.zeros(n, n, dtype=torch.bool)
        for path in self.paths:  # on every path through two nodes they are in the same order: assigning is a union
            k = len(path)
            allowed[path.unsqueeze(1), path.unsqueeze(0)] = torch.ones(k, k, dtype=torch.bool).tril()
        if dtype is None:
            return allowed[None, None]
        mask = torch.zeros(n, n, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
        return mask[None, None]


def pack(rows: list[list[int]], positions: list[list[int]] | None = None) -> PackedRows:
    """Rows of token ids (and their position ids; 0, 1, ... by default) → one prefix tree, each node after its
    parent."""
    nodes: dict[tuple[int, int, int], int] = {}
    ids: list[int] = []
    pos: list[int] = []
    parent: list[int] = []
    paths = []
    for r, row in enumerate(rows):
        row_positions = positions[r] if positions is not None else range(len(row))
        node, path = -1, []
        for token, p in zip(row, row_positions, strict=True):
            key = (node, token, p)
            child = nodes.get(key)
            if child is None:
                child = nodes[key] = len(ids)
                ids.append(token)
                pos.append(p)
                parent.append(node)
            path.append(child)
            node = child
        paths.append(torch.tensor(path, dtype=torch.long))
    return PackedRows(torch.tensor(ids, dtype=torch.long), torch.tensor(pos, dtype=torch.long),
                      torch.tensor(parent, dtype=torch.long), paths)  # fmt: skip


def _shared(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def plan(rows: list[list[int]], budget: int) -> list[list[int]]:
    """Row indices per micro-batch: rows sorted by their ids (rows sharing a prefix are neighbours; a row adds to
    the tree its length less its common prefix with the row before it), a new micro-batch when the packed tokens
    would pass ``budget`` (a row longer than that gets one of its own)."""
    order = sorted(range(len(rows)), key=lambda i: rows[i])
    batches: list[list[int]] = []
    size = 0
    for n, i in enumerate(order):
        new = len(rows[i]) - (_shared(rows[order[n - 1]], rows[i]) if n else 0)
        if batches and batches[-1] and size + new <= budget:
            batches[-1].append(i)
            size += new
        else:
            batches.append([i])
            size = len(rows[i])
    return batches


def split_to(batches: list[list[int]], count: int) -> list[list[int]]:
    """``batches`` split (the one with most rows in halves, again and again) until there are ``count``: FSDP's
    ranks must run the same number of forward and backward passes (each all-gathers the weights), as veRL's
    ``same_micro_num_in_dp`` makes them on its own path. The halves keep their rows' order (shared prefixes
    stay mostly together)."""
    batches = [list(b) for b in batches]
    while len(batches) < count:
        widest = max(range(len(batches)), key=lambda i: len(batches[i]))
        rows = batches[widest]
        if len(rows) < 2:
            raise ValueError(f"cannot make {count} micro-batches of {sum(map(len, batches))} rows")
        batches[widest : widest + 1] = [rows[: len(rows) // 2], rows[len(rows) // 2 :]]
    return batches


@dataclass
class PackingStats:
    """What the packed path computed, per update (``Engine.packing_stats``)."""

    micro_batches_packed: int = 0
    micro_batches_plain: int = 0  # veRL's own path: packing off, or a backend without 4-D masks
    tokens_in_rows: int = 0  # the rows' tokens: what the plain path runs through the model
    tokens_computed: int = 0  # the tokens run through the model (packed: tree nodes)
    logits_computed: int = 0  # positions whose logits were computed (plain: every token)
    reasons: dict[str, int] = field(default_factory=dict)

    def plain(self, reason: str, tokens: int, micro_batches: int) -> None:
        self.micro_batches_plain += micro_batches
        self.tokens_in_rows += tokens
        self.tokens_computed += tokens
        self.logits_computed += tokens
        self.reasons[reason] = self.reasons.get(reason, 0) + micro_batches

    def as_metrics(self) -> dict[str, Any]:
        return {f"packing/{k}": v for k, v in asdict(self).items()}


def _row_ids(micro_batch: Any) -> tuple[list[list[int]], list[list[int]]]:
    """Each row's token ids and position ids, from veRL's nested (no-padding) layout."""
    ids = [t.tolist() for t in micro_batch["input_ids"].unbind()]
    positions = micro_batch["position_ids"]
    if positions.is_nested:
        return ids, [t.tolist() for t in positions.unbind()]
    return ids, [p[: len(r)] for p, r in zip(positions.tolist(), ids, strict=True)]


def _response_lens(micro_batch: Any) -> torch.Tensor:
    """Response length per row, read as veRL's ``no_padding_2_padding`` reads it."""
    prompts, responses = micro_batch["prompts"], micro_batch["responses"]
    if responses.is_nested:
        return responses.offsets().diff()
    return micro_batch["attention_mask"][:, prompts.shape[1] :].sum(dim=1)


def needed(micro_batch: Any, rows: list[list[int]], whole_response: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, position) of the logprobs to compute: the position before each response token, of those the loss
    reads (its mask) when training, of every one (``whole_response``: the engine's logprobs, as veRL gives them)."""
    mask = micro_batch["response_mask"]
    mask = torch.nested.to_padded_tensor(mask, 0) if mask.is_nested else mask
    response_lens = _response_lens(micro_batch)
    row_idx, pos_idx = [], []
    for r, row in enumerate(rows):
        q = int(response_lens[r])
        wanted = torch.ones(q, dtype=torch.bool) if whole_response else mask[r, :q].bool()
        js = torch.nonzero(wanted, as_tuple=False).flatten()
        row_idx.append(torch.full_like(js, r))
        pos_idx.append(js + (len(row) - q - 1))
    return torch.cat(row_idx), torch.cat(pos_idx)


def packed_forward_step(engine: Any, micro_batch: Any, loss_function: Callable | None, forward_only: bool,
                        stats: PackingStats) -> tuple[torch.Tensor, dict[str, Any]]:  # fmt: skip
    """veRL's ``forward_step`` for one micro-batch, its rows packed: the same model output (log_probs, entropy as
    no-padding nested tensors; 0 where the loss reads nothing) and veRL's loss function on it."""
    from verl.utils import tensordict_utils as tu
    from verl.utils import torch_functional as verl_F
    from verl.utils.device import get_device_id
    from verl.workers.engine.utils import detach_tree

    micro_batch = micro_batch.to(get_device_id())
    rows, positions = _row_ids(micro_batch)
    packed = pack(rows, positions)
    row_idx, pos_idx = needed(micro_batch, rows, whole_response=forward_only)
    nodes = torch.stack([packed.paths[r][p] for r, p in zip(row_idx.tolist(), pos_idx.tolist(), strict=True)]) \
        if len(row_idx) else torch.zeros(0, dtype=torch.long)  # fmt: skip
    keep, inverse = torch.unique(nodes, return_inverse=True)
    labels = torch.tensor([rows[r][p + 1] for r, p in zip(row_idx.tolist(), pos_idx.tolist(), strict=True)],
                          dtype=torch.long)  # fmt: skip
    device = micro_batch["input_ids"].values().device
    attn = _attention_implementation(engine.module)
    dtype = getattr(engine, "_autocast_dtype", torch.float32)
    # One row: its own causal attention (the model's fused causal kernel, no L × L mask for a long segment)
    mask = packed.attention_mask(None if attn == "sdpa" else dtype).to(device) if len(rows) > 1 else None
    autocast: Any = nullcontext() if dtype == torch.float32 else torch.autocast(device_type=device.type, dtype=dtype)
    with autocast:
        output = engine.module(input_ids=packed.input_ids[None].to(device), attention_mask=mask,
                               position_ids=packed.position_ids[None].to(device), logits_to_keep=keep.to(device),
                               use_cache=False)  # fmt: skip
        logits = output.logits[0][inverse.to(device)]  # (entries, vocab): rows sharing a node share its logits
        temperature = micro_batch["temperature"]
        if isinstance(temperature, torch.Tensor):
            temperature = temperature.to(torch.float32)[row_idx.to(device)].unsqueeze(-1)
            logits = logits / temperature.clamp(min=1e-8).to(logits.dtype)
        elif float(temperature) != 1.0:
            logits = logits / float(temperature)
        calculate_entropy = tu.get_non_tensor_data(data=micro_batch, key="calculate_entropy", default=False)
        offsets = micro_batch["input_ids"].offsets()
        flat = (offsets[:-1][row_idx.to(device)] + pos_idx.to(device)).long()
        total = int(offsets[-1])
        model_output: dict[str, Any] = {}
        log_probs = verl_F.logprobs_from_logits(logits=logits, labels=labels.to(device))
        model_output["log_probs"] = _jagged(log_probs, flat, total, offsets)
        if calculate_entropy:
            if engine.engine_config.entropy_checkpointing:
                entropy = torch.utils.checkpoint.checkpoint(verl_F.entropy_from_logits, logits, use_reentrant=False)
            else:
                entropy = verl_F.entropy_from_logits(logits)
            model_output["entropy"] = _jagged(entropy, flat, total, offsets)
        if loss_function is not None:
            loss, metrics = loss_function(model_output=model_output, data=micro_batch,
                                          dp_group=engine.get_data_parallel_group())  # fmt: skip
        else:
            assert forward_only, "forward_only must be True when loss_function is None"
            loss, metrics = torch.tensor(1.0, device=device), {}
    stats.micro_batches_packed += 1
    stats.tokens_in_rows += sum(len(r) for r in rows)
    stats.tokens_computed += len(packed)
    stats.logits_computed += len(keep)
    return loss, {"model_output": detach_tree(model_output), "loss": loss.detach().item(), "metrics": metrics}


def _jagged(values: torch.Tensor, flat: torch.Tensor, total: int, offsets: torch.Tensor) -> torch.Tensor:
    """Per-entry values → veRL's no-padding layout (one value per token of each row), 0 where none was computed."""
    out = torch.zeros(total, dtype=values.dtype, device=values.device).index_put((flat,), values)
    return torch.nested.nested_tensor_from_jagged(out, offsets)


def _attention_implementation(module: Any) -> str | None:
    config = getattr(module, "config", None)
    return getattr(config, "_attn_implementation", None) if config is not None else None


def packable(engine: Any) -> str | None:
    """Why the engine cannot pack (None: it can): a model whose attention takes no 4-D mask, a sequence split over
    ranks (Ulysses) (checked once per batch). Data-parallel ranks pack each their own rows."""
    if _attention_implementation(engine.module) not in MASKED_ATTENTION:
        return "attention_without_4d_mask"
    if getattr(engine, "ulysses_sequence_parallel_size", 1) > 1:
        return "sequence_parallel"
    return None


def packed_forward_backward_batch(engine: Any, data: Any, loss_function: Callable | None, forward_only: bool,
                                  stats: PackingStats) -> Any:  # fmt: skip
    """veRL's ``forward_backward_batch`` with micro-batches planned by packed tokens and packed forward steps."""
    from verl.utils import tensordict_utils as tu
    from verl.utils.device import get_device_id
    from verl.workers.engine.utils import postprocess_batch_func

    tu.assign_non_tensor(data, sp_size=1)
    return_model_output = tu.get_non_tensor_data(data=data, key="return_model_output", default=False)
    batch_num_tokens = data["loss_mask"].sum().to(get_device_id())
    torch.distributed.all_reduce(batch_num_tokens, op=torch.distributed.ReduceOp.SUM,
                                 group=engine.get_data_parallel_group())  # fmt: skip
    tu.assign_non_tensor(data, batch_num_tokens=batch_num_tokens.item(), dp_size=engine.get_data_parallel_size())
    budget = tu.get_non_tensor_data(data=data, key="max_token_len_per_gpu", default=None)
    rows = [t.tolist() for t in data["input_ids"].unbind()]
    indices = plan(rows, int(budget) if budget else sum(len(r) for r in rows))
    if engine.get_data_parallel_size() > 1:  # every rank runs the most micro-batches any rank planned
        count = torch.tensor(len(indices), device=get_device_id())
        torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX, group=engine.get_data_parallel_group())
        indices = split_to(indices, int(count))
    tu.assign_non_tensor(data, use_dynamic_bsz=True)  # postprocess restores the rows' order from ``indices``
    outputs = []
    grad = torch.no_grad() if forward_only else nullcontext()
    for n, idx in enumerate(indices):
        micro_batch = tu.index_select_tensor_dict(data, idx)
        last = n == len(indices) - 1
        sync: Any = nullcontext() if forward_only else engine._gradient_sync_context(is_last_micro_batch=last)
        with grad, sync:
            loss, meta = packed_forward_step(engine, micro_batch, loss_function, forward_only, stats)
            if not forward_only:
                loss.backward()
                if not return_model_output:
                    meta.pop("model_output", None)
        outputs.append(meta)
    return postprocess_batch_func(output_lst=outputs, indices=indices, data=data)


def engine_class(base: type) -> type:
    """``base`` (veRL's FSDP engine with an LM head) whose ``forward_backward_batch`` packs when the data asks for
    it and the model can take the mask, counted either way in ``packing_stats``."""

    class PrefixPackingEngine(base):
        packing_stats: PackingStats

        def forward_backward_batch(self, data: Any, loss_function: Callable, forward_only: bool = False) -> Any:
            from verl.utils import tensordict_utils as tu

            stats = self.__dict__.setdefault("packing_stats", PackingStats())
            reason = packable(self) if tu.get_non_tensor_data(data=data, key="prefix_packing", default=False) else "off"
            if reason is None:
                return packed_forward_backward_batch(self, data, loss_function, forward_only, stats)
            stats.plain(reason, int(data["input_ids"].offsets()[-1]), 1)
            return super().forward_backward_batch(data, loss_function, forward_only)

    PrefixPackingEngine.__name__ = PrefixPackingEngine.__qualname__ = f"PrefixPacking{base.__name__}"
    return PrefixPackingEngine


_CLASSES: dict[type, type] = {}


def install(engine: Any) -> None:
    """Give a built veRL engine the packed path (its class becomes ``engine_class`` of its class)."""
    base = type(engine)
    if base.__name__.startswith("PrefixPacking"):
        return
    engine.__class__ = _CLASSES.setdefault(base, engine_class(base))


def take_stats(engine: Any) -> PackingStats:
    """The stats since the last call, reset."""
    stats = engine.__dict__.pop("packing_stats", None)
    return stats if stats is not None else PackingStats()
