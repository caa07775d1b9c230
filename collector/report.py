"""The token-fidelity report: how well a harness's calls merge into trainable sequences, per harness and per run.

merge rate: of the calls after an episode's first, the share that continued the segment they follow; fork rate:
the share that started a new one (retries are counted beside them); trainable share: sampled tokens over all
tokens of the segments; calls without ids and truncated calls: shares of all calls; unknown logprobs: trainable
tokens whose behaviour logprob the upstream did not give (NaN), and their share of the trainable tokens.

Forks by cause (each segment after an episode's first, by its first call): ``retokenization`` (the sidecar found
the prompt re-renders an earlier call's text, not its ids: the call record's ``continuation`` says so),
``retry`` (a prompt identical to an earlier one), ``unrelated`` (shares no prefix with any earlier call: a
sub-agent, a side request), ``answer_dropped`` (the prompt leaves the earlier call's prompt within its last
``GENERATION_PROMPT_TOKENS`` tokens, the generation prompt that opened the earlier call's answer: that answer is
not in this history — mini-swe-agent drops an answer it rejects and resends only its "Format error" message),
``rewrite`` (leaves it earlier, in the history — compaction, edited messages — or after it, inside the answer's
own turn — an answer re-rendered or edited, rewritten tool-call ids), ``unknown`` (no earlier call to measure it
against). Calls served tokens-in (``continuation = 'tokens_in'``) are counted beside them. Records written
before the ``continuation`` column count no re-tokenization.
"""

from pathlib import Path

import duckdb

# The chat templates' generation prompts ("<|im_start|>assistant\n": 3 tokens in SmolLM2's and Qwen's, 4 in
# Llama 3's) fit in this many tokens; a history that leaves the earlier prompt inside them lacks that call's answer.
GENERATION_PROMPT_TOKENS = 8
FORK_CAUSES_SQL = """
SELECT s.episode_id, s.harness, s.run_id, s.segment, s.fork_reason, s.call_ids[1] AS call_id,
       CASE WHEN s.fork_reason = 'retry' THEN 'retry'
            WHEN c.continuation IN ('retokenized', 'tokens_in') THEN 'retokenization'
            WHEN s.fork_reason = 'unrelated' THEN 'unrelated'
            WHEN p.prompt_len IS NULL THEN 'unknown'
            WHEN s.shared_prefix_len < p.prompt_len
                 AND s.shared_prefix_len >= p.prompt_len - {generation_prompt} THEN 'answer_dropped'
            ELSE 'rewrite' END AS cause
FROM segments s LEFT JOIN (SELECT call_id, {continuation} AS continuation FROM calls_raw) c
     ON c.call_id = s.call_ids[1]
     LEFT JOIN (SELECT call_id, prompt_len FROM calls_raw) p ON p.call_id = s.fork_call_id
WHERE s.segment > 0
"""
CAUSES = ("retokenization", "retry", "answer_dropped", "rewrite", "unrelated", "unknown")

REPORT_SQL = """
WITH causes AS ({fork_causes}),
per_episode AS (
    SELECT episode_id,
           count(*) FILTER (WHERE cause = 'retokenization') AS f_retokenization,
           count(*) FILTER (WHERE cause = 'retry') AS f_retry,
           count(*) FILTER (WHERE cause = 'answer_dropped') AS f_answer_dropped,
           count(*) FILTER (WHERE cause = 'rewrite') AS f_rewrite,
           count(*) FILTER (WHERE cause = 'unrelated') AS f_unrelated,
           count(*) FILTER (WHERE cause = 'unknown') AS f_unknown
    FROM causes GROUP BY episode_id
),
served AS (
    SELECT episode_id, count(*) FILTER (WHERE {continuation} = 'tokens_in') AS n_tokens_in,
           count({moved_from}) AS n_replica_moves
    FROM calls_raw GROUP BY episode_id
),
episodes AS (
    SELECT e.*, coalesce(p.f_retokenization, 0) AS f_retokenization, coalesce(p.f_retry, 0) AS f_retry,
           coalesce(p.f_answer_dropped, 0) AS f_answer_dropped, coalesce(p.f_rewrite, 0) AS f_rewrite,
           coalesce(p.f_unrelated, 0) AS f_unrelated, coalesce(p.f_unknown, 0) AS f_unknown,
           coalesce(v.n_tokens_in, 0) AS n_tokens_in, coalesce(v.n_replica_moves, 0) AS n_replica_moves
    FROM episodes e LEFT JOIN per_episode p USING (episode_id) LEFT JOIN served v USING (episode_id)
)
SELECT CASE WHEN GROUPING(harness) = 0 THEN 'harness' ELSE 'run' END AS grouping,
       coalesce(CASE WHEN GROUPING(harness) = 0 THEN harness ELSE run_id END, '(none)') AS name,
       count(*) AS episodes,
       count(*) FILTER (WHERE status = 'complete') AS complete,
       sum(n_calls)::BIGINT AS calls,
       sum(n_merged) / nullif(sum(n_merged + n_forked), 0) AS merge_rate,
       sum(n_forked) / nullif(sum(n_merged + n_forked), 0) AS fork_rate,
       sum(n_retries)::BIGINT AS retries,
       sum(n_trainable) / nullif(sum(n_tokens), 0) AS trainable_share,
       sum(n_tokens)::BIGINT AS tokens,
       sum(n_calls_without_ids)::BIGINT AS calls_without_ids,
       sum(n_calls_without_ids) / nullif(sum(n_calls), 0) AS without_ids_share,
       sum(n_truncated)::BIGINT AS truncated_calls,
       sum(n_truncated) / nullif(sum(n_calls), 0) AS truncated_share,
       sum(n_unknown_logprobs)::BIGINT AS unknown_logprobs,
       sum(n_unknown_logprobs) / nullif(sum(n_trainable), 0) AS unknown_logprob_share,
       sum(f_retokenization)::BIGINT AS forks_retokenization,
       sum(f_retry)::BIGINT AS forks_retry,
       sum(f_answer_dropped)::BIGINT AS forks_answer_dropped,
       sum(f_rewrite)::BIGINT AS forks_rewrite,
       sum(f_unrelated)::BIGINT AS forks_unrelated,
       sum(f_unknown)::BIGINT AS forks_unknown,
       sum(n_tokens_in)::BIGINT AS calls_tokens_in,
       sum(n_replica_moves)::BIGINT AS replica_moves
FROM episodes
GROUP BY GROUPING SETS ((harness), (run_id))
ORDER BY grouping, name
"""

PLOTTED = [
    ("merge_rate", "merge rate"), ("fork_rate", "fork rate"), ("trainable_share", "trainable tokens"),
    ("without_ids_share", "calls without ids"), ("truncated_share", "truncated calls"),
    ("unknown_logprob_share", "trainable tokens without logprob"),
]  # fmt: skip


def _column_or_null(con: duckdb.DuckDBPyConnection, name: str = "continuation") -> str:
    """A column of the records (``continuation`` by default), or NULL where every file predates it."""
    columns = {row[0] for row in con.execute("DESCRIBE calls_raw").fetchall()}
    return name if name in columns else "NULL::VARCHAR"


def _fork_causes_sql(con: duckdb.DuckDBPyConnection) -> str:
    return FORK_CAUSES_SQL.format(continuation=_column_or_null(con), generation_prompt=GENERATION_PROMPT_TOKENS)


def fork_causes(con: duckdb.DuckDBPyConnection) -> list[dict]:
    """One row per fork (a segment after an episode's first): episode, harness, run, segment, reason, cause."""
    query = _fork_causes_sql(con) + " ORDER BY episode_id, segment"
    return con.execute(query).arrow().read_all().to_pylist()


def fidelity(con: duckdb.DuckDBPyConnection) -> tuple[list[str], list[tuple]]:
    continuation = _column_or_null(con)
    causes = _fork_causes_sql(con)
    moved_from = _column_or_null(con, "replica_moved_from")  # calls that moved to another replica
    query = REPORT_SQL.format(fork_causes=causes, continuation=continuation, moved_from=moved_from)
    table = con.execute(query).arrow().read_all()
    return table.column_names, [tuple(row.values()) for row in table.to_pylist(maps_as_pydicts="lossy")]


def plot(columns: list[str], rows: list[tuple], path: Path) -> None:
    """One panel per grouping (harness, run): the fidelity figures as grouped bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [("harness", "per harness"), ("run", "per run")]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), squeeze=False)
    index = {name: i for i, name in enumerate(columns)}
    for ax, (by, title) in zip(axes[0], groups, strict=True):
        picked = [row for row in rows if row[index["grouping"]] == by]
        names = [str(row[index["name"]]) for row in picked]
        width = 0.8 / len(PLOTTED)
        for k, (column, label) in enumerate(PLOTTED):
            values = [float(row[index[column]] or 0.0) for row in picked]
            ax.bar([i + k * width for i in range(len(picked))], values, width, label=label)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(picked))], names, rotation=20, ha="right")
        ax.set_ylim(0, 1.05)
        ax.set_title(f"token fidelity {title}")
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
