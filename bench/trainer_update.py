"""Seconds per update and trained tokens/s: OpenForge's whole step input path against a plain veRL update.

Both run in one process on one FSDP2 TrainingWorker (SmolLM2-135M, fp32, CPU): "plain" is
``TrainingWorker.train_mini_batch`` on a TensorDict built once beforehand (what a veRL user calls); "forge" starts
from the collector's segment rows and does everything ``forge train`` does before and around that call
(rows → veRL advantages → old logprobs → padded → no-padding TensorDict → update). They alternate, so drift in a
shared machine's load hits both.

    .venv/bin/python bench/trainer_update.py --rows 4 --tokens 256 --repeats 3
"""

import argparse
import resource
import statistics
import time

import pyarrow as pa
import torch

from collector.episode import SEGMENT_SCHEMA
from trainer.batch import episode_advantages, rows_from_segments
from trainer.engine import EngineSettings, PolicyEngine, to_engine_input
from trainer.loop import update_inputs
from trainer.serve import default_checkpoint


def segments(rows: int, tokens: int, seed: int = 0) -> pa.Table:
    """Segments of ``tokens`` ids: a quarter prompt, the rest sampled; two groups with rewards 1/0."""
    g = torch.Generator().manual_seed(seed)
    prompt = tokens // 4
    out = []
    for i in range(rows):
        ids = torch.randint(100, 40000, (tokens,), generator=g).tolist()
        out.append({
            "schema_version": 1, "episode_id": f"e{i}", "group_id": f"g{i % 2}", "segment": 0, "input_ids": ids,
            "loss_mask": [0] * prompt + [1] * (tokens - prompt),
            "behaviour_logprobs": [0.0] * prompt + [-1.0] * (tokens - prompt), "reward": float(i % 2 == 0),
            "policy_version_min": "0", "policy_version_max": "0", "mixed_versions": False, "n_calls": 1,
            "n_trainable": tokens - prompt, "status": "complete", "fork_reason": "start", "shared_prefix_len": 0,
            "call_ids": ["c"], "call_seqs": [0], "call_prompt_ends": [prompt], "call_completion_ends": [tokens],
            "call_statuses": ["ok"], "call_rewards": [None],
        })  # fmt: skip
    return pa.Table.from_pylist(out, schema=SEGMENT_SCHEMA)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    engine = PolicyEngine(EngineSettings(model_dir=default_checkpoint("float32"), lr=1e-6))
    table = segments(args.rows, args.tokens)

    def forge_update() -> int:
        batch = rows_from_segments(table)
        tensors, _ = update_inputs(
            batch, episode_advantages(batch.episodes, "grpo"), "bypass", None, 2.0, engine.log_probs
        )
        engine.update(tensors)
        return batch.n_trainable

    whole = rows_from_segments(table)
    prepared, _ = update_inputs(
        whole, episode_advantages(whole.episodes, "grpo"), "bypass", None, 2.0, engine.log_probs
    )
    n = args.rows

    def plain_update() -> int:
        data = to_engine_input(dict(prepared), compute_loss=True, calculate_entropy=True, global_batch_size=n,
                               mini_batch_size=n, epochs=1, seed=1, dataloader_kwargs={"shuffle": False})  # fmt: skip
        engine.worker.train_mini_batch(data)
        return int(prepared["response_mask"].sum())

    forge_update()  # warm-up: first-call allocations
    times: dict[str, list[float]] = {"plain": [], "forge": []}
    tokens = 0
    for _ in range(args.repeats):
        for name, fn in (("plain", plain_update), ("forge", forge_update)):
            started = time.perf_counter()
            tokens = fn()
            times[name].append(time.perf_counter() - started)
    plain, forge = statistics.median(times["plain"]), statistics.median(times["forge"])
    print(f"batch: {args.rows} rows x {args.tokens} tokens ({tokens} trained), SmolLM2-135M fp32, CPU, "
          f"{torch.get_num_threads()} threads")  # fmt: skip
    print(
        f"plain veRL train_mini_batch: {plain:.2f} s/update ({tokens / plain:.0f} trained tokens/s)  {times['plain']}"
    )
    print(f"forge (segments -> update): {forge:.2f} s/update ({tokens / forge:.0f} trained tokens/s)  {times['forge']}")
    print(f"forge / plain throughput: {plain / forge:.3f}x")
    print(f"peak RSS: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2:.2f} GB")


if __name__ == "__main__":
    main()
