"""The demo's verifiers: `python -P -m forge.demo.verify TASK`, run in the rollout's folder after the harness
(-P: the workspace, which the agent wrote, is not on the import path).

Reward = 0.4 × format + 0.6 × outcome, written as ``{"reward": R, "components": {...}}`` to ``$FORGE_VERDICT_FILE``
(`forge rollout`'s verifier contract, k8s/verify.py) and printed:
- format: the share of the model's turns that mini-swe-agent could run — exactly one ```bash block — read from
  the harness's own trajectory (``traj.json``: an assistant message per action it ran, a ``FormatError``
  message per answer it rejected). A habit a 135M policy can learn: the signal GRPO needs within a group.
- outcome: the workspace: the folder exists; or the file exists (half) and holds the word (the other half).
Nothing here trusts what the model says it did; a missing or unreadable trajectory scores format 0.
"""

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

FORMAT_WEIGHT, OUTCOME_WEIGHT = 0.4, 0.6


def format_score(folder: Path) -> tuple[float, int, int]:
    """(share of runnable turns, runnable turns, rejected turns) from mini-swe-agent's trajectory."""
    try:
        messages = json.loads((folder / "traj.json").read_text()).get("messages", [])
    except (OSError, ValueError, AttributeError):
        return 0.0, 0, 0
    ran = sum(1 for m in messages if isinstance(m, dict) and m.get("role") == "assistant")
    extras = [m.get("extra") for m in messages if isinstance(m, dict)]
    rejected = sum(1 for e in extras if isinstance(e, dict) and e.get("interrupt_type") == "FormatError")
    turns = ran + rejected
    return (ran / turns if turns else 0.0), ran, rejected


def _text(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace") if path.is_file() else None
    except OSError:
        return None


def _file_with(name: str, ok: Callable[[str], bool]) -> Callable[[Path], float]:
    """Half for the file, half for its content."""

    def check(folder: Path) -> float:
        text = _text(folder / name)
        return 0.0 if text is None else 0.5 + 0.5 * ok(text)

    return check


def _folder(name: str) -> Callable[[Path], float]:
    return lambda folder: float((folder / name).is_dir())


def _file_with_word(name: str, word: str) -> Callable[[Path], float]:
    """Half for the file, half for the word among its words (any case)."""
    return _file_with(name, lambda text: word in text.lower().split())


# The tasks of tasks.jsonl (trained) and heldout.jsonl (never trained): a folder, or a file holding a word.
FOLDERS = ["build", "output", "tmp", "backup", "src", "cache", "archive", "reports"]
FILES = {"hello": "hello", "greeting": "hi", "word": "yes", "status": "ok"}
CHECKS: dict[str, Callable[[Path], float]] = {
    **{f"folder-{name}": _folder(name) for name in FOLDERS},
    **{f"file-{name}": _file_with_word(f"{name}.txt", word) for name, word in FILES.items()},
}


def verdict(task: str, folder: Path) -> dict:
    fmt, ran, rejected = format_score(folder)
    outcome = CHECKS[task](folder)
    reward = round(FORMAT_WEIGHT * fmt + OUTCOME_WEIGHT * outcome, 4)
    return {"reward": reward, "components": {"format": round(fmt, 4), "outcome": outcome, "turns_run": ran,
                                             "turns_rejected": rejected}}  # fmt: skip


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in CHECKS:
        print(f"usage: python -m forge.demo.verify {{{','.join(CHECKS)}}}", file=sys.stderr)
        return 2
    found = json.dumps(verdict(argv[0], Path.cwd()))
    if target := os.environ.get("FORGE_VERDICT_FILE"):
        Path(target).write_text(found)
    print(found)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
