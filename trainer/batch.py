"""The collector's segments as veRL's training rows: one row per segment, token-exact.

A segment (``collector.episode.SEGMENT_SCHEMA``) is a token sequence with a loss mask and the behaviour logprobs
of its sampled tokens. Its row: prompt = the tokens before its first trainable token, response = the rest,
``response_mask`` = the loss mask over the response, ``rollout_log_probs`` = the recorded behaviour logprobs.
Nothing is re-tokenized: the ids are the ids vLLM sampled or was prompted with. ``temperature`` (per row) = the
segment's sampling temperature: veRL computes the row's logprobs at it, the distribution the recorded (processed)
behaviour logprobs describe; a segment sampled otherwise (greedy, truncated, processors) is left out, counted.

Unknown behaviour logprobs (NaN: vLLM gives none for a Responses function call's output or a stream's
end-of-turn token; the sidecar counts them as ``n_unknown_logprobs``) stay trainable — a tool call or the end of a
turn is exactly what an agent must learn — and take the trainer's own logprob of the same weights before the
update (veRL's "bypass" choice, token by token): their importance ratio starts at 1, so they are trained on-policy,
never with a NaN, and they are counted in every step's metrics (``tokens_unknown_logprob``).

Advantages are computed per episode (one reward, one score) by veRL's estimator registry, the collector's
``group_id`` as the group index, then broadcast to every segment of the episode. Every episode with a reward counts
in its group's baseline, also one whose segments are all left out and one the trainer does not select (an error
call, a call of unknown weights: ``baseline_mates``, each counted once): an agent cannot move its siblings'
baseline, nor take its failure out of it, by making its own episode untrainable (the untrainable episode itself
still gets no update). A group whose rewards are all equal teaches nothing (every advantage 0) and is left out of
the update, counted (``zero_variance_group``), rather than diluting the token mean.
"""

import math
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import torch

from collector.episode import SEGMENT_SCHEMA
from forge.errors import ForgeError

# The segment columns a row needs; the schema module defines them, this only names the ones read.
ROW_COLUMNS = ("episode_id", "group_id", "segment", "input_ids", "loss_mask", "behaviour_logprobs", "reward",
               "policy_version_min", "policy_version_max", "temperature")  # fmt: skip
assert all(SEGMENT_SCHEMA.get_field_index(c) >= 0 for c in ROW_COLUMNS)


@dataclass
class Row:
    """One segment as a prompt/response pair."""

    episode_id: str
    group_id: str
    segment: int
    prompt: list[int]
    response: list[int]
    response_mask: list[int]
    rollout_log_probs: list[float]  # behaviour logprobs over the response: 0 off the mask, NaN where unknown
    reward: float
    policy_version: int | None  # the oldest version that served a call of the segment
    # The temperature its tokens were sampled at: the trainer's logprobs are log_softmax(logits / T), the
    # distribution the behaviour logprobs describe (collector.sampling).
    temperature: float = 1.0

    @property
    def n_unknown(self) -> int:
        return sum(1 for m, lp in zip(self.response_mask, self.rollout_log_probs, strict=True) if m and math.isnan(lp))


@dataclass
class Batch:
    """Rows ready for veRL, with what was left out and why."""

    rows: list[Row]
    skipped: dict[str, int] = field(default_factory=dict)
    # Every episode with a reward among the segments, trainable or not: (group_id, reward), the groups' baselines.
    episodes: dict[str, tuple[str, float]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def episode_ids(self) -> list[str]:
        return sorted({r.episode_id for r in self.rows})

    def skip(self, reason: str, n: int = 1) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + n

    @property
    def flat_groups(self) -> set[str]:
        """Groups of two or more episodes whose rewards are all equal: every advantage 0, nothing to learn."""
        rewards: dict[str, list[float]] = {}
        for group, reward in self.episodes.values():
            rewards.setdefault(group, []).append(reward)
        return {g for g, values in rewards.items() if len(values) > 1 and len(set(values)) == 1}

    def leave_out_flat_groups(self) -> int:
        """Leave out the rows of flat groups (counted, ``zero_variance_group``): they teach nothing and would only
        dilute the token mean. Whatever the estimator made of them: veRL's GRPO turns the float noise of equal
        rewards into advantages of ±0.03–0.06 for 6–8 episodes (their mean is not exactly their value). Returns how
        many groups were left out."""
        flat = self.flat_groups
        kept = [r for r in self.rows if r.group_id not in flat]
        if len(kept) < len(self.rows):
            self.skip("zero_variance_group", len(self.rows) - len(kept))
        self.rows = kept
        return len(flat)

    @property
    def n_trainable(self) -> int:
        return sum(sum(r.response_mask) for r in self.rows)

    @property
    def n_tokens(self) -> int:
        return sum(len(r.prompt) + len(r.response) for r in self.rows)


def counted(counts: dict[str, int], unit: str = "") -> str:
    """Counts by reason as words: {"zero_variance_group": 2} → "2 zero variance group" ("2 segments …" with a unit)."""
    return ", ".join(f"{n} {unit + ' ' if unit else ''}{reason.replace('_', ' ')}" for reason, n in counts.items())


def parse_version(version: str | None) -> int | None:
    """Policy versions are recorded as strings ("3", "v3"); the trainer publishes integers."""
    if version is None:
        return None
    text = version[1:] if version[:1] in ("v", "V") else version
    return int(text) if text.isdigit() else None


def rows_from_segments(segments: pa.Table, baseline: dict[str, tuple[str, float]] | None = None) -> Batch:
    """Segments (any subset of the collector's rows) → rows; segments with nothing trainable are skipped, counted.
    ``baseline``: episodes not among the segments that count in their groups' baselines all the same
    (``baseline_mates``)."""
    missing = [c for c in ROW_COLUMNS if c not in segments.column_names]
    if missing:
        raise ForgeError(f"the segments lack the columns {missing}: they do not come from this collector version")
    batch = Batch(rows=[], episodes=dict(baseline or {}))
    for seg in segments.select(list(ROW_COLUMNS)).to_pylist():
        if not seg["episode_id"]:
            batch.skip("no_episode_id")
            continue
        if seg["reward"] is None or not math.isfinite(seg["reward"]):
            batch.skip("no_reward")
            continue
        batch.episodes.setdefault(seg["episode_id"], (seg["group_id"], float(seg["reward"])))
        mask = seg["loss_mask"]
        first = next((i for i, m in enumerate(mask) if m), None)
        if first is None:
            batch.skip("nothing_trainable")
            continue
        if first == 0:  # veRL needs a prompt of at least one token (a response is scored from the token before)
            batch.skip("no_prompt")
            continue
        if seg["temperature"] is None:  # greedy, truncated (top_p, top_k, ...), processors or mixed temperatures
            batch.skip("sampling_not_modelled")
            continue
        ids, logprobs = seg["input_ids"], seg["behaviour_logprobs"]
        batch.rows.append(
            Row(
                episode_id=seg["episode_id"], group_id=seg["group_id"], segment=seg["segment"],
                prompt=list(ids[:first]), response=list(ids[first:]), response_mask=[int(m) for m in mask[first:]],
                rollout_log_probs=[float("nan") if lp is None else float(lp) for lp in logprobs[first:]],
                reward=float(seg["reward"]), policy_version=parse_version(seg["policy_version_min"]),
                temperature=float(seg["temperature"]),
            )
        )  # fmt: skip
    return batch


def baseline_mates(
    episodes: pa.Table, chosen: list[str], exclude: set[str] | frozenset[str] = frozenset()
) -> dict[str, tuple[str, float]]:
    """The episodes that count in the baselines of the chosen episodes' groups without being chosen: every finished
    episode with a finite reward in such a group, whatever its status (an error call, weights unknown), and one
    whose calls' weights are all unknown (its group id then has no version) when exactly one chosen group is of its
    run and task. Maps each to (the chosen group, its reward). ``exclude``: episodes consumed already (a mate is
    consumed with the step that counts it, so it counts in one baseline only)."""
    rows = episodes.select(["episode_id", "group_id", "run_id", "task_id", "status", "reward",
                            "policy_version_min"]).to_pylist()  # fmt: skip
    picked = set(chosen)
    groups = {r["group_id"] for r in rows if r["episode_id"] in picked}
    by_task: dict[tuple[str, str], set[str]] = {}
    for r in rows:
        if r["episode_id"] in picked and r["task_id"]:
            by_task.setdefault((r["run_id"], r["task_id"]), set()).add(r["group_id"])
    mates: dict[str, tuple[str, float]] = {}
    for r in rows:
        if r["episode_id"] in picked or r["episode_id"] in exclude or r["status"] == "unfinished":
            continue
        if r["reward"] is None or not math.isfinite(r["reward"]):
            continue
        group = r["group_id"] if r["group_id"] in groups else None
        if group is None and r["policy_version_min"] is None:
            candidates = by_task.get((r["run_id"], r["task_id"]), set())
            group = next(iter(candidates)) if len(candidates) == 1 else None
        if group is not None:
            mates[r["episode_id"]] = (group, float(r["reward"]))
    return mates


def episode_advantages(
    episodes: dict[str, tuple[str, float]], estimator: str, norm_by_std: bool = True
) -> dict[str, float]:
    """One advantage per episode from veRL's registered estimator (GRPO, RLOO, ...), grouped by ``group_id``:
    ``episodes`` maps each episode to (group_id, reward) (``Batch.episodes``: also those left out)."""
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn

    ids = sorted(episodes)
    scores = torch.tensor([[episodes[e][1]] for e in ids], dtype=torch.float32)
    index = np.array([episodes[e][0] for e in ids], dtype=object)
    try:
        fn = get_adv_estimator_fn(estimator)
    except ValueError as error:
        raise ForgeError(f"unknown --algo {estimator!r}: {error}") from error
    kwargs = {"norm_adv_by_std_in_grpo": norm_by_std} if estimator == "grpo" else {}
    advantages, _ = fn(token_level_rewards=scores, response_mask=torch.ones_like(scores), index=index, **kwargs)
    return {e: float(a) for e, a in zip(ids, advantages[:, 0].tolist(), strict=True)}


def padded(rows: list[Row]) -> dict[str, torch.Tensor]:
    """veRL's left/right padded layout: prompts left-padded, responses right-padded, one attention mask."""
    n = len(rows)
    p_len = max(len(r.prompt) for r in rows)
    r_len = max(len(r.response) for r in rows)
    prompts = torch.zeros(n, p_len, dtype=torch.long)
    responses = torch.zeros(n, r_len, dtype=torch.long)
    attention = torch.zeros(n, p_len + r_len, dtype=torch.long)
    response_mask = torch.zeros(n, r_len, dtype=torch.long)
    rollout = torch.zeros(n, r_len, dtype=torch.float32)
    temperature = torch.tensor([row.temperature for row in rows], dtype=torch.float32)
    for i, row in enumerate(rows):
        lp, lr = len(row.prompt), len(row.response)
        prompts[i, p_len - lp :] = torch.tensor(row.prompt)
        responses[i, :lr] = torch.tensor(row.response)
        attention[i, p_len - lp : p_len + lr] = 1
        response_mask[i, :lr] = torch.tensor(row.response_mask)
        rollout[i, :lr] = torch.tensor(row.rollout_log_probs, dtype=torch.float32)
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    return {
        "prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention, "position_ids": position_ids, "response_mask": response_mask,
        "rollout_log_probs": rollout, "temperature": temperature,
    }  # fmt: skip
