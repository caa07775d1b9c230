"""Episode assembly: an episode's call records, in order, merged into segments (see ``collector.episode``).

The decision whether a call continues a segment needs no token comparison: the sidecar records which earlier
call a prompt extends (``parent_call_id``) and by how many of its tokens (``prefix_len``). A call continues
segment S exactly when its parent is S's last call and ``prefix_len`` is the parent's whole prompt + completion.
Only when that fails (no parent recorded, a parent the sidecar's index had no room for, a partial prefix) are
ids compared, against the end of every open segment, so interleaved sub-agents join the segment they extend.
A prompt identical to an earlier one (a retry) starts its own segment, never merged twice.

Tokens are touched once, at the end: every segment is a list of pieces (ranges of the calls' stored suffix and
completion ids with their mask), gathered for all segments at once with numpy.
"""

import gc
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from collector.episode import (
    EPISODE_SCHEMA,
    SCHEMA_VERSION,
    SEGMENT_SCHEMA,
    Episode,
    EpisodeFacts,
    SegmentHeader,
)
from collector.sampling import plain_temperature

CALL_COLUMNS = [
    "call_id", "episode_id", "task_id", "run_id", "seq", "policy_version", "started_at", "finished_at", "status",
    "error", "parent_call_id", "prefix_len", "prompt_suffix_ids", "prompt_len", "completion_token_ids",
    "completion_logprobs", "harness",
]  # fmt: skip
# Columns newer records have and older ones lack: read where present.
OPTIONAL_CALL_COLUMNS = ["policy_version_end", "sampling"]
REWARD_COLUMNS = ["episode_id", "call_id", "reward", "at"]
NO_EPISODE_ID = "(no episode id)"
MAX_DETAILS = 3  # status_detail names the first few problems of an episode and counts the rest

SUFFIX, COMPLETION = 0, 1  # where a piece's ids live
_LIST_COLUMNS = ("prompt_suffix_ids", "completion_token_ids", "completion_logprobs")


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The concatenation of arange(start, start + length) for every (start, length), in one cumulative sum."""
    keep = lengths > 0
    starts, lengths = starts[keep].astype(np.int64), lengths[keep].astype(np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    dtype = np.int32 if total < 2**31 and int((starts + lengths).max()) < 2**31 else np.int64  # half the bytes
    steps = np.ones(total, dtype=dtype)
    steps[0] = starts[0]
    run_starts = np.cumsum(lengths)[:-1]
    steps[run_starts] = starts[1:] - (starts[:-1] + lengths[:-1]) + 1  # jump from one range's end to the next
    return np.cumsum(steps, out=steps)


def _version_key(version: str) -> tuple[int, int, str]:
    return (0, int(version), "") if version.isdigit() else (1, 0, version)


@dataclass
class _Flat:
    """One list<...> column as its child values plus per-row start and length (null lists are empty)."""

    values: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray

    @classmethod
    def of(cls, column: pa.ChunkedArray, dtype: type, order: np.ndarray) -> "_Flat":
        """Row i of the result is row order[i] of the column."""
        array = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
        lengths = pc.fill_null(pc.list_value_length(array), 0).to_numpy().astype(np.int64)
        starts = array.offsets.to_numpy()[:-1].astype(np.int64)
        values = array.values.to_numpy(zero_copy_only=False).astype(dtype, copy=False)
        return cls(values, starts[order], lengths[order])


@dataclass
class _Call:
    segment: int
    prompt_len: int
    full_len: int  # prompt + completion
    prompt_key: object
    full_key: object


@dataclass
class _Segment:
    reason: str
    fork_call_id: str | None
    shared_prefix_len: int
    pieces: list[tuple[int, int, int, int]] = field(default_factory=list)  # (source, start, length, mask)
    length: int = 0
    last_call: str | None = None
    call_rows: list[int] = field(default_factory=list)
    prompt_ends: list[int] = field(default_factory=list)
    completion_ends: list[int] = field(default_factory=list)
    cached: np.ndarray | None = None  # materialised ids, valid while len(cached) == length

    def add(self, source: int, start: int, length: int, mask: int) -> None:
        if length:
            self.pieces.append((source, start, length, mask))
            self.length += length


def _tail(pieces: list[tuple[int, int, int, int]], n: int) -> list[tuple[int, int, int, int]]:
    """The pieces past the first n ids."""
    out = []
    for source, start, length, mask in pieces:
        if n >= length:
            n -= length
            continue
        out.append((source, start + n, length - n, mask))
        n = 0
    return out


def _head(pieces: list[tuple[int, int, int, int]], n: int) -> list[tuple[int, int, int, int]]:
    """The pieces of a segment's first n ids, as context (mask 0)."""
    out = []
    for source, start, length, _ in pieces:
        if n <= 0:
            break
        take = min(length, n)
        out.append((source, start, take, 0))
        n -= take
    return out


class _Episode:
    """The assembly state of one episode."""

    def __init__(self, suffix: _Flat, completion: _Flat, row_call_ids: list[str]) -> None:
        self.suffix, self.completion, self.row_call_ids = suffix, completion, row_call_ids
        self.segments: list[_Segment] = []
        self.calls: dict[str, _Call] = {}
        self.prompts: dict[object, str] = {}  # prompt key -> first call with that prompt
        self.details: list[str] = []  # the first MAX_DETAILS problems, worded; the rest only counted
        self.n_problems = self.n_merged = self.n_retries = 0

    def problem(self, text: str) -> None:
        """An episode's memory does not grow with its problems: a few are worded, the rest counted."""
        self.n_problems += 1
        if len(self.details) < MAX_DETAILS:
            self.details.append(text)

    def ids(self, pieces: Iterable[tuple[int, int, int, int]]) -> np.ndarray:
        flats = (self.suffix.values, self.completion.values)
        parts = [flats[source][start : start + length] for source, start, length, _ in pieces]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)

    def segment_ids(self, index: int) -> np.ndarray:
        segment = self.segments[index]
        if segment.cached is None or len(segment.cached) != segment.length:
            segment.cached = self.ids(segment.pieces)
        return segment.cached

    def extended_segment(self, prompt: np.ndarray) -> int | None:
        """The segment whose whole sequence the prompt starts with (the longest, then the latest), or None."""
        best: int | None = None
        for index in range(len(self.segments) - 1, -1, -1):
            length = self.segments[index].length
            if length > len(prompt) or (best is not None and length <= self.segments[best].length):
                continue
            if np.array_equal(self.segment_ids(index), prompt[:length]):
                best = index
        return best

    def shared_prefix(self, prompt: np.ndarray) -> tuple[str | None, int]:
        """For a prompt with no recorded parent: the earlier call it shares the most leading ids with."""
        best: tuple[str | None, int] = (None, 0)
        for segment_index, segment in enumerate(self.segments):
            ids = self.segment_ids(segment_index)
            n = min(len(ids), len(prompt))
            differ = np.flatnonzero(ids[:n] != prompt[:n])
            shared = int(differ[0]) if len(differ) else n
            if shared > best[1]:
                ends = segment.completion_ends
                at = next((i for i, end in enumerate(ends) if end >= shared), len(ends) - 1)
                best = (self.call_id_of(segment_index, at), shared)
        return best

    def call_id_of(self, segment: int, position: int) -> str | None:
        rows = self.segments[segment].call_rows
        return self.row_call_ids[rows[position]] if rows else None

    def prompt_pieces(
        self, parent: _Call | None, prefix_len: int, suffix_piece: tuple[int, int, int, int]
    ) -> list[tuple[int, int, int, int]]:
        """A call's whole prompt as pieces: the parent's first prefix_len ids (as context), then its suffix."""
        head = _head(self.segments[parent.segment].pieces, prefix_len) if parent is not None else []
        return [*head, suffix_piece]


def assemble(
    calls: pa.Table, rewards: pa.Table | None = None, episode_order: pa.Array | None = None
) -> tuple[pa.Table, pa.Table]:
    """Call records (``CALL_COLUMNS``) and reward records to (segments, episodes) tables, in episode id order or,
    given ``episode_order`` (an integer per call row, equal for the calls of one episode), in that order.

    Statuses are complete / error / no_reward here; ``finalize`` turns recent no_reward episodes into
    unfinished ones (that depends on the whole store, so it runs after an incremental update too).
    """
    # Assembly makes many small objects and no reference cycles: the cyclic GC would rescan them again and again
    # (40% of the time at 100k calls).
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _assemble(calls, rewards, episode_order)
    finally:
        if was_enabled:
            gc.enable()


def _assemble(calls: pa.Table, rewards: pa.Table | None, episode_order: pa.Array | None) -> tuple[pa.Table, pa.Table]:
    optional = [c for c in OPTIONAL_CALL_COLUMNS if c in calls.column_names]
    calls = calls.select(CALL_COLUMNS + optional)
    calls = calls.set_column(
        calls.schema.get_field_index("episode_id"), "episode_id", pc.fill_null(calls["episode_id"], NO_EPISODE_ID)
    )
    n = calls.num_rows
    if n == 0:
        return SEGMENT_SCHEMA.empty_table(), EPISODE_SCHEMA.empty_table()
    # Sorted by a permutation: the scalar columns are taken in order, the id lists only index through it.
    keys = [("episode_id", "ascending"), ("seq", "ascending"), ("started_at", "ascending"), ("call_id", "ascending")]
    sort_by = calls.select([k for k, _ in keys])
    if episode_order is not None:
        keys.insert(0, ("episode_order", "ascending"))
        sort_by = sort_by.append_column("episode_order", episode_order)
    order = pc.sort_indices(sort_by, sort_keys=keys).to_numpy()
    suffix = _Flat.of(calls["prompt_suffix_ids"], np.int32, order)
    completion = _Flat.of(calls["completion_token_ids"], np.int32, order)
    logprobs = _Flat.of(calls["completion_logprobs"], np.float32, order)
    has_suffix = calls["prompt_suffix_ids"].is_valid().to_numpy(zero_copy_only=False)[order]
    calls = calls.drop_columns(list(_LIST_COLUMNS)).take(pa.array(order))

    names = ("call_id", "episode_id", "parent_call_id", "status", "error", "policy_version", "task_id", "run_id",
             "harness")  # fmt: skip
    column = {name: calls[name].to_pylist() for name in names}
    # A call's versions: the one asked before it was sent and, where recorded, the one as it ended (a call that
    # straddles a publish has two).
    ends = calls["policy_version_end"].to_pylist() if "policy_version_end" in optional else [None] * calls.num_rows
    row_versions = [{v for v in pair if v is not None} for pair in zip(column["policy_version"], ends, strict=True)]
    # The temperature each call's distribution is log_softmax(logits / T) at, None where it is not (collector.sampling).
    samplings = calls["sampling"].to_pylist() if "sampling" in optional else [None] * calls.num_rows
    temperatures = [plain_temperature(s) for s in samplings]
    call_ids, episode_ids = column["call_id"], column["episode_id"]
    parents, statuses = column["parent_call_id"], column["status"]
    seqs = pc.fill_null(calls["seq"], -1).to_numpy().tolist()
    prefix_lens = pc.fill_null(calls["prefix_len"], 0).to_numpy().tolist()
    prompt_lens = calls["prompt_len"].to_pylist()
    started = pc.cast(calls["started_at"], pa.int64()).to_pylist()
    finished = pc.cast(calls["finished_at"], pa.int64()).to_pylist()

    # Logprobs aligned with the completion ids. A call the upstream gave no logprobs for (the record's note says
    # so) gets NaN: unknown, not wrong. A call whose logprob count differs otherwise gets NaN and an error.
    aligned_lp = np.full(len(completion.values), np.nan, dtype=np.float32)
    lp_given = logprobs.lengths == completion.lengths
    lp_ok = lp_given | (logprobs.lengths == 0)
    if lp_given.any():
        aligned_lp[_ranges(completion.starts[lp_given], completion.lengths[lp_given])] = logprobs.values[
            _ranges(logprobs.starts[lp_given], logprobs.lengths[lp_given])
        ]
    # Per call: completion tokens whose behaviour logprob is unknown (NaN: counted, the trainer decides) or
    # infinite (-inf from a null upstream logprob: never trained on, the episode is an error).
    n_unknown = _count_per_call(np.isnan(aligned_lp), completion)
    n_infinite = _count_per_call(np.isinf(aligned_lp), completion)

    reward_of, call_reward_of = _rewards(rewards)

    segment_rows: list[SegmentHeader] = []
    segment_pieces: list[list[tuple[int, int, int, int]]] = []
    episode_rows: list[Episode] = []
    bounds = np.flatnonzero(np.array(episode_ids[1:], dtype=object) != np.array(episode_ids[:-1], dtype=object)) + 1
    for lo, hi in zip([0, *bounds.tolist()], [*bounds.tolist(), n], strict=True):
        if lo >= hi:
            continue
        episode = _Episode(suffix, completion, call_ids)
        counts = {"without_ids": 0, "truncated": 0, "errors": 0}
        for row in range(lo, hi):
            _assemble_call(episode, row, call_ids, parents, statuses, column["error"], seqs, prefix_lens,
                           prompt_lens, has_suffix, lp_ok, n_infinite, counts)  # fmt: skip
        episode_id = episode_ids[lo]
        rows = range(lo, hi)
        task_id = next((column["task_id"][r] for r in rows if column["task_id"][r]), None)
        run_id = next((column["run_id"][r] for r in rows if column["run_id"][r]), None)
        harness = next((column["harness"][r] for r in rows if column["harness"][r]), None)
        versions = sorted(set().union(*(row_versions[r] for r in rows)), key=_version_key)
        reward = reward_of.get(episode_id)
        detail: str | None = None
        if episode.n_problems:
            status = "error"
            extra = episode.n_problems - len(episode.details)
            detail = "; ".join(episode.details) + (f"; and {extra} more" if extra > 0 else "")
        else:
            status = "complete" if reward is not None else "no_reward"
        version_min = versions[0] if versions else None
        episode_common: EpisodeFacts = {
            "episode_id": episode_id, "task_id": task_id, "run_id": run_id,
            "group_id": f"{run_id}/{task_id}/v{version_min}" if task_id else episode_id, "harness": harness,
            "status": status, "status_detail": detail, "reward": reward,
        }  # fmt: skip
        n_trainable_episode = n_tokens = n_unknown_episode = 0
        for index, segment in enumerate(episode.segments):
            seg_versions = sorted(set().union(*(row_versions[r] for r in segment.call_rows)), key=_version_key)
            n_trainable = sum(length for _, _, length, mask in segment.pieces if mask)
            n_trainable_episode += n_trainable
            n_tokens += segment.length
            # Every sampled token is trainable in exactly one segment: its call's whole completion.
            n_unknown_segment = int(sum(n_unknown[r] for r in segment.call_rows))
            n_unknown_episode += n_unknown_segment
            seg_temperatures = {temperatures[r] for r in segment.call_rows}
            segment_rows.append({
                **episode_common, "segment": index,
                "policy_version_min": seg_versions[0] if seg_versions else None,
                "policy_version_max": seg_versions[-1] if seg_versions else None,
                "mixed_versions": len(seg_versions) > 1, "n_calls": len(segment.call_rows),
                "n_trainable": n_trainable, "n_unknown_logprobs": n_unknown_segment,
                "temperature": seg_temperatures.pop() if len(seg_temperatures) == 1 else None,
                "fork_reason": segment.reason, "fork_call_id": segment.fork_call_id,
                "shared_prefix_len": segment.shared_prefix_len,
                "call_ids": [call_ids[r] for r in segment.call_rows],
                "call_seqs": [seqs[r] for r in segment.call_rows],
                "call_prompt_ends": segment.prompt_ends, "call_completion_ends": segment.completion_ends,
                "call_statuses": [statuses[r] for r in segment.call_rows],
                "call_rewards": [call_reward_of.get(call_ids[r]) for r in segment.call_rows],
                "started_at": _min(started[r] for r in segment.call_rows),
                "finished_at": _max(finished[r] for r in segment.call_rows),
            })  # fmt: skip
            segment_pieces.append(segment.pieces)
        episode_rows.append({
            **episode_common, "n_calls": hi - lo, "n_segments": len(episode.segments), "n_merged": episode.n_merged,
            "n_forked": max(len(episode.segments) - 1, 0), "n_retries": episode.n_retries,
            "n_calls_without_ids": counts["without_ids"], "n_truncated": counts["truncated"],
            "n_call_errors": counts["errors"], "n_tokens": n_tokens, "n_trainable": n_trainable_episode,
            "n_unknown_logprobs": n_unknown_episode,
            "n_version_unknown": sum(1 for r in rows if statuses[r] == "ok" and not row_versions[r]),
            "policy_version_min": version_min, "policy_version_max": versions[-1] if versions else None,
            "mixed_versions": len(versions) > 1, "started_at": _min(started[r] for r in rows),
            "finished_at": _max(finished[r] for r in rows),
        })  # fmt: skip

    segments = _segments_table(segment_rows, segment_pieces, suffix, completion, aligned_lp)
    episodes = pa.Table.from_pylist(
        [{"schema_version": SCHEMA_VERSION, **e} for e in episode_rows], schema=EPISODE_SCHEMA
    )
    return segments, episodes


def _assemble_call(
    episode: _Episode, row: int, call_ids: list, parents: list, statuses: list, errors: list, seqs: list,
    prefix_lens: list, prompt_lens: list, has_suffix: np.ndarray, lp_ok: np.ndarray, n_infinite: np.ndarray,
    counts: dict[str, int],
) -> None:  # fmt: skip
    call_id, parent, status = call_ids[row], parents[row], statuses[row]
    where = f"call {call_id} (seq {seqs[row]})"
    if status != "ok":
        counts["truncated" if status == "truncated" else "errors"] += 1
        episode.problem(f"{where} {status}" + (f": {errors[row]}" if errors[row] else ""))
    if prompt_lens[row] is None or not has_suffix[row]:
        counts["without_ids"] += 1
        episode.problem(f"{where} has no token ids")
        return
    suffix, completion = episode.suffix, episode.completion
    s_start, s_len = int(suffix.starts[row]), int(suffix.lengths[row])
    c_start, c_len = int(completion.starts[row]), int(completion.lengths[row])
    prefix_len = prefix_lens[row] if parent is not None else 0
    if not lp_ok[row]:
        episode.problem(f"{where}: completion_logprobs do not match completion_token_ids")
    elif n_infinite[row]:
        episode.problem(f"{where}: {n_infinite[row]} completion logprobs are infinite (-inf): not trainable")
    if prefix_len + s_len != prompt_lens[row]:
        episode.problem(f"{where}: prefix_len + suffix != prompt_len")

    suffix_hash = hash(suffix.values[s_start : s_start + s_len].tobytes())
    parent_call = episode.calls.get(parent) if parent is not None else None
    if parent is not None and (parent_call is None or prefix_len > parent_call.full_len):
        episode.problem(f"{where}: its parent call {parent} is not in the store")
        return
    if parent_call is None:
        prompt_key: object = ("prompt", suffix_hash)
    else:
        if prefix_len == parent_call.full_len:
            base = parent_call.full_key
        elif prefix_len == parent_call.prompt_len:
            base = parent_call.prompt_key
        else:
            base = ("cut", parent, prefix_len)
        prompt_key = base if s_len == 0 else hash((base, suffix_hash))
    full_key = hash((prompt_key, hash(completion.values[c_start : c_start + c_len].tobytes())))

    suffix_piece = (SUFFIX, s_start, s_len, 0)
    target: int | None = None
    context: list[tuple[int, int, int, int]] = []
    prompt_pieces: list[tuple[int, int, int, int]] | None = None
    retry_of = episode.prompts.get(prompt_key)
    if retry_of is None:
        episode.prompts[prompt_key] = call_id
        if (
            parent_call is not None
            and prefix_len == parent_call.full_len
            and episode.segments[parent_call.segment].last_call == parent
        ):
            target, context = parent_call.segment, [suffix_piece]  # the fast path: no ids compared
        elif episode.segments:  # compare ids with the end of every segment (sub-agents, unparented records)
            prompt_pieces = episode.prompt_pieces(parent_call, prefix_len, suffix_piece)
            target = episode.extended_segment(episode.ids(prompt_pieces))
            if target is not None:
                context = _tail(prompt_pieces, episode.segments[target].length)
    else:
        episode.n_retries += 1
    if target is None:
        if prompt_pieces is None:
            prompt_pieces = episode.prompt_pieces(parent_call, prefix_len, suffix_piece)
        if not episode.segments:
            reason, fork_call, shared = "start", None, 0
        elif retry_of is not None:
            reason, fork_call, shared = "retry", retry_of, prefix_len + s_len
        elif parent_call is not None:
            reason, fork_call, shared = "diverged", parent, prefix_len
        else:
            fork_call, shared = episode.shared_prefix(episode.ids(prompt_pieces))
            reason = "diverged" if shared else "unrelated"
        episode.segments.append(_Segment(reason, fork_call, shared))
        target, context = len(episode.segments) - 1, prompt_pieces
    else:
        episode.n_merged += 1
    segment = episode.segments[target]
    for piece in context:
        segment.add(*piece)
    segment.prompt_ends.append(segment.length)
    segment.add(COMPLETION, c_start, c_len, 1)
    segment.completion_ends.append(segment.length)
    segment.last_call = call_id
    segment.call_rows.append(row)
    episode.calls[call_id] = _Call(target, prompt_lens[row], prompt_lens[row] + c_len, prompt_key, full_key)


def _rewards(rewards: pa.Table | None) -> tuple[dict[str, float], dict[str, float]]:
    """The latest reward per episode (rows without a call id) and per call."""
    if rewards is None or rewards.num_rows == 0:
        return {}, {}
    rewards = rewards.select(REWARD_COLUMNS).sort_by([("at", "ascending")])
    episode_reward: dict[str, float] = {}
    call_reward: dict[str, float] = {}
    for episode_id, call_id, reward in zip(
        rewards["episode_id"].to_pylist(), rewards["call_id"].to_pylist(), rewards["reward"].to_pylist(), strict=True
    ):
        if call_id is None:
            episode_reward[episode_id] = reward
        else:
            call_reward[call_id] = reward
    return episode_reward, call_reward


def _count_per_call(flags: np.ndarray, completion: _Flat) -> np.ndarray:
    """Per row: how many of its completion tokens are flagged."""
    total = np.concatenate([[0], np.cumsum(flags, dtype=np.int64)])
    return total[completion.starts + completion.lengths] - total[completion.starts]


def _min(values: Iterable[int | None]) -> int | None:
    return min((v for v in values if v is not None), default=None)


def _max(values: Iterable[int | None]) -> int | None:
    return max((v for v in values if v is not None), default=None)


def _segments_table(
    rows: list[SegmentHeader], pieces: list[list[tuple[int, int, int, int]]], suffix: _Flat, completion: _Flat,
    aligned_lp: np.ndarray,
) -> pa.Table:  # fmt: skip
    """Gather every segment's ids, mask and logprobs from its pieces in one pass."""
    piece_counts = np.array([len(p) for p in pieces], dtype=np.int64)
    flat = np.array([piece for segment in pieces for piece in segment], dtype=np.int64).reshape(-1, 4)
    source, start, length, mask = flat.T
    global_start = start + (source == COMPLETION) * len(suffix.values)
    all_ids = np.concatenate([suffix.values, completion.values]).astype(np.int32, copy=False)
    ids = all_ids[_ranges(global_start, length)]
    lengths_cum = np.concatenate([[0], np.cumsum(length)])
    # Mask and logprobs are written only where the mask is 1 (the completions, a small share of the tokens).
    sampled = mask == 1
    at = _ranges(lengths_cum[:-1][sampled], length[sampled])
    token_mask = np.zeros(len(ids), np.int8)
    token_mask[at] = 1
    lps = np.zeros(len(ids), np.float32)
    lps[at] = aligned_lp[_ranges(start[sampled], length[sampled])]
    piece_ends = np.cumsum(piece_counts)
    offsets = lengths_cum[np.concatenate([[0], piece_ends])].astype(np.int32)
    plain = cast(list[dict[str, Any]], rows)
    columns = {name: [row[name] for row in plain] for name in SegmentHeader.__annotations__}
    columns["schema_version"] = [SCHEMA_VERSION] * len(rows)
    offsets_array = pa.array(offsets, pa.int32())
    arrays = []
    for f in SEGMENT_SCHEMA:
        if f.name == "input_ids":
            arrays.append(pa.ListArray.from_arrays(offsets_array, pa.array(ids, pa.int32())))
        elif f.name == "loss_mask":
            arrays.append(pa.ListArray.from_arrays(offsets_array, pa.array(token_mask, pa.int8())))
        elif f.name == "behaviour_logprobs":
            arrays.append(pa.ListArray.from_arrays(offsets_array, pa.array(lps, pa.float32())))
        else:
            arrays.append(pa.array(columns[f.name], f.type))
    return pa.Table.from_arrays(arrays, schema=SEGMENT_SCHEMA)


def unfinished_episodes(episodes: pa.Table, idle_seconds: float) -> pa.Array:
    """The no_reward episodes whose last call is within ``idle_seconds`` of the store's newest call."""
    finished = pc.cast(episodes["finished_at"], pa.int64())
    newest = pc.max(finished).as_py() if episodes.num_rows else None
    if newest is None:
        return pa.array([], pa.string())
    recent = pc.greater(finished, newest - int(idle_seconds * 1e6))
    pending = pc.and_(pc.equal(episodes["status"], "no_reward"), pc.fill_null(recent, False))
    return pc.filter(episodes["episode_id"], pending)


def mark_unfinished(table: pa.Table, unfinished: pa.Array) -> pa.Table:
    """The rows (segments or episodes) of the given episodes with status ``unfinished``."""
    if len(unfinished) == 0 or table.num_rows == 0:
        return table
    hit = pc.is_in(table["episode_id"], unfinished)
    status = pc.if_else(hit, "unfinished", table["status"])
    return table.set_column(table.schema.get_field_index("status"), table.schema.field("status"), status)


def finalize(segments: pa.Table, episodes: pa.Table, idle_seconds: float) -> tuple[pa.Table, pa.Table]:
    """no_reward → unfinished for episodes whose last call is within ``idle_seconds`` of the store's newest call."""
    unfinished = unfinished_episodes(episodes, idle_seconds)
    return mark_unfinished(segments, unfinished), mark_unfinished(episodes, unfinished)
