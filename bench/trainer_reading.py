"""Reading batches: segments/s from the store into training tensors (collector state → rows → padded tensors).

Writes a synthetic store of agent episodes as the sidecar stores them (bench/collector_generate.py), assembles it
once with the collector (its own benchmark covers that), then times what the trainer does per batch: read the
collector's segments, turn them into rows, pad them into veRL's layout.

    .venv/bin/python -m bench.trainer_reading --segments 10000 --batch 256
"""

import argparse
import tempfile
import time

from bench.collector_generate import write_bench_store
from collector.collect import Collector, trainable
from trainer.batch import padded, rows_from_segments


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--segments", type=int, default=10_000, help="About this many segments (one per episode).")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--batch", type=int, default=256, help="Segments per padded batch.")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        write_bench_store(tmp, calls=args.segments * args.turns, episodes=args.segments,
                          prompt_tokens=args.prompt_tokens, compaction_every=10**9)  # fmt: skip
        collector = Collector(tmp, progress=False, idle_seconds=0)
        started = time.perf_counter()
        collection = collector.update()
        assembled = time.perf_counter() - started
        started = time.perf_counter()
        segments = Collector(tmp, progress=False, idle_seconds=0).update().segments  # the state, nothing new
        loaded = time.perf_counter() - started
        started = time.perf_counter()
        tokens = 0
        for lo in range(0, segments.num_rows, args.batch):
            batch = rows_from_segments(segments.slice(lo, args.batch))
            if batch.rows:
                tensors = padded(batch.rows)
                tokens += int(tensors["attention_mask"].sum())
        converted = time.perf_counter() - started
        n = segments.num_rows
        print(f"{n} segments ({len(trainable(collection.segments))} complete), {tokens} tokens; "
              f"collector assembly (once) {assembled:.1f} s")  # fmt: skip
        print(f"collector state -> segments table: {loaded:.2f} s ({n / loaded:.0f} segments/s)")
        print(f"segments -> rows -> padded tensors: {converted:.2f} s ({n / converted:.0f} segments/s, "
              f"{tokens / converted / 1e6:.2f} M tokens/s)")  # fmt: skip
        print(f"store -> tensors: {n / (loaded + converted):.0f} segments/s")


if __name__ == "__main__":
    main()
