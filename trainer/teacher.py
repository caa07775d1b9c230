"""Teacher forcing of recorded calls under a named checkpoint: the proof that a version served a call.

A record says which version sampled its tokens; that is a label. The behaviour behind it: the recorded completion's
logprobs, recomputed by transformers (fp32, CPU) under that version's checkpoint, equal the recorded ones (within the
fp32 bound) and differ from those under the previous version. A checkpoint is an HF folder (full weights) or a LoRA
adapter folder (``adapter_config.json``) on top of the base checkpoint.
"""

import math
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch


@lru_cache(maxsize=4)
def load(checkpoint: str, base: str) -> Any:
    from transformers import AutoModelForCausalLM

    folder = Path(checkpoint)
    if (folder / "adapter_config.json").is_file():
        from peft import PeftModel

        base_model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager")
        return PeftModel.from_pretrained(base_model, str(folder)).eval()
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="eager").eval()


def logprobs(checkpoint: Path, base: Path, prompt: list[int], completion: list[int], temperature: float = 1.0
             ) -> list[float]:  # fmt: skip
    """log p(completion[i] | prompt + completion[:i]) under the checkpoint, at the given temperature."""
    model = load(str(checkpoint), str(base))
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    picked = torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]
    return [float(x) for x in picked]


def mean_abs_gap(recorded: list[float], forced: list[float]) -> float:
    pairs = [(a, b) for a, b in zip(recorded, forced, strict=True) if math.isfinite(a)]
    return sum(abs(a - b) for a, b in pairs) / max(1, len(pairs))
