"""The call record and the reward record: the hand-off from the sidecar to the collector, as Arrow schemas.

One row per model call. Prompts are stored linearly: when a call's prompt shares a prefix with an earlier call's
prompt + completion in the same episode, the row keeps only ``parent_call_id``, ``prefix_len`` and the ids past
the prefix (``prompt_suffix_ids``); the collector's ``calls`` view rebuilds whole ``prompt_token_ids``. A row
without a parent has ``prefix_len = 0`` and its whole prompt in ``prompt_suffix_ids``.

Everything here is stdlib + pyarrow: it runs inside the sidecar environment and is read by the collector.
"""

from typing import Any

import pyarrow as pa

SCHEMA_VERSION = 1

# Call statuses. "ok": a complete answer with ids; "truncated": the stream ended early (client hung up, upstream
# reset), what was seen is kept; "upstream_error": the upstream answered 4xx/5xx; "error": the call could not be
# recorded token-exact (malformed request, no ids in the answer) but was passed through.
STATUSES = ("ok", "truncated", "upstream_error", "error")
APIS = ("chat", "completions", "responses", "messages")

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
        pa.field("policy_version", pa.string()),
        pa.field("started_at", pa.timestamp("us", tz="UTC")),
        pa.field("first_token_at", pa.timestamp("us", tz="UTC")),
        pa.field("finished_at", pa.timestamp("us", tz="UTC")),
        pa.field("status", pa.string()),
        pa.field("http_status", pa.int32()),
        pa.field("finish_reason", pa.string()),
        pa.field("error", pa.string()),
        pa.field("note", pa.string()),  # a fact about the ids that is not an error (e.g. logprobs not given)
        pa.field("parent_call_id", pa.string()),
        pa.field("prefix_len", pa.int32()),
        pa.field("prompt_suffix_ids", pa.list_(pa.int32())),
        pa.field("prompt_len", pa.int32()),
        pa.field("completion_token_ids", pa.list_(pa.int32())),
        pa.field("completion_logprobs", pa.list_(pa.float32())),
        # Completion ids whose logprob the upstream did not give (NaN in completion_logprobs): counted, never hidden.
        pa.field("n_unknown_logprobs", pa.int32()),
        pa.field("request_json", pa.string()),
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

_HARNESSES = (  # (user-agent fragment, harness), first match wins
    ("claude-cli", "claude-code"),
    ("claude-code", "claude-code"),
    ("codex", "codex"),
    ("openclaw", "openclaw"),
    ("mini-swe-agent", "mini-swe-agent"),
    ("litellm", "litellm"),
    ("smolagents", "smolagents"),
    ("openai/python", "openai-python"),
    ("openai/js", "openai-node"),
    ("anthropic/python", "anthropic-python"),
    ("curl/", "curl"),
)


def harness_from_user_agent(user_agent: str | None) -> str | None:
    if not user_agent:
        return None
    lowered = user_agent.lower()
    return next((name for fragment, name in _HARNESSES if fragment in lowered), "other")


def to_table(rows: list[dict[str, Any]], table: str) -> pa.Table:
    """Rows (dicts keyed by column) to an Arrow table of the named schema; missing columns are null."""
    schema = TABLES[table]
    return pa.Table.from_pylist([{"schema_version": SCHEMA_VERSION, **row} for row in rows], schema=schema)
