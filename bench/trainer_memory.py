"""Peak memory and seconds of one veRL update on a store's episodes, by micro-batch size and activation recompute.

    python -m bench.trainer_memory --store forge-demo/RUN/store --max-token-len 1024 --recompute

Reads every complete episode of the store through the collector (as `forge train` does), builds the rows, and runs
one `PolicyEngine.update` (LoRA r=8 unless --lora-rank 0). Prints the segments, tokens, seconds and the process's
peak RSS (it includes the model and the collector). Run it once per setting: the peak is the process's.
"""

import argparse
import resource
import time

from collector.collect import Collector, trainable
from trainer.batch import episode_advantages, rows_from_segments
from trainer.engine import EngineSettings, PolicyEngine
from trainer.loop import update_inputs
from trainer.serve import default_checkpoint


def peak_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--store", required=True)
    parser.add_argument("--max-token-len", type=int, default=1024)
    parser.add_argument("--recompute", action="store_true", help="gradient checkpointing")
    parser.add_argument("--lora-rank", type=int, default=8)
    args = parser.parse_args()
    segments = trainable(Collector(args.store, None, idle_seconds=0, progress=False).update().segments)
    batch = rows_from_segments(segments)
    tokens = sum(len(ids) for ids in segments["input_ids"].to_pylist())
    engine = PolicyEngine(EngineSettings(
        model_dir=default_checkpoint("float32"), lora_rank=args.lora_rank, lr=2e-4, max_token_len=args.max_token_len,
        gradient_checkpointing=args.recompute,
    ))  # fmt: skip
    before = peak_gb()
    tensors, _ = update_inputs(batch, episode_advantages(batch.episodes, "grpo"), "bypass", None, 2.0, engine.log_probs)
    started = time.perf_counter()
    engine.update(tensors)
    seconds = time.perf_counter() - started
    print(
        f"rows {len(batch.rows)}, tokens {tokens}, micro-batch {args.max_token_len} tokens, recompute "
        f"{args.recompute}: update {seconds:.1f} s, peak RSS {peak_gb():.2f} GB (loaded: {before:.2f} GB)"
    )


if __name__ == "__main__":
    main()
