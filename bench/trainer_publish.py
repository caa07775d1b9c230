"""Publish seconds: from the end of an update to a verified new version being served on every replica, split into
checkpoint write, load (pause every replica, reload or adapter unload+load, prefix-cache reset, version, resume every
one) and verification (each replica's probe; the trainer's probe of the new weights runs beside the load, and
"verify" is only what is left of it).

Starts its own vLLM servers (--replicas of them, fp32 SmolLM2 on CPU) unless --policy-url names replicas whose
weights it may change (a list, or dns+http://NAME:PORT). Prints each publish, then the minimum and the median total
over the publishes (the first publish is counted: each is a new version).

The publishes follow each other as fast as they can ("store" is what the store's copy took beyond the load and the
verification). ``--sync`` waits for the disk to take the last checkpoint first, as in a run, where an update (90-190 s
on this machine's demo) lies between two publishes; it matters for ``--load-dir store``, whose checkpoint write is
on the publish's path: once ~0.5 GB is dirty the kernel throttles the writer (measured: a 540 MB write 0.16 s into a
clean page cache, 0.75 s with one unwritten checkpoint before it, 1.8 s with three).

    .venv/bin/python bench/trainer_publish.py --replicas 1 --publishes 5 --update [--lora-rank 8] [--sync]
        [--load-dir store]
"""

import argparse
import os
import statistics
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from trainer.loop import Trainer, TrainSettings
from trainer.serve import PolicyServer, default_checkpoint, free_port, start_together


def nudge(engine) -> None:
    """One update on a small random batch, so each publish carries weights the server has not seen."""
    import torch

    from trainer.batch import Row, padded

    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(2):
        ids = torch.randint(100, 40000, (64,), generator=g).tolist()
        rows.append(Row(f"e{i}", "g", 0, ids[:16], ids[16:], [1] * 48, [0.0] * 48, float(i), 0))
    tensors = padded(rows)
    tensors.pop("rollout_log_probs")
    tensors["old_log_probs"], _ = engine.log_probs(tensors)
    tensors["advantages"] = torch.tensor([[1.0], [-1.0]]) * tensors["response_mask"]
    engine.update(tensors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--publishes", type=int, default=3)
    parser.add_argument("--lora-rank", type=int, default=0)
    parser.add_argument("--policy-url", help="Replicas to publish to (default: start --replicas servers here).")
    parser.add_argument("--replicas", type=int, default=1, help="vLLM servers to start (without --policy-url).")
    parser.add_argument("--update", action="store_true", help="One update before each publish (weights move).")
    parser.add_argument("--sync", action="store_true", help="Wait for the disk's write-back before each publish.")
    parser.add_argument("--load-dir", default="auto", help="The trainer's --load-dir (auto, store or a folder).")
    args = parser.parse_args()
    with ExitStack() as stack, tempfile.TemporaryDirectory() as store:
        url = args.policy_url
        if not url:
            servers = [PolicyServer(model=default_checkpoint(), port=free_port(), max_model_len=2048,
                                    run_dir=Path(store) / f"vllm-{n}") for n in range(args.replicas)]  # fmt: skip
            for server in servers:
                stack.callback(server.stop)
            start_together(servers)
            url = ",".join(server.base_url for server in servers)
        trainer = Trainer(TrainSettings(store=store, policy_url=url, run="bench", lora_rank=args.lora_rank,
                                        load_dir=args.load_dir))  # fmt: skip
        stack.callback(trainer.close)
        trainer.engine  # noqa: B018 — built (and v0 verified) before timing
        replicas = len(trainer.replicas.clients())
        seconds: dict[str, list[float]] = {}
        totals: list[float] = []
        for version in range(1, args.publishes + 1):
            if args.update:
                nudge(trainer.engine)
            if args.sync:
                os.sync()
            started = time.perf_counter()
            result = trainer.publish(version)
            total = time.perf_counter() - started
            totals.append(total)
            if result.left_out:
                print(f"v{version}: left out {result.left_out}")
            for key, value in result.seconds.items():
                seconds.setdefault(key, []).append(value)
            split = ", ".join(f"{k} {v:.2f}" for k, v in trainer.last_verify_split.items())
            split += "; load = " + ", ".join(f"{k} {v:.2f}" for k, v in trainer.replicas.last_split.items())
            print(f"v{version}: {total:.2f} s ({', '.join(f'{k} {v:.2f}' for k, v in result.seconds.items())}; "
                  f"verify = {split}); probe |server - trainer| {result.probe_diff:.1e} "
                  f"(its answer before the load {result.probe_diff_old:.1e})")  # fmt: skip
        kind = f"LoRA r={args.lora_rank} adapter" if args.lora_rank else "full weights (fp32, 135M params)"
        medians = {k: statistics.median(v) for k, v in seconds.items()}
        print(
            f"load folder: {trainer.load_folder or 'none (the store copy is loaded)'}; "
            + (
                "each publish after the last checkpoint's write-back (os.sync)"
                if args.sync
                else "publishes back to back"
            )
        )
        print(f"load average during the run: {' '.join(f'{x:.2f}' for x in os.getloadavg())} (1/5/15 min)")
        print(
            f"publish, {kind}, {replicas} replica(s): median parts {sum(medians.values()):.2f} s = "
            + " + ".join(f"{k} {v:.2f}" for k, v in medians.items())
        )
        print(f"publish total, {replicas} replica(s), {len(totals)} publishes: min {min(totals):.2f} s, "
              f"median {statistics.median(totals):.2f} s")  # fmt: skip


if __name__ == "__main__":
    main()
