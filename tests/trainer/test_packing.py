"""Prefix packing (trainer.packing): the tree and its mask, the micro-batch plan, and a packed update that equals
veRL's plain one — loss, metrics and every gradient — on the real SmolLM2 in veRL's engine, for a demo-like round
(G rollouts sharing a prompt) and a forked OpenClaw-like episode. A wrong mask or wrong position ids must fail the
same comparison (the negative controls below), so the comparison can tell."""

from typing import Any

import pytest
import torch

from trainer.batch import Row, padded
from trainer.packing import pack, plan, split_to

# fp32: the packed forward runs other matmul shapes than the plain one, so sums round differently. Measured on the
# rows below: every gradient within 7e-5 of the largest gradient, losses and the gradient norm to 2e-5 (relative),
# logprobs and the PPO KL (a mean of logprob differences) to 4e-5 nat.
GRAD_TOLERANCE = 1e-4  # max |Δ grad| / max |grad|
LOSS_TOLERANCE = 1e-4  # relative: pg_loss, entropy_loss, grad_norm
LOGPROB_TOLERANCE = 1e-4  # nat: logprobs, ppo_kl


def test_rows_sharing_a_prefix_share_its_nodes():
    packed = pack([[1, 2, 3, 4], [1, 2, 5], [1, 2, 3, 4, 6], [7, 2]])
    assert packed.input_ids.tolist() == [1, 2, 3, 4, 5, 6, 7, 2]
    assert [p.tolist() for p in packed.paths] == [[0, 1, 2, 3], [0, 1, 4], [0, 1, 2, 3, 5], [6, 7]]
    assert packed.position_ids.tolist() == [0, 1, 2, 3, 2, 4, 0, 1]
    assert packed.parent.tolist() == [-1, 0, 1, 2, 1, 3, -1, 6]
    # the same token at the same position after another prefix, or at another position, is another node
    assert len(pack([[1, 2], [3, 2]])) == 4
    assert len(pack([[1, 2], [1, 2]], positions=[[0, 1], [0, 2]])) == 3


def test_each_token_sees_exactly_its_own_path():
    rows = [[1, 2, 3, 4], [1, 2, 5], [1, 2, 3, 4, 6], [7, 2]]
    packed = pack(rows)
    allowed = packed.attention_mask()[0, 0]
    ancestors = torch.zeros_like(allowed)
    for i in range(len(packed)):
        j = i
        while j >= 0:
            ancestors[i, j] = True
            j = int(packed.parent[j])
    assert torch.equal(allowed, ancestors)
    for path in packed.paths:  # each row, read back through its path, is its own causal mask
        assert torch.equal(allowed[path][:, path], torch.ones(len(path), len(path), dtype=torch.bool).tril())
    additive = packed.attention_mask(torch.float32)[0, 0]
    assert torch.equal(additive == 0, allowed)


def test_the_plan_keeps_rows_with_a_shared_prefix_together_within_the_budget():
    shared = list(range(100, 140))
    rows = [[*shared, 1, i] for i in range(4)] + [list(range(200, 260))] + [shared[:10] + [9] * 5]
    batches = plan(rows, budget=60)
    assert sorted(i for b in batches for i in b) == list(range(len(rows)))
    for b in batches:
        assert len(pack([rows[i] for i in b])) <= 60 or len(b) == 1
    assert [4] in batches  # 60 tokens sharing nothing: a micro-batch of its own
    assert any(set(b) >= {0, 1, 2, 3} for b in batches)  # 40 shared + 1 + 4 × 1 = 45 tokens: together
    assert plan([[1] * 80], budget=60) == [[0]]  # a row longer than the budget still gets one


def test_a_plan_is_split_to_the_count_the_other_ranks_need_and_keeps_every_row_once():
    batches = [[3, 1, 4, 0], [2], [5, 6]]
    for count in range(3, 8):
        split = split_to(batches, count)
        assert len(split) == count and sorted(i for b in split for i in b) == list(range(7))
        assert all(b for b in split)
    assert split_to(batches, 4)[0:2] == [[3, 1], [4, 0]]  # the widest in halves, its rows' order kept
    with pytest.raises(ValueError, match="cannot make 8 micro-batches of 7 rows"):
        split_to(batches, 8)


# ---- the real model in veRL's engine ---------------------------------------------------------------------------


def chat(tokenizer, messages: list[dict], generation_prompt: bool = False) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True,
                                              return_dict=False))  # fmt: skip


def demo_rows(tokenizer) -> list[Row]:
    """Two tasks × two rollouts: one system prompt, each task's text, sampled answers (one row at T = 0.5)."""
    system = {"role": "system", "content": "You answer with one bash command in a ```bash code block."}
    rows = []
    for t, task in enumerate(("Create a folder named data.", "Create a file named a.txt holding the word hi.")):
        prompt = chat(tokenizer, [system, {"role": "user", "content": f"Task: {task}\nAnswer:"}], True)
        for k, answer in enumerate(("```bash\nmkdir data\n```", "I would run ```bash\nls\n```")):
            response = tokenizer.encode(answer + "<|im_end|>", add_special_tokens=False)
            rows.append(Row(f"t{t}-{k}", f"t{t}", 0, prompt, response, [1] * len(response), [0.0] * len(response),
                            float(k == 0), 0, temperature=0.5 if (t, k) == (1, 1) else 1.0))  # fmt: skip
    return rows


def forked_rows(tokenizer) -> list[Row]:
    """An OpenClaw-like episode that forks: turn 1 (trainable), a tool result (context, mask 0), turn 2; the harness
    then rewrites its history after turn 1 (an internal user message), so a second segment shares everything up to
    the fork. A sibling episode of the group shares the system prompt only."""
    system = {"role": "system", "content": "You are a coding agent. Use the tools."}
    user = {"role": "user", "content": "Fix the failing test."}
    head = chat(tokenizer, [system, user], True)
    turn1 = tokenizer.encode("Let me look.\n<tool_call>ls</tool_call><|im_end|>\n", add_special_tokens=False)
    tool = tokenizer.encode("<|im_start|>tool\ntest_a.py\n<|im_end|>\n<|im_start|>assistant\n",
                            add_special_tokens=False)  # fmt: skip
    turn2 = tokenizer.encode("Now I edit test_a.py.<|im_end|>", add_special_tokens=False)
    fork = tokenizer.encode("<|im_start|>user\n(internal) continue\n<|im_end|>\n<|im_start|>assistant\n",
                            add_special_tokens=False)  # fmt: skip
    turn2b = tokenizer.encode("Done.<|im_end|>", add_special_tokens=False)
    sibling = chat(tokenizer, [system, {"role": "user", "content": "Add a README."}], True)
    answer = tokenizer.encode("Writing it.<|im_end|>", add_special_tokens=False)

    def row(episode: str, segment: int, prompt: list[int], parts: list[tuple[list[int], int]], reward: float) -> Row:
        response = [t for ids, _ in parts for t in ids]
        mask = [m for ids, m in parts for _ in ids]
        return Row(episode, "g", segment, prompt, response, mask, [0.0] * len(response), reward, 0)

    return [
        row("a", 0, head, [(turn1, 1), (tool, 0), (turn2, 1)], 1.0),
        row("a", 1, head, [(turn1, 0), (fork, 0), (turn2b, 1)], 1.0),  # the fork: turn 1 trained in segment 0
        row("b", 0, sibling, [(answer, 1)], 0.0),
    ]


@pytest.fixture(scope="module")
def engine(prepared_model):
    """Full weights (every gradient compared), lr 0 (the weights never move) and no clipping of the gradients the
    comparison reads (snapshot before veRL's optimizer step)."""
    from trainer.engine import EngineSettings, PolicyEngine

    policy = PolicyEngine(EngineSettings(model_dir=prepared_model.train_dir, lr=0.0, grad_clip=1e9,
                                         entropy_coeff=0.01))  # fmt: skip
    grads: dict[str, torch.Tensor] = {}
    verl_engine: Any = policy.worker.engine
    step = verl_engine.optimizer_step

    def snapshot_then_step():
        grads.clear()
        for name, p in verl_engine.module.named_parameters():
            if p.grad is not None:
                grads[name] = (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).detach().clone()
        return step()

    verl_engine.optimizer_step = snapshot_then_step
    policy.grads = grads  # type: ignore[attr-defined]
    return policy


def update(engine, rows: list[Row], packing: bool) -> tuple[dict, dict[str, torch.Tensor], torch.Tensor]:
    """One update (veRL's ppo_loss on GRPO-like advantages, old logprobs = the current ones, slightly shifted so
    the ratio is not 1) with packing on or off: its metrics, gradients and the engine's logprobs."""
    tensors = padded(rows)
    tensors.pop("rollout_log_probs")
    mask = tensors["response_mask"]
    engine.settings.prefix_packing = False
    current, _ = engine.log_probs(tensors)
    tensors["old_log_probs"] = (current - 0.05) * mask
    tensors["advantages"] = torch.tensor([[r.reward - 0.5] for r in rows]) * mask
    engine.settings.prefix_packing = packing
    log_probs, _ = engine.log_probs(tensors)
    metrics = engine.update(tensors)
    return metrics, dict(engine.grads), log_probs * mask


def differences(engine, rows: list[Row]) -> dict[str, float]:
    plain, plain_grads, plain_lp = update(engine, rows, packing=False)
    packed, packed_grads, packed_lp = update(engine, rows, packing=True)
    assert packed["packing/micro_batches_packed"] >= 1 and packed["packing/micro_batches_plain"] == 0
    assert plain["packing/micro_batches_packed"] == 0
    assert packed["packing/tokens_computed"] <= plain["packing/tokens_computed"]  # less where rows share a prefix
    assert plain_grads.keys() == packed_grads.keys() and len(plain_grads) > 100
    scale = max(float(g.abs().max()) for g in plain_grads.values())
    out = {"grad": max(float((plain_grads[n] - packed_grads[n]).abs().max()) for n in plain_grads) / scale,
           "logprob": float((plain_lp - packed_lp).abs().max())}  # fmt: skip
    for key in ("actor/pg_loss", "actor/entropy_loss", "grad_norm"):
        a, b = float(sum(plain[key])), float(sum(packed[key]))
        out[key] = abs(a - b) / max(abs(a), 1e-12)
    out["actor/ppo_kl"] = abs(float(sum(plain["actor/ppo_kl"])) - float(sum(packed["actor/ppo_kl"])))
    return out


@pytest.mark.parametrize("batch", ["demo", "forked", "demo, a micro-batch per row"])
def test_a_packed_update_equals_the_plain_one(engine, tokenizer, monkeypatch, batch):
    rows = demo_rows(tokenizer) if batch.startswith("demo") else forked_rows(tokenizer)
    if batch.endswith("per row"):  # the budget is raised to the longest row: one row per micro-batch
        monkeypatch.setattr(engine.settings, "max_token_len", 1)
    diff = differences(engine, rows)
    print(batch, diff)
    assert diff["grad"] <= GRAD_TOLERANCE, diff
    assert diff["logprob"] <= LOGPROB_TOLERANCE and diff["actor/ppo_kl"] <= LOGPROB_TOLERANCE, diff
    for key in ("actor/pg_loss", "actor/entropy_loss", "grad_norm"):
        assert diff[key] <= LOSS_TOLERANCE, diff


@pytest.mark.parametrize("wrong", ["causal mask over the packed sequence", "position ids along the packed sequence"])
def test_a_wrong_mask_or_wrong_positions_fail_the_comparison(engine, tokenizer, monkeypatch, wrong):
    from trainer import packing

    if wrong.startswith("causal"):

        def causal(self, dtype=None):
            return torch.ones(len(self), len(self), dtype=torch.bool).tril()[None, None]

        monkeypatch.setattr(packing.PackedRows, "attention_mask", causal)
    else:
        original = packing.pack

        def packed_positions(rows, positions=None):
            packed = original(rows, positions)
            packed.position_ids = torch.arange(len(packed))
            return packed

        monkeypatch.setattr(packing, "pack", packed_positions)
    diff = differences(engine, demo_rows(tokenizer))
    print(wrong, diff)
    assert diff["grad"] > 100 * GRAD_TOLERANCE and diff["logprob"] > 100 * LOGPROB_TOLERANCE, diff
