"""The call record and the reward record: the hand-off from the sidecar to the collector, as Arrow schemas and
the typed rows (``CallRecord``, ``RewardRow``) code and tests build.

One row per model call. Prompts are stored linearly: when a call's prompt shares a prefix with an earlier call's
prompt + completion in the same episode, the row keeps only ``parent_call_id``, ``prefix_len`` and the ids past
the prefix (``prompt_suffix_ids``); the collector's ``calls`` view rebuilds whole ``prompt_token_ids``. A row
without a parent has ``prefix_len = 0`` and its whole prompt in ``prompt_suffix_ids``.

Everything here is stdlib + pyarrow: it runs inside the sidecar environment and is read by the collector.
"""

import json
import math
import sys
import time
from array import array
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypedDict

import pyarrow as pa

from sidecar.redact import scrub_text

if TYPE_CHECKING:  # the builder's inputs, read only (this module stays importable without them: the collector)
    from sidecar.apis.base import Sampled
    from sidecar.call import Call
    from sidecar.request_delta import RequestDelta

SCHEMA_VERSION = 1

# Call statuses. "ok": a complete answer with ids; "truncated": the stream ended early (client hung up, upstream
# reset), what was seen is kept; "upstream_error": the upstream answered 4xx/5xx; "error": the call could not be
# recorded token-exact (malformed request, no ids in the answer) but was passed through.
STATUSES = ("ok", "truncated", "upstream_error", "error")
APIS = ("chat", "completions", "responses", "messages")

# What shapes the distribution a token is drawn from (vLLM's sampling parameters, by the names its chat, completions,
# Responses and Messages routes take): the sidecar records those a call was sent with (``sampling``); the collector
# reads them (collector.sampling).
SAMPLING_KEYS = (
    "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
    "min_tokens", "allowed_token_ids", "logit_bias", "bad_words", "use_beam_search", "logits_processors",
    "vllm_xargs", "thinking_token_budget",
    # constrained decoding (a grammar masks the logits before sampling), by each route's name for it
    "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "tool_choice", "text", "output_config",
)  # fmt: skip

CALL_SCHEMA = pa.schema(
    [
        pa.field("schema_version", pa.int16(), nullable=False),
        pa.field("call_id", pa.string(), nullable=False),
        pa.field("episode_id", pa.string()),
        pa.field("task_id", pa.string()),
        pa.field("run_id", pa.string()),
        pa.field("seq", pa.int32()),
        pa.field("api", pa.string()),
        pa.field("stream", pa.bool_()),
        pa.field("host", pa.string()),
        pa.field("path", pa.string()),
        pa.field("model_requested", pa.string()),
        pa.field("model_served", pa.string()),
        pa.field("response_id", pa.string()),
        # The server's weight version asked just before the call was sent, and again as it was recorded: they
        # differ when a publish happened while the call was served (it straddles two versions).
        pa.field("policy_version", pa.string()),
        pa.field("policy_version_end", pa.string()),
        # The policy replica that served the call (its base URL; sidecar.replicas), and the one that served the
        # episode's previous call when this call moved off it (it went down or left): null when it stayed.
        pa.field("replica", pa.string()),
        pa.field("replica_moved_from", pa.string()),
        pa.field("started_at", pa.timestamp("us", tz="UTC")),
        pa.field("first_token_at", pa.timestamp("us", tz="UTC")),
        pa.field("finished_at", pa.timestamp("us", tz="UTC")),
        pa.field("status", pa.string()),
        pa.field("http_status", pa.int32()),
        pa.field("finish_reason", pa.string()),
        pa.field("error", pa.string()),
        pa.field("note", pa.string()),  # a fact about the ids that is not an error (e.g. logprobs not given)
        # The completion's bound: what the harness asked (null: none) and what the call was served with (the
        # harness's, lowered to the policy server's context minus the prompt and to --max-completion-tokens).
        # Lowered when max_tokens_served < max_tokens_requested: the harness is never refused for its bound.
        pa.field("max_tokens_requested", pa.int32()),
        pa.field("max_tokens_served", pa.int32()),
        # The sampling parameters the policy server was asked to sample with (JSON: temperature, top_p, top_k,
        # min_p, penalties, allowed_token_ids, logit_bias, ... as sent upstream; a key left out takes the server's
        # default: temperature 1, nothing else). `forge serve` returns processed logprobs: each recorded logprob is
        # the token's under the distribution it was drawn from, after all of these (collector.sampling).
        pa.field("sampling", pa.string()),
        # Tokens-in continuation (sidecar.continuation): tokens_in (served from the earlier call's ids), retokenized
        # (the text extends an earlier call, the ids do not; served normally), rewrite (the text differs), or
        # null (not examined). Files written before the column have none: read as null.
        pa.field("continuation", pa.string()),
        pa.field("parent_call_id", pa.string()),
        pa.field("prefix_len", pa.int32()),
        pa.field("prompt_suffix_ids", pa.list_(pa.int32())),
        pa.field("prompt_len", pa.int32()),
        pa.field("completion_token_ids", pa.list_(pa.int32())),
        pa.field("completion_logprobs", pa.list_(pa.float32())),
        # Completion ids whose logprob the upstream did not give (NaN in completion_logprobs): counted, never hidden.
        pa.field("n_unknown_logprobs", pa.int32()),
        # The request as the harness sent it (redacted). Stored linearly: with ``request_parent_call_id`` set, this
        # holds only the part between the first ``request_prefix_chars`` and the last ``request_suffix_chars``
        # characters it shares with that call's request (``sidecar.request_delta``); the ``calls`` view rebuilds it.
        pa.field("request_json", pa.string()),
        pa.field("request_parent_call_id", pa.string()),
        pa.field("request_prefix_chars", pa.int32()),
        pa.field("request_suffix_chars", pa.int32()),
        pa.field("response_json", pa.string()),
        pa.field("usage", pa.string()),
        pa.field("harness", pa.string()),
        pa.field("user_agent", pa.string()),
        pa.field("sidecar_id", pa.string()),
        pa.field("sidecar_version", pa.string()),
    ],
    metadata={"openforge.table": "calls", "openforge.schema_version": str(SCHEMA_VERSION)},
)

REWARD_SCHEMA = pa.schema(
    [
        pa.field("schema_version", pa.int16(), nullable=False),
        pa.field("episode_id", pa.string(), nullable=False),
        pa.field("call_id", pa.string()),
        pa.field("reward", pa.float64(), nullable=False),
        pa.field("components", pa.map_(pa.string(), pa.float64())),
        pa.field("source", pa.string()),
        pa.field("at", pa.timestamp("us", tz="UTC")),
    ],
    metadata={"openforge.table": "rewards", "openforge.schema_version": str(SCHEMA_VERSION)},
)

TABLES = {"calls": CALL_SCHEMA, "rewards": REWARD_SCHEMA}


class CallRecord(TypedDict, total=False):
    """One call record as the sidecar builds it, before ``checked_row``: a column of ``CALL_SCHEMA`` each (a test
    keeps the two equal). Times are microseconds since the epoch; id columns are packed int32/float32 bytes."""

    call_id: str
    episode_id: str
    task_id: str | None
    run_id: str
    seq: int
    api: str
    stream: bool
    host: str
    path: str
    model_requested: str | None
    model_served: str | None
    response_id: str | None
    policy_version: str | None
    policy_version_end: str | None
    replica: str | None
    replica_moved_from: str | None
    started_at: int
    first_token_at: int | None
    finished_at: int
    status: str
    http_status: int | None
    finish_reason: str | None
    error: str | None
    note: str | None
    max_tokens_requested: int | None
    max_tokens_served: int | None
    sampling: str | None
    continuation: str | None
    parent_call_id: str | None
    prefix_len: int
    prompt_suffix_ids: bytes | None
    prompt_len: int | None
    completion_token_ids: bytes | None
    completion_logprobs: bytes | None
    n_unknown_logprobs: int | None
    request_json: str | None
    request_parent_call_id: str | None
    request_prefix_chars: int
    request_suffix_chars: int
    response_json: str | None
    usage: str | None
    harness: str | None
    user_agent: str | None
    sidecar_id: str
    sidecar_version: str


class RewardRow(TypedDict):
    """One reward record: a column of ``REWARD_SCHEMA`` each (a test keeps the two equal; ``to_table`` adds
    ``schema_version``). ``at`` is microseconds since the epoch (UTC)."""

    episode_id: str
    call_id: str | None
    reward: float
    components: dict[str, float] | None
    source: str
    at: int


def reward_row(
    episode_id: str, reward: float, source: str, call_id: str | None = None,
    components: Mapping[str, float] | None = None, at: int | None = None,
) -> RewardRow:  # fmt: skip
    """The reward record every writer of rewards builds (the sidecar's admin endpoint, `forge reward`, `forge
    verify`): ``at`` now unless given."""
    return {
        "episode_id": episode_id, "call_id": call_id, "reward": float(reward),
        "components": None if components is None else {k: float(v) for k, v in components.items()},
        "source": source, "at": time.time_ns() // 1000 if at is None else at,
    }  # fmt: skip


def to_table(rows: Sequence[Mapping[str, Any]], table: str) -> pa.Table:
    """Rows (dicts keyed by column) to an Arrow table of the named schema; missing columns are null."""
    schema = TABLES[table]
    return pa.Table.from_pylist([{"schema_version": SCHEMA_VERSION, **row} for row in rows], schema=schema)


def _text(value: Any) -> str:
    """Any value as a string a Parquet column takes: strings as they are, anything else as its JSON text."""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    if text.isascii():  # the common case, without a copy
        return text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates (from JSON \ud800 escapes) have no UTF-8 form
        text = text.encode("utf-8", "replace").decode("utf-8")
    return text


def _integer(value: Any, bits: int) -> int | None:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, int) and -(1 << (bits - 1)) <= value < 1 << (bits - 1):
        return value
    return None


def _coerce(value: Any, kind: pa.DataType) -> Any:
    if value is None:
        return None
    if pa.types.is_string(kind):
        return _text(value)
    if pa.types.is_integer(kind):
        return _integer(value, kind.bit_width)
    if pa.types.is_timestamp(kind):
        return _integer(value, 64)
    if pa.types.is_boolean(kind):
        return value if isinstance(value, bool) else None
    if pa.types.is_floating(kind):
        number = float(value) if isinstance(value, int | float) and not isinstance(value, bool) else math.nan
        return number if math.isfinite(number) else None
    if pa.types.is_list(kind):  # id columns travel packed (int32 / float32 bytes)
        return value if isinstance(value, bytes) and len(value) % 4 == 0 else None
    if pa.types.is_map(kind):
        if not isinstance(value, dict):
            return None
        pairs = {_text(k): _coerce(v, kind.item_type) for k, v in value.items()}
        return {k: v for k, v in pairs.items() if v is not None}
    return None


def _fast_path(kind: pa.DataType) -> str | None:
    """A Python test that a value ``v`` is already what ``_coerce`` would return for it (None: no fast path)."""
    if pa.types.is_string(kind):
        return "type(v) is str and v.isascii()"
    if pa.types.is_integer(kind) or pa.types.is_timestamp(kind):
        bits = kind.bit_width if pa.types.is_integer(kind) else 64
        return f"type(v) is int and {-(1 << (bits - 1))} <= v < {1 << (bits - 1)}"
    if pa.types.is_boolean(kind):
        return "type(v) is bool"
    if pa.types.is_list(kind):  # id columns travel packed (int32 / float32 bytes)
        return "type(v) is bytes and len(v) % 4 == 0"
    return None


def _compile_check(table: str, schema: pa.Schema) -> Callable[[Any], dict[str, Any]]:
    """``checked_row`` for one table as one function, compiled once: per column an inline test of the common case
    (a value already of the column's plain Python type), ``_coerce`` only for the rest."""
    fields = [field for field in schema if field.name != "schema_version"]
    lines = ["def check(row):", "    get = row.get", "    out = {}"]
    scope: dict[str, Any] = {}
    for i, field in enumerate(fields):
        scope[f"k{i}"] = field.type
        fast = _fast_path(field.type)
        lines.append(f"    v = get({field.name!r})")
        test = f"v is not None and not ({fast})" if fast else "v is not None"
        lines += [f"    if {test}:", f"        v = coerce(v, k{i})", f"    out[{field.name!r}] = v"]
    lines.append("    return out")
    scope["coerce"] = _coerce
    exec("\n".join(lines), scope)  # the column names are the schema's own identifiers, quoted by repr
    check: Callable[[Any], dict[str, Any]] = scope["check"]
    check.__qualname__ = f"checked_row[{table}]"
    return check


_CHECKS = {table: _compile_check(table, schema) for table, schema in TABLES.items()}


def checked_row(table: str, row: Mapping[str, Any]) -> dict[str, Any]:
    """A record with every value checked and coerced to its column's type, so writing it can never fail later.

    Whatever a harness or an upstream sent: a value of another type is kept as its JSON text in a string column
    (a model name that is a number or a list), or dropped (null) where the column cannot hold it (an out-of-range
    integer, a non-finite reward); unknown keys are dropped.
    """
    return _CHECKS[table](row)


def pack_ids(values: list[int]) -> bytes:
    packed = array("i", values)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def pack_floats(values: list[float]) -> bytes:
    packed = array("f", values)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def call_row(
    call: "Call", status: str, sampled: "Sampled | None", *, prompt: bytes | None, completion: bytes | None,
    parent: str | None,
    prefix_len: int, request: "RequestDelta", response_json: str | None, version: str | None,
    version_end: str | None, note: str | None, http_status: int | None, finished_at: int, sidecar_id: str,
    sidecar_version: str,
) -> CallRecord:  # fmt: skip
    """A call's record, from the call, what was sampled and where its prompt and request sit in the episode (the
    prompt's shared prefix, ``parent``/``prefix_len``; the request's, ``request``). Pure: the caller decided the
    status, the version and the note."""
    return {
        "call_id": call.call_id, "episode_id": call.episode_id, "task_id": call.task_id, "run_id": call.run_id,
        "seq": call.seq, "api": call.api, "stream": bool(call.added and call.added.stream),
        "host": call.host, "path": call.path,  # as the harness called them, before routing
        "model_requested": call.model_requested, "model_served": sampled.model if sampled else None,
        "response_id": sampled.response_id if sampled else None,
        "policy_version": version, "policy_version_end": version_end,
        "started_at": call.started_at,
        "first_token_at": call.first_token_at, "finished_at": finished_at, "status": status,
        "http_status": http_status,
        "finish_reason": sampled.finish_reason if sampled else None, "error": call.error,
        "max_tokens_requested": call.bound.requested if call.bound else None,
        "sampling": call.sampling,
        "max_tokens_served": call.bound.served(len(prompt) // 4 if prompt is not None else None)
        if call.bound
        else None,
        "note": note,
        "continuation": call.continuation.state if call.continuation else None,
        "parent_call_id": parent, "prefix_len": prefix_len,
        "prompt_suffix_ids": prompt[prefix_len * 4 :] if prompt is not None else None,
        "prompt_len": len(prompt) // 4 if prompt is not None else None,
        "completion_token_ids": completion,
        "completion_logprobs": pack_floats(sampled.logprobs) if sampled else None,
        "n_unknown_logprobs": sum(1 for v in sampled.logprobs if v != v) if sampled else None,  # NaN != NaN
        "request_json": request.middle if call.request_json is not None else None,
        "request_parent_call_id": request.parent_call_id, "request_prefix_chars": request.prefix_chars,
        "request_suffix_chars": request.suffix_chars, "response_json": response_json,
        "usage": json.dumps(sampled.usage) if sampled and sampled.usage else None,
        "harness": call.harness,
        "replica": call.replica.url if call.replica else None, "replica_moved_from": call.moved_from,
        "user_agent": scrub_text(call.user_agent, call.secrets) if call.user_agent else None,
        "sidecar_id": sidecar_id, "sidecar_version": sidecar_version,
    }  # fmt: skip
