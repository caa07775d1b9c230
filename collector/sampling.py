"""Which distribution a call's tokens were drawn from, from its recorded sampling parameters (the call record's
``sampling``: the JSON of what the sidecar sent upstream, ``sidecar.record.SAMPLING_KEYS``).

The policy server (``forge serve``: ``--logprobs-mode processed_logprobs``) returns the logprob of each sampled
token under the distribution it was drawn from: after temperature, penalties, logits processors and top-k/top-p/
min-p truncation. The trainer computes ``log_softmax(logits / T)`` (veRL, per sample): the same distribution exactly
when the call was sampled at a plain temperature T > 0 with nothing else shaping it. Anything else is not modelled
and says so (the trainer leaves such segments out, counted).
"""

import json
import math

from sidecar.record import SAMPLING_KEYS

# A parameter at its neutral value does not shape the distribution (vLLM's defaults; top_k 0 and -1 both mean off).
NEUTRAL: dict[str, tuple[object, ...]] = {
    "top_p": (1, 1.0), "top_k": (0, -1), "min_p": (0, 0.0), "repetition_penalty": (1, 1.0),
    "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "min_tokens": (0,), "allowed_token_ids": (None, ()),
    "logit_bias": (None,), "bad_words": (None, ()),
}  # fmt: skip
assert set(NEUTRAL) == set(SAMPLING_KEYS) - {"temperature"}, "every recorded parameter has its neutral value here"
DEFAULT_TEMPERATURE = 1.0  # vLLM's, for a request that sends none (SmolLM2's generation config sets none)
GREEDY_BELOW = 1e-5  # vLLM samples greedily under this temperature (its _SAMPLING_EPS)


def plain_temperature(sampling: str | None) -> float | None:
    """The temperature a call was sampled at when that alone shaped its distribution (1 where none was sent, and
    for records from before the column); None when the trainer cannot compute it (greedy, truncation, processors,
    a value it cannot read)."""
    if sampling is None:
        return DEFAULT_TEMPERATURE
    try:
        params = json.loads(sampling)
        if not isinstance(params, dict):
            return None
        for key, value in params.items():
            if key == "temperature":
                continue
            neutral = NEUTRAL.get(key)
            if neutral is None:
                return None  # a parameter this module does not know: not claimed to be modelled
            if isinstance(value, list | dict) and not value:
                value = None if isinstance(value, dict) else ()
            if value not in neutral:
                return None
        temperature = params.get("temperature", DEFAULT_TEMPERATURE)
        if temperature is None:
            temperature = DEFAULT_TEMPERATURE
        if isinstance(temperature, bool) or not isinstance(temperature, int | float):
            return None
        temperature = float(temperature)
    except (ValueError, TypeError):
        return None
    return temperature if math.isfinite(temperature) and temperature >= GREEDY_BELOW else None
