"""The token-fidelity report: how well a harness's calls merge into trainable sequences, per harness and per run.

merge rate: of the calls after an episode's first, the share that continued the segment they follow; fork rate:
the share that started a new one (retries are counted beside them); trainable share: sampled tokens over all
tokens of the segments; calls without ids and truncated calls: shares of all calls; unknown logprobs: trainable
tokens whose behaviour logprob the upstream did not give (NaN), and their share of the trainable tokens.
"""

from pathlib import Path

import duckdb

REPORT_SQL = """
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
       sum(n_unknown_logprobs) / nullif(sum(n_trainable), 0) AS unknown_logprob_share
FROM episodes
GROUP BY GROUPING SETS ((harness), (run_id))
ORDER BY grouping, name
"""

PLOTTED = [
    ("merge_rate", "merge rate"), ("fork_rate", "fork rate"), ("trainable_share", "trainable tokens"),
    ("without_ids_share", "calls without ids"), ("truncated_share", "truncated calls"),
    ("unknown_logprob_share", "trainable tokens without logprob"),
]  # fmt: skip


def fidelity(con: duckdb.DuckDBPyConnection) -> tuple[list[str], list[tuple]]:
    table = con.execute(REPORT_SQL).arrow().read_all()
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
