"""The ``calls`` view: whole prompts of one long episode rebuilt, against the recursive query it replaced.

One episode of N linear turns (a 200-token first prompt; each turn adds a 20-token completion and a 10-token
tool result) beside 200 short episodes, in one file. Timed: ``SELECT sum(len(prompt_token_ids)),
sum(list_sum(prompt_token_ids)) FROM calls`` (every whole prompt built, nothing sent to Python), once per view;
both views must give the same sums.

    .venv/bin/python bench/collector_calls_view.py --turns 400,800,1600
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

# The view before: a recursive CTE that carries each call's whole sequence and re-joins calls_raw once per level.
RECURSIVE_VIEW = """
CREATE OR REPLACE VIEW calls_recursive AS
WITH RECURSIVE chain(call_id, prompt_token_ids, full_ids) AS (
    SELECT call_id, prompt_suffix_ids, list_concat(prompt_suffix_ids, completion_token_ids)
    FROM calls_raw WHERE parent_call_id IS NULL
    UNION ALL
    SELECT c.call_id,
           list_concat(p.full_ids[1:c.prefix_len], c.prompt_suffix_ids),
           list_concat(list_concat(p.full_ids[1:c.prefix_len], c.prompt_suffix_ids), c.completion_token_ids)
    FROM calls_raw c JOIN chain p ON c.parent_call_id = p.call_id
)
SELECT r.* EXCLUDE (prompt_suffix_ids), chain.prompt_token_ids
FROM calls_raw r LEFT JOIN chain USING (call_id)
"""
QUERY = "SELECT sum(len(prompt_token_ids)), sum(list_sum(prompt_token_ids)) FROM {view}"


def write_store(store: str, turns: int) -> None:
    from bench.collector_generate import SyntheticEpisode, write_calls

    long = SyntheticEpisode("long")
    prompt = list(range(200))
    for turn in range(turns):
        completion = list(range(10_000 + 20 * turn, 10_020 + 20 * turn))
        long.call(prompt, completion)
        prompt = prompt + completion + list(range(50_000 + 10 * turn, 50_010 + 10 * turn))
    rows = long.rows
    for k in range(200):
        short = SyntheticEpisode(f"short-{k}")
        prompt = list(range(100))
        for turn in range(5):
            short.call(prompt, [k, turn, 7])
            prompt = [*prompt, k, turn, 7, 1, 2]
        rows += short.rows
    write_calls(store, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--turns", default="400,800,1600", help="Turns of the long episode, comma-separated.")
    args = parser.parse_args()
    from collector.sql import connect

    print(f"{'turns':>6} {'whole-prompt ids':>16} {'calls s':>8} {'recursive s':>11}")
    for turns in (int(t) for t in args.turns.split(",")):
        with tempfile.TemporaryDirectory() as store:
            write_store(store, turns)
            con = connect(store)
            con.execute(RECURSIVE_VIEW)
            sums, seconds = {}, {}
            for view in ("calls", "calls_recursive"):
                start = time.perf_counter()
                sums[view] = con.execute(QUERY.format(view=view)).fetchall()[0]
                seconds[view] = time.perf_counter() - start
            assert sums["calls"] == sums["calls_recursive"], sums
            ids = sums["calls"][0]
            print(f"{turns:>6} {ids:>16,} {seconds['calls']:>8.2f} {seconds['calls_recursive']:>11.2f}", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
