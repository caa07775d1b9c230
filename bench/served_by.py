"""Which weights sampled a run's calls, by behaviour: every recorded call teacher-forced under the checkpoint its
record names and under the version before it, at the temperature it was sampled at (transformers, fp32, CPU;
``trainer/teacher.py``).

    .venv/bin/python -m bench.served_by --store OUT/store --run RUN [--checkpoints DIR] [--s3-endpoint URL]

Per round (the call records' ``run_id``): calls, how many are served by the version they name (mean |recorded −
forced| under it ≤ the fp32 bound, and under the previous version more than 10× that), and the median gaps. A call
with no version is listed apart, and one whose named and previous checkpoints agree on its tokens (an update that
did not move the policy there: every group's rewards equal) is counted as "named = previous", not as served.
``--checkpoints`` is the folder holding ``v0``, ``v1``, ... (default:
``<store>/checkpoints/<run>``; for an S3 store the trainer's local copies, ``<out>/trainer/forge-checkpoints/...``).
Exit 1 when any call is not served by the version it names.
"""

import statistics
import sys
from pathlib import Path

import click

from collector.sampling import plain_temperature
from collector.sql import connect
from trainer import teacher
from trainer.publish import TOLERANCE
from trainer.serve import default_checkpoint


@click.command()
@click.option("--store", required=True)
@click.option("--run", "run_name", required=True, help="The training run (its checkpoints' folder name).")
@click.option("--checkpoints", type=click.Path(path_type=Path, file_okay=False))
@click.option("--s3-endpoint")
@click.option("--limit", type=int, default=0, help="At most this many calls per round (0: all).")
def main(store: str, run_name: str, checkpoints: Path | None, s3_endpoint: str | None, limit: int) -> None:
    folder = checkpoints or Path(store) / "checkpoints" / run_name
    base = default_checkpoint("float32")
    bound = TOLERANCE["float32"]
    con = connect(store, s3_endpoint)
    rows = con.execute(
        "SELECT run_id, call_id, policy_version, model_served, prompt_token_ids, completion_token_ids, "
        "completion_logprobs, sampling FROM calls WHERE status = 'ok' ORDER BY run_id, started_at"
    ).fetchall()

    def checkpoint(version: int) -> Path:  # a full-weight run's v0 is the base checkpoint (none is written)
        path = folder / f"v{version}"
        return path if path.is_dir() or version else base

    rounds: dict[str, list[tuple]] = {}
    for row in rows:
        rounds.setdefault(row[0], []).append(row)
    failed = 0
    print(
        "round (run id)   calls  served by the version named  median |Δ| named  median |Δ| previous  no version"
        "  named = previous"
    )
    for run_id, calls in rounds.items():
        served, same, named, previous, unknown = 0, 0, [], [], 0
        for _, call_id, version, model, prompt, completion, recorded, sampling in calls[: limit or None]:
            temperature = plain_temperature(sampling)
            if version is None or temperature is None:  # no version, or a distribution teacher forcing cannot give
                unknown += 1
                continue
            v = int(version)
            forced = teacher.logprobs(checkpoint(v), base, prompt, completion, temperature)
            gap = teacher.mean_abs_gap(recorded, forced)
            before = teacher.logprobs(checkpoint(v - 1), base, prompt, completion, temperature) if v > 0 else None
            old = teacher.mean_abs_gap(recorded, before) if before is not None else float("inf")
            named.append(gap)
            previous.append(old)
            if gap <= bound and before is not None and teacher.mean_abs_gap(forced, before) <= bound:
                same += 1  # the update did not move the policy on these tokens (e.g. every group's rewards equal)
            elif gap <= bound and old > 10 * gap:
                served += 1
            else:
                failed += 1
                print(f"  {call_id} ({model}, v{v}): |Δ| {gap:.2e} under v{v}, {old:.2e} under the previous")
        checked = len(named)
        prev = [p for p in previous if p != float("inf")]
        print(f"{run_id:16} {checked + unknown:6d}  {served:>13d} of {checked:<13d}  "
              f"{statistics.median(named) if named else float('nan'):16.2e}  "
              f"{statistics.median(prev) if prev else float('nan'):19.2e}  {unknown:10d}  {same:16d}")  # fmt: skip
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
