"""Publish seconds: from the end of an update to a verified new version being served, split into checkpoint
write, load (pause, reload or adapter unload+load, prefix-cache reset, version, resume) and verification (the
server's probe; the trainer's probe of the new weights runs beside the load, and "verify" is only what is left of it).

Starts its own vLLM server (fp32 SmolLM2 on CPU) unless --policy-url names one whose weights it may change.

    .venv/bin/python bench/trainer_publish.py --publishes 3 [--lora-rank 8]
"""

import argparse
import os
import statistics
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from trainer.loop import Trainer, TrainSettings
from trainer.serve import PolicyServer, default_checkpoint, free_port


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
    parser.add_argument("--policy-url")
    parser.add_argument("--update", action="store_true", help="One update before each publish (weights move).")
    args = parser.parse_args()
    with ExitStack() as stack, tempfile.TemporaryDirectory() as store:
        url = args.policy_url
        if not url:
            server = PolicyServer(model=default_checkpoint(), port=free_port(), max_model_len=2048,
                                  run_dir=Path(store) / "vllm")  # fmt: skip
            stack.enter_context(server)
            url = server.base_url
        trainer = Trainer(TrainSettings(store=store, policy_url=url, run="bench", lora_rank=args.lora_rank))
        trainer.engine  # noqa: B018 — built (and v0 verified) before timing
        seconds: dict[str, list[float]] = {"write": [], "load": [], "verify": []}
        for version in range(1, args.publishes + 1):
            if args.update:
                nudge(trainer.engine)
            started = time.perf_counter()
            result = trainer.publish(version)
            total = time.perf_counter() - started
            for key, value in result.seconds.items():
                seconds[key].append(value)
            split = ", ".join(f"{k} {v:.2f}" for k, v in trainer.last_verify_split.items())
            print(f"v{version}: {total:.2f} s ({', '.join(f'{k} {v:.2f}' for k, v in result.seconds.items())}; "
                  f"verify = {split}); probe |server - trainer| {result.probe_diff:.1e} "
                  f"(its answer before the load {result.probe_diff_old:.1e})")  # fmt: skip
        kind = f"LoRA r={args.lora_rank} adapter" if args.lora_rank else "full weights (fp32, 135M params)"
        medians = {k: statistics.median(v) for k, v in seconds.items()}
        print(f"load average during the run: {' '.join(f'{x:.2f}' for x in os.getloadavg())} (1/5/15 min)")
        print(
            f"publish, {kind}: median {sum(medians.values()):.2f} s = "
            + " + ".join(f"{k} {v:.2f}" for k, v in medians.items())
        )


if __name__ == "__main__":
    main()
