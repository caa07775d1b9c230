"""Seconds per update and trained tokens/s: OpenForge's whole step input path against a plain veRL update, and
the same step with prefix packing (issue 24: rows that share a token prefix computed once, ``trainer.packing``).

All run in one process on one FSDP2 TrainingWorker (SmolLM2-135M, fp32, CPU): "plain" is
``TrainingWorker.train_mini_batch`` on a TensorDict built once beforehand (what a veRL user calls); "forge" starts
from the collector's segment rows and does everything ``forge train`` does before and around that call
(rows → veRL advantages → old logprobs → padded → no-padding TensorDict → update); "packed" is "forge" with
``prefix_packing``. They alternate, so drift in a shared machine's load hits all of them.

``--batch random``: rows of random ids (nothing shared). ``--batch demo``: the demo's default round as the trainer
gets it — 8 tasks × G = 4 one-call episodes, each prompt mini-swe-agent's (forge/demo/tasks/mini.yaml: its system
prompt, the two worked examples and the task, in SmolLM2's chat template), responses of 40–104 sampled tokens
(~2,300 trainable in all), with the demo's update settings (LoRA r = 8, 4 epochs, 1,024-token micro-batches,
recomputed activations).

    .venv/bin/python bench/trainer_update.py --rows 4 --tokens 256 --repeats 3
    .venv/bin/python bench/trainer_update.py --batch demo --modes forge,packed --repeats 1
"""

import argparse
import json
import resource
import statistics
import time
from pathlib import Path

import pyarrow as pa
import torch

from collector.episode import SCHEMA_VERSION, SEGMENT_SCHEMA, Segment
from trainer.batch import episode_advantages, rows_from_segments
from trainer.engine import EngineSettings, PolicyEngine, to_engine_input
from trainer.loop import update_inputs
from trainer.serve import default_checkpoint

DEMO = Path(__file__).resolve().parent.parent / "forge" / "demo" / "tasks"


def segment(episode: str, group: str, ids: list[int], prompt: int, reward: float) -> Segment:
    n = len(ids)
    return {
        "episode_id": episode, "task_id": None, "run_id": None, "harness": None, "status_detail": None,
        "fork_call_id": None, "started_at": None, "finished_at": None,
        "group_id": group, "segment": 0, "input_ids": ids,
        "loss_mask": [0] * prompt + [1] * (n - prompt),
        "behaviour_logprobs": [0.0] * prompt + [-1.0] * (n - prompt), "reward": reward,
        "policy_version_min": "0", "policy_version_max": "0", "mixed_versions": False, "n_calls": 1,
        "n_trainable": n - prompt, "n_unknown_logprobs": 0, "status": "complete", "fork_reason": "start",
        "shared_prefix_len": 0,
        "call_ids": ["c"], "call_seqs": [0], "call_prompt_ends": [prompt], "call_completion_ends": [n],
        "call_statuses": ["ok"], "call_rewards": [None], "temperature": 1.0,
    }  # fmt: skip


def segments(rows: int, tokens: int, seed: int = 0) -> pa.Table:
    """Segments of ``tokens`` ids: a quarter prompt, the rest sampled; two groups with rewards 1/0."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(rows):
        ids = torch.randint(100, 40000, (tokens,), generator=g).tolist()
        out.append(segment(f"e{i}", f"g{i % 2}", ids, tokens // 4, float(i % 2 == 0)))
    return pa.Table.from_pylist([{"schema_version": SCHEMA_VERSION, **row} for row in out], schema=SEGMENT_SCHEMA)


def demo_segments(tasks: int = 8, rollouts: int = 4, seed: int = 0) -> pa.Table:
    """The demo's round: each task's prompt as mini-swe-agent sends it, G sampled answers (random ids of 40–104
    tokens: their text does not change the cost), rewards that vary within each group (no group is left out)."""
    import yaml
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_checkpoint("float32"), local_files_only=True)
    agent = yaml.safe_load((DEMO / "mini.yaml").read_text())["agent"]
    lines = [line for line in (DEMO / "tasks.jsonl").read_text().splitlines() if line.startswith("{")]
    g = torch.Generator().manual_seed(seed)
    out = []
    for t, line in enumerate(lines[:tasks]):
        task = json.loads(line)
        user = agent["instance_template"].replace("{{task}}", task["prompt"])
        messages = [{"role": "system", "content": agent["system_template"]}, {"role": "user", "content": user}]
        prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                    return_dict=False))  # fmt: skip
        for k in range(rollouts):
            n = int(torch.randint(40, 105, (1,), generator=g))
            answer = torch.randint(100, 40000, (n,), generator=g).tolist()
            out.append(segment(f"t{t}-{k}", task["id"], prompt + answer, len(prompt), float(k % 2 == 0)))
    return pa.Table.from_pylist([{"schema_version": SCHEMA_VERSION, **row} for row in out], schema=SEGMENT_SCHEMA)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", choices=("random", "demo"), default="random")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", default="plain,forge,packed", help="which updates to time, comma-separated")
    args = parser.parse_args()
    modes = args.modes.split(",")
    if args.batch == "demo":  # forge demo's trainer settings (forge/demo/run.py)
        settings = EngineSettings(model_dir=default_checkpoint("float32"), lr=1e-3, lora_rank=8, epochs=4,
                                  max_token_len=1024, gradient_checkpointing=True)  # fmt: skip
        table = demo_segments()
    else:
        settings = EngineSettings(model_dir=default_checkpoint("float32"), lr=1e-6)
        table = segments(args.rows, args.tokens)
    engine = PolicyEngine(settings)
    stats: dict[str, dict] = {}

    def forge_update(packing: bool) -> int:
        engine.settings.prefix_packing = packing
        batch = rows_from_segments(table)
        tensors, _ = update_inputs(
            batch, episode_advantages(batch.episodes, "grpo"), "bypass", None, 2.0, engine.log_probs
        )
        metrics = engine.update(tensors)
        stats["packed" if packing else "forge"] = {k: v for k, v in metrics.items() if k.startswith("packing/")}
        return batch.n_trainable

    whole = rows_from_segments(table)
    prepared, _ = update_inputs(
        whole, episode_advantages(whole.episodes, "grpo"), "bypass", None, 2.0, engine.log_probs
    )
    n = len(whole)

    def plain_update() -> int:
        data = to_engine_input(dict(prepared), settings.max_token_len, compute_loss=True, calculate_entropy=True,
                               global_batch_size=n, mini_batch_size=n, epochs=settings.epochs, seed=1,
                               dataloader_kwargs={"shuffle": False})  # fmt: skip
        engine.worker.train_mini_batch(data)
        return int(prepared["response_mask"].sum())

    updates = {"plain": plain_update, "forge": lambda: forge_update(False), "packed": lambda: forge_update(True)}
    forge_update("packed" in modes)  # warm-up: first-call allocations
    times: dict[str, list[float]] = {m: [] for m in modes}
    tokens = 0
    for _ in range(args.repeats):
        for name in modes:
            started = time.perf_counter()
            tokens = updates[name]()
            times[name].append(time.perf_counter() - started)
    median = {m: statistics.median(t) for m, t in times.items()}
    shape = f"{args.rows} rows x {args.tokens} tokens" if args.batch == "random" else f"the demo's round: {n} rows"
    weights = f"LoRA r={settings.lora_rank}" if settings.lora_rank else "full weights"
    print(f"batch: {shape}, {whole.n_tokens} tokens ({tokens} trained), SmolLM2-135M fp32, {weights}, "
          f"{settings.epochs} epoch(s), micro-batches of {settings.max_token_len} tokens, CPU, "
          f"{torch.get_num_threads()} threads")  # fmt: skip
    labels = {"plain": "plain veRL train_mini_batch", "forge": "forge (segments -> update)",
              "packed": "forge, prefix packing"}  # fmt: skip
    for m in modes:
        print(f"{labels[m]}: {median[m]:.2f} s/update ({tokens / median[m]:.0f} trained tokens/s)  {times[m]}")
    for m, s in stats.items():
        if s.get("packing/tokens_in_rows"):
            print(f"{labels[m]}: tokens through the model per trained token "
                  f"{s['packing/tokens_computed'] / tokens / settings.epochs:.2f} (rows hold "
                  f"{s['packing/tokens_in_rows'] / tokens / settings.epochs:.2f}), logits per trained token "
                  f"{s['packing/logits_computed'] / tokens / settings.epochs:.2f}; {s}")  # fmt: skip
    if "plain" in median and "forge" in median:
        print(f"forge / plain throughput: {median['plain'] / median['forge']:.3f}x")
    if "forge" in median and "packed" in median:
        print(f"packed / forge speed-up: {median['forge'] / median['packed']:.2f}x")
    print(f"peak RSS: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2:.2f} GB")


if __name__ == "__main__":
    main()
