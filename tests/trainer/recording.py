"""Episodes recorded from the real vLLM server, written as the sidecar writes its call records.

Each episode is one call: a token-id prompt to ``/v1/completions``, sampled (temperature 1 unless given) with the
sampled ids (``return_token_ids``) and their logprobs, recorded with the version ``/weight_info`` reports and the
sampling parameters — the fields the sidecar records for a Completions call. Rewards go to the store as
``forge reward`` writes them.
"""

import json
import math
import uuid
from dataclasses import dataclass

import httpx

from bench.collector_generate import SyntheticEpisode, write_calls, write_rewards


@dataclass
class Sample:
    prompt: list[int]
    completion: list[int]
    logprobs: list[float]
    version: str
    temperature: float = 1.0


def sample(
    client: httpx.Client, model: str, prompt: list[int], max_tokens: int, seed: int, temperature: float = 1.0
) -> Sample:
    answer = client.post("/v1/completions", json={
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, "seed": seed,
        "logprobs": 0, "return_token_ids": True,
    })  # fmt: skip
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    ids = choice["token_ids"]
    logprobs = choice["logprobs"]["token_logprobs"]
    assert ids and len(logprobs) == len(ids)
    version = client.get("/weight_info").json()["weight_version"]
    return Sample(prompt, ids, [float(x) for x in logprobs], str(version), temperature)


def record(
    store: str, samples: list[Sample], rewards: list[float], task_id: str, unknown_last: set[int] | None = None,
    run_id: str = "run-t",
) -> list[str]:  # fmt: skip
    """One episode per sample (one call each), its reward posted; ``unknown_last``: samples whose last token's
    logprob vLLM did not give (a stream's end-of-turn token), recorded as NaN and counted."""
    assert len(rewards) == len(samples)
    rows, ids = [], []
    for i, s in enumerate(samples):
        episode = SyntheticEpisode(f"ep-{task_id}-{uuid.uuid4().hex[:8]}", task_id=task_id, run_id=run_id,
                                   policy_version=s.version)  # fmt: skip
        logprobs = list(s.logprobs)
        if unknown_last and i in unknown_last:
            logprobs[-1] = math.nan
        row = episode.call(s.prompt, s.completion, logprobs=logprobs)
        row["api"] = "completions"
        row["sampling"] = json.dumps({"temperature": s.temperature})
        row["n_unknown_logprobs"] = sum(1 for x in logprobs if math.isnan(x))
        rows += episode.rows
        ids.append(episode.episode_id)
    write_calls(store, rows, name=f"sidecar-t-{uuid.uuid4().hex[:8]}", run=run_id)
    write_rewards(store, [{"episode_id": e, "reward": r} for e, r in zip(ids, rewards, strict=True)],
                  name=f"rewards-t-{uuid.uuid4().hex[:8]}", run=run_id)  # fmt: skip
    return ids
