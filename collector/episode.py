"""The episode / segment record: the hand-off from the collector to the trainer, as Arrow schemas and the typed
rows (``Segment``, ``Episode``) code and tests read and build.

An episode is the calls one rollout made, in order. Its calls are merged into segments: token sequences in
which each call's prompt is the previous call's prompt + completion + a new suffix. ``input_ids`` holds the
segment's tokens; ``loss_mask`` is 1 exactly on tokens the policy sampled in this segment's calls (their
completions) and 0 on context (prompts, and sampled tokens of earlier calls that a fork repeats);
``behaviour_logprobs`` are the sampled tokens' logprobs, 0 where the mask is 0 (NaN on sampled tokens whose
logprobs the upstream did not give; ``n_unknown_logprobs`` counts them). A call that does not extend the
segment it follows starts a new one (``fork_reason`` says why); every sampled token is trainable in exactly one
segment.

Statuses: ``complete`` (an episode reward, every call ok), ``error`` (a call truncated, errored, without ids,
with an infinite logprob on a sampled token, or referring to a call not in the store: ``status_detail`` says
which), ``unfinished`` (no reward yet and a call
within the idle window of the store's newest call), ``no_reward`` (no reward and idle for longer). Only
``complete`` episodes are trainable by default.

Group id (for GRPO): the episodes of one task in one round, ``<run_id>/<task_id>/v<policy_version_min>`` (the
policy version an episode started on is its round); an episode without a task id is its own group.

Evaluation episodes: a run id that starts with ``eval-`` (``EVALUATION_RUN_PREFIX``; `forge eval` names its runs so)
marks an evaluation's episodes. They are collected like any other (``run_id`` in ``episodes``), and no trainer ever
learns from them (``trainer.loop.select_groups`` leaves them out and counts them).
"""

from typing import TypedDict

import pyarrow as pa

SCHEMA_VERSION = 3  # 2: n_unknown_logprobs; 3: n_version_unknown

EPISODE_STATUSES = ("complete", "error", "unfinished", "no_reward")

# Why a segment starts: "start" (the episode's first call), "retry" (the same prompt as an earlier call: kept
# apart so no prompt is merged twice), "diverged" (shares a prefix with an earlier call but rewrites what
# follows: compaction, rewritten history, tool-call id rewrites, a parallel call on the same history),
# "unrelated" (shares no recorded prefix: a sub-agent with its own context).
FORK_REASONS = ("start", "retry", "diverged", "unrelated")

EVALUATION_RUN_PREFIX = "eval-"


def is_evaluation(run_id: str | None) -> bool:
    """Whether an episode of this run id belongs to an evaluation (never trained on)."""
    return run_id is not None and run_id.startswith(EVALUATION_RUN_PREFIX)


_ids = pa.list_(pa.int32())
# The columns both tables begin with: a segment repeats its episode's.
_EPISODE_HEAD = [
    pa.field("schema_version", pa.int16(), nullable=False),
    pa.field("episode_id", pa.string(), nullable=False),
    pa.field("task_id", pa.string()),
    pa.field("run_id", pa.string()),
    pa.field("group_id", pa.string(), nullable=False),
    pa.field("harness", pa.string()),
]

SEGMENT_SCHEMA = pa.schema(
    [
        *_EPISODE_HEAD,
        pa.field("segment", pa.int32(), nullable=False),  # 0, 1, ... in order of the call that started it
        pa.field("input_ids", _ids, nullable=False),
        pa.field("loss_mask", pa.list_(pa.int8()), nullable=False),
        pa.field("behaviour_logprobs", pa.list_(pa.float32()), nullable=False),
        pa.field("reward", pa.float64()),  # the episode's reward (latest one posted), null when none
        pa.field("policy_version_min", pa.string()),
        pa.field("policy_version_max", pa.string()),
        pa.field("mixed_versions", pa.bool_(), nullable=False),
        pa.field("n_calls", pa.int32(), nullable=False),  # calls merged into this segment
        pa.field("n_trainable", pa.int32(), nullable=False),  # sum of loss_mask
        # Trainable tokens whose behaviour logprob the upstream did not give (NaN): visible; the trainer decides.
        pa.field("n_unknown_logprobs", pa.int32(), nullable=False),
        # The temperature every call of the segment was sampled at (1 where the harness sent none): the behaviour
        # logprobs are vLLM's processed ones, log_softmax(logits / T), which the trainer computes at this T. Null
        # where it cannot: calls at different temperatures, greedy (0), or a truncation or logits processor
        # (top_p < 1, top_k, min_p, allowed_token_ids, logit_bias, penalties: ``collector.sampling``).
        pa.field("temperature", pa.float64()),
        pa.field("status", pa.string(), nullable=False),  # the episode's status
        pa.field("status_detail", pa.string()),
        pa.field("fork_reason", pa.string(), nullable=False),
        pa.field("fork_call_id", pa.string()),  # the earlier call this segment's prompt shares a prefix with
        pa.field("shared_prefix_len", pa.int32(), nullable=False),
        # The calls of the segment, in order: call i's new context is input_ids[prompt_ends[i-1]'s completion
        # end : call_prompt_ends[i]], its completion input_ids[call_prompt_ends[i] : call_completion_ends[i]].
        pa.field("call_ids", pa.list_(pa.string()), nullable=False),
        pa.field("call_seqs", pa.list_(pa.int32()), nullable=False),
        pa.field("call_prompt_ends", _ids, nullable=False),
        pa.field("call_completion_ends", _ids, nullable=False),
        pa.field("call_statuses", pa.list_(pa.string()), nullable=False),
        pa.field("call_rewards", pa.list_(pa.float64()), nullable=False),  # per-call rewards, null where none
        pa.field("started_at", pa.timestamp("us", tz="UTC")),
        pa.field("finished_at", pa.timestamp("us", tz="UTC")),
    ],
    metadata={"openforge.table": "segments", "openforge.schema_version": str(SCHEMA_VERSION)},
)

EPISODE_SCHEMA = pa.schema(
    [
        *_EPISODE_HEAD,
        pa.field("status", pa.string(), nullable=False),
        pa.field("status_detail", pa.string()),
        pa.field("reward", pa.float64()),
        pa.field("n_calls", pa.int32(), nullable=False),  # every call recorded for the episode
        pa.field("n_segments", pa.int32(), nullable=False),
        pa.field("n_merged", pa.int32(), nullable=False),  # calls that continued the segment they follow
        pa.field("n_forked", pa.int32(), nullable=False),  # calls after the first that started a new segment
        pa.field("n_retries", pa.int32(), nullable=False),
        pa.field("n_calls_without_ids", pa.int32(), nullable=False),
        pa.field("n_truncated", pa.int32(), nullable=False),
        pa.field("n_call_errors", pa.int32(), nullable=False),  # status upstream_error or error
        pa.field("n_tokens", pa.int64(), nullable=False),  # sum of the segments' lengths
        pa.field("n_trainable", pa.int64(), nullable=False),
        pa.field("n_unknown_logprobs", pa.int64(), nullable=False),  # the segments' sum
        # Sampled (ok) calls whose weights' version is unknown (served by another model than the policy, or the
        # version question failed: the record's note says why). The trainer never counts them as on-policy.
        pa.field("n_version_unknown", pa.int32(), nullable=False),
        pa.field("policy_version_min", pa.string()),
        pa.field("policy_version_max", pa.string()),
        pa.field("mixed_versions", pa.bool_(), nullable=False),
        pa.field("started_at", pa.timestamp("us", tz="UTC")),
        pa.field("finished_at", pa.timestamp("us", tz="UTC")),
    ],
    metadata={"openforge.table": "episodes", "openforge.schema_version": str(SCHEMA_VERSION)},
)


class EpisodeFacts(TypedDict):
    """The columns an episode and each of its segments share (a segment repeats its episode's)."""

    episode_id: str
    task_id: str | None
    run_id: str | None
    group_id: str
    harness: str | None
    status: str
    status_detail: str | None
    reward: float | None


class SegmentHeader(EpisodeFacts):
    """A segment but its token columns (``Segment`` adds them: the collector gathers those for all segments at once).
    Times are microseconds since the epoch (Arrow reads them back as datetimes)."""

    segment: int
    policy_version_min: str | None
    policy_version_max: str | None
    mixed_versions: bool
    n_calls: int
    n_trainable: int
    n_unknown_logprobs: int
    temperature: float | None
    fork_reason: str
    fork_call_id: str | None
    shared_prefix_len: int
    call_ids: list[str]
    call_seqs: list[int]
    call_prompt_ends: list[int]
    call_completion_ends: list[int]
    call_statuses: list[str]
    call_rewards: list[float | None]
    started_at: int | None
    finished_at: int | None


class Segment(SegmentHeader):
    """One row of ``SEGMENT_SCHEMA`` (the ``segments`` table), as the trainer reads it: a column each (a test keeps
    the two equal; the table adds ``schema_version``)."""

    input_ids: list[int]
    loss_mask: list[int]
    behaviour_logprobs: list[float]


class Episode(EpisodeFacts):
    """One row of ``EPISODE_SCHEMA`` (the ``episodes`` table): a column each (a test keeps the two equal; the table
    adds ``schema_version``). Times are microseconds since the epoch (Arrow reads them back as datetimes)."""

    n_calls: int
    n_segments: int
    n_merged: int
    n_forked: int
    n_retries: int
    n_calls_without_ids: int
    n_truncated: int
    n_call_errors: int
    n_tokens: int
    n_trainable: int
    n_unknown_logprobs: int
    n_version_unknown: int
    policy_version_min: str | None
    policy_version_max: str | None
    mixed_versions: bool
    started_at: int | None
    finished_at: int | None
