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
from collections.abc import Callable
from typing import Any

from sidecar.record import SAMPLING_KEYS


def _off(value: Any) -> bool:
    return value is None or value is False or value == [] or value == {} or value == ()


def _number(neutral: tuple[float, ...]) -> Callable[[Any], bool]:
    return lambda value: value is None or (not isinstance(value, bool) and value in neutral)


def _no_format(value: Any) -> bool:  # Responses ``text`` / Anthropic ``output_config``: verbosity, effort, no schema
    if _off(value):
        return True
    return isinstance(value, dict) and (_off(value.get("format")) or value.get("format") == {"type": "text"})


# A parameter at its neutral value does not shape the distribution (vLLM's defaults; top_k 0 and -1 both mean off;
# tool_choice "auto" and a text format mean no grammar). Anything else is not modelled.
NEUTRAL: dict[str, Callable[[Any], bool]] = {
    "top_p": _number((1,)), "top_k": _number((0, -1)), "min_p": _number((0,)), "repetition_penalty": _number((1,)),
    "presence_penalty": _number((0,)), "frequency_penalty": _number((0,)), "min_tokens": _number((0,)),
    "allowed_token_ids": _off, "logit_bias": _off, "bad_words": _off, "use_beam_search": _off,
    "logits_processors": _off, "vllm_xargs": _off, "thinking_token_budget": _off, "structured_outputs": _off,
    "guided_json": _off, "guided_regex": _off, "guided_choice": _off, "guided_grammar": _off,
    "response_format": lambda v: _off(v) or v == {"type": "text"},
    "tool_choice": lambda v: _off(v) or v in ("auto", "none", {"type": "auto"}, {"type": "none"}),
    "text": _no_format, "output_config": _no_format,
}  # fmt: skip
assert set(NEUTRAL) == set(SAMPLING_KEYS) - {"temperature"}, "every recorded parameter has its neutral value here"

DEFAULT_TEMPERATURE = 1.0  # vLLM's, for a request that sends none (SmolLM2's generation config sets none)
# vLLM samples greedily at 0 and raises any temperature under 0.01 to 0.01 (SamplingParams): the recorded value is
# then not the one sampled at; such calls are not modelled.
LOWEST = 0.01


def _never(value: Any) -> bool:
    return False


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
            if key != "temperature" and not NEUTRAL.get(key, _never)(value):
                return None  # shaped otherwise, or a parameter this module does not know: not modelled
        temperature = params.get("temperature", DEFAULT_TEMPERATURE)
        if temperature is None:
            temperature = DEFAULT_TEMPERATURE
        if isinstance(temperature, bool) or not isinstance(temperature, int | float):
            return None
        temperature = float(temperature)
    except (ValueError, TypeError, OverflowError, RecursionError, AttributeError):
        return None
    return temperature if math.isfinite(temperature) and temperature >= LOWEST else None
