"""A real harness's multi-turn session recorded through the sidecar (``--tokens-in auto``), then its fork figures.

    python -m bench.harness_session codex|claude-code --turns 6 --store STORE [--upstream http://127.0.0.1:18000]

One conversation driven over several invocations of the real, unmodified harness (pinned by scripts/harness.sh)
until the sidecar has recorded at least ``--turns`` calls, one of them served tokens-in (a 135M policy ends its turns
early, so one invocation makes one to four calls; at most ``2 * --turns`` invocations). Every call is one episode
(the sidecar's ``--episode-id``); the harness samples at its own temperature (none is set), HOME is a temporary
folder and it talks only to the sidecar on loopback.

- ``codex``: ``codex exec PROMPT``, then ``codex exec resume --last NEXT``. Codex runs as in
  tests/sidecar/test_harness_codex.py: its own defaults (no model in its config), through the test-only output bound
  (tests/support/harness_output_bound.py: ``max_output_tokens`` on each request, as a harness with that setting
  would send).
- ``claude-code``: ``claude -p PROMPT``, then ``claude -p --continue NEXT`` (the most recent conversation in the
  working directory). Claude Code runs as in tests/sidecar/test_harness_claude_code.py: its defaults (its own
  model), ``ANTHROPIC_BASE_URL`` the sidecar, its answers bounded by its own setting ``CLAUDE_CODE_MAX_OUTPUT_TOKENS``
  (sent as ``max_tokens``). An answer SmolLM2 does not end within that bound makes Claude Code ask it to resume (a
  further call, up to three) and then exit 1 saying so; the conversation is saved all the same and the next
  invocation continues it.

Printed: one line per call (how tokens-in continuation judged it), then ``bench.tokens_in forks`` over the store:
segments, fork rate, forks by cause and trainable-token share, as recorded (after) and with every tokens-in call's
prompt replaced by vLLM's own rendering of its request (before: what the normal path would have had). The store is
kept; ``python -m bench.tokens_in forks --store STORE`` prints the figures again.
"""

import argparse
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.tokens_in import forks, render_request
from collector.sampling import plain_temperature
from tests.support.harness import claude_code_env, installed_harness
from tests.support.sidecar import Sidecar, SidecarFactory, read_calls, wait_for

PROMPTS = [
    "What does notes.txt say? Use the shell.",
    "Thanks. Say that again in one short sentence.",
    "Now say it in French.",
    "How many words was your last answer?",
    "Write one more sentence about the number 42.",
    "Say goodbye in one word.",
]
HARNESS_TIMEOUT_S = 600
CLAUDE_MAX_OUTPUT_TOKENS = 64  # Claude Code's own CLAUDE_CODE_MAX_OUTPUT_TOKENS (as test_harness_claude_code.py)


@dataclass
class Session:
    """A recorded session: its call records in order, the first invocation (its exit and output) and how many calls
    it made, the secrets the harness held (its API key, Codex's installation id) and the sidecar that recorded it
    (stopped: its store, log and WAL stay to be read)."""

    calls: list[dict]
    first: subprocess.CompletedProcess
    n_first: int
    sidecar: Sidecar
    secrets: list[str] = field(default_factory=list)
    home: Path | None = None


def _run(name: str, command: list[str], work: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    run = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=HARNESS_TIMEOUT_S,
                         stdin=subprocess.DEVNULL)  # fmt: skip
    if run.returncode != 0:
        print(f"{name} exited {run.returncode}: {(run.stderr or run.stdout).strip()[-400:]}", file=sys.stderr)
    return run


def _codex(
    home: Path, work: Path, env: dict[str, str], codex: str, prompt: str, first: bool
) -> subprocess.CompletedProcess:
    command = [codex, "exec", "--skip-git-repo-check"]
    command += ["-s", "read-only", prompt] if first else ["resume", "--last", "--skip-git-repo-check", prompt]
    return _run("codex", command, work, env)


def _drive(
    store: str, episode: str, turns: int, invoke: Callable[[str, bool], subprocess.CompletedProcess], hunt: bool
) -> tuple[int, subprocess.CompletedProcess, int]:
    """Invoke the harness (prompt, first?) until the episode has ``turns`` calls (``hunt``: one of them served
    tokens-in, as a session whose sampled answers all happen to re-tokenize canonically shows nothing), or
    ``2 * turns`` invocations ran; how many ran, the first invocation and how many calls it made."""

    def enough() -> bool:
        calls = read_calls(store, f"episode_id = '{episode}'")
        return len(calls) >= turns and (not hunt or any(c["continuation"] == "tokens_in" for c in calls))

    invocations, first, n_first = 0, None, 0
    while not enough() and invocations < 2 * turns:
        started = time.monotonic()
        run = invoke(PROMPTS[min(invocations, len(PROMPTS) - 1)], invocations == 0)
        first, code = first or run, run.returncode
        invocations += 1
        time.sleep(1.0)  # the sidecar flushes every 0.3 s
        n = len(read_calls(store, f"episode_id = '{episode}'"))
        n_first = n_first or n
        print(f"invocation {invocations} (exit {code}, {time.monotonic() - started:.0f} s): {n} calls so far")
    assert first is not None
    return invocations, first, n_first


def _recorded(store: str, episode: str, invocations: int) -> list[dict]:
    calls = wait_for(lambda: read_calls(store, f"episode_id = '{episode}'"), what="the session's records")
    print(f"episode {episode}: {len(calls)} calls, {invocations} invocations")
    print(f"{'seq':>3}  {'status':<8} {'prompt':>6} {'ids':>4}  {'continuation':<12} note")
    for c in calls:
        print(f"{c['seq']:>3}  {c['status']:<8} {c['prompt_len'] or 0:>6} {len(c['completion_token_ids'] or []):>4}  "
              f"{c['continuation']!s:<12} {(c['note'] or '')[:110]}")  # fmt: skip
    return calls


def codex_session(upstream: str, store: str, turns: int, tmp: Path, hunt: bool = True) -> Session:
    """Record one Codex conversation of at least ``turns`` calls (or as many as ``2 * turns`` invocations gave)."""
    from tests.support.harness import codex_home, output_bound

    codex = installed_harness("codex")
    factory = SidecarFactory(tmp)
    episode = f"codex-session-{int(time.time())}"
    try:
        sidecar = factory(upstream, store=store, episode_id=episode)  # its defaults: --tokens-in auto
        with output_bound(sidecar.url, tmp) as bounded_url:
            home, work = codex_home(tmp, bounded_url), tmp / "work"
            work.mkdir()
            (work / "notes.txt").write_text("The answer is 42.\n")
            env = {"PATH": os.environ["PATH"], "HOME": str(tmp), "CODEX_HOME": str(home), "NO_COLOR": "1",
                   "OPENAI_API_KEY": "sk-codex-session-not-a-real-key", "TMPDIR": str(tmp)}  # fmt: skip
            invoke = lambda prompt, first: _codex(home, work, env, codex, prompt, first)  # noqa: E731
            invocations, first, n_first = _drive(store, episode, turns, invoke, hunt)
        sidecar.stop()
    finally:
        factory.stop_all()
    installation = (home / "installation_id").read_text().strip()
    secrets = [installation, env["OPENAI_API_KEY"]]
    return Session(_recorded(store, episode, invocations), first, n_first, sidecar, secrets, home)


def claude_code_session(upstream: str, store: str, turns: int, tmp: Path, hunt: bool = True) -> Session:
    """Record one Claude Code conversation of at least ``turns`` calls (or as many as ``2 * turns`` invocations
    gave): ``claude -p``, then ``claude -p --continue``."""
    claude = installed_harness("claude-code")
    factory = SidecarFactory(tmp)
    episode = f"claude-code-session-{int(time.time())}"
    try:
        sidecar = factory(upstream, store=store, episode_id=episode)  # its defaults: --tokens-in auto
        work = tmp / "work"
        work.mkdir()
        (work / "notes.txt").write_text("The answer is 42.\n")
        env = claude_code_env(tmp, sidecar.url, CLAUDE_MAX_OUTPUT_TOKENS)

        def invoke(prompt: str, first: bool) -> subprocess.CompletedProcess:
            command = [claude, "-p", *([] if first else ["--continue"]), prompt, "--max-turns", "2",
                       "--dangerously-skip-permissions"]  # fmt: skip
            return _run("claude", command, work, env)

        invocations, first, n_first = _drive(store, episode, turns, invoke, hunt)
        sidecar.stop()
    finally:
        factory.stop_all()
    return Session(_recorded(store, episode, invocations), first, n_first, sidecar, [env["ANTHROPIC_API_KEY"]])


def served_tokens_in(calls: list[dict], upstream: str) -> list[tuple[dict, bool, float | None]]:
    """Each call served tokens-in: (call, its prompt ids are its parent's prompt + completion + vLLM's rendering of
    what was added, the median |teacher-forced - recorded| logprob of its completion ids in nats)."""
    by_id = {c["call_id"]: c for c in calls}
    out = []
    with httpx.Client(base_url=upstream, timeout=600) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        for call in (c for c in calls if c["continuation"] == "tokens_in"):
            parent = by_id[call["parent_call_id"]]
            whole, prompt = parent["prompt_token_ids"] + parent["completion_token_ids"], call["prompt_token_ids"]
            path, request = render_request(call, model)
            rendered = client.post(path, json=request)
            added = len(prompt) - len(whole)
            exact = (call["prefix_len"] == len(whole) and prompt[: len(whole)] == whole and added > 0
                     and prompt[len(whole) :] == rendered.json()["token_ids"][-added:])  # fmt: skip
            ids = call["completion_token_ids"]
            forced = client.post("/v1/completions", json={"model": model, "prompt": prompt + ids, "max_tokens": 1,
                                                          "prompt_logprobs": 0, "temperature": 0})  # fmt: skip
            positions = forced.json()["choices"][0]["prompt_logprobs"][len(prompt) :]
            recorded = zip(ids, call["completion_logprobs"], positions, strict=True)
            gaps = [abs(p[str(t)]["logprob"] - r) for t, r, p in recorded if not math.isnan(r)]
            if plain_temperature(call["sampling"]) != 1.0:  # prompt logprobs are raw: comparable at 1 only
                gaps = []
            out.append((call, exact, statistics.median(gaps) if gaps else None))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("harness", choices=["codex", "claude-code"])
    parser.add_argument("--turns", type=int, default=6, help="record at least this many calls")
    parser.add_argument("--store", required=True, help="a new folder: the session's records are kept there")
    parser.add_argument("--upstream", default="http://127.0.0.1:18000")
    args = parser.parse_args()
    store = str(Path(args.store).resolve())
    if Path(store).exists() and any(Path(store).iterdir()):
        parser.error(f"--store {store} is not empty: give a new folder (the figures are over the whole store)")
    with tempfile.TemporaryDirectory(prefix="forge-session-") as tmp:
        session = codex_session if args.harness == "codex" else claude_code_session
        calls = session(args.upstream, store, args.turns, Path(tmp)).calls
    for call, exact, gap in served_tokens_in(calls, args.upstream):
        shown = f"{gap:.2e}" if gap is not None else "none (no logprobs given)"
        print(f"call {call['seq']} served tokens-in: prompt = parent's prompt + completion + rendered suffix: "
              f"{'yes' if exact else 'NO'}; teacher-forced median |delta logprob| {shown} nat")  # fmt: skip
    forks(store, args.upstream)


if __name__ == "__main__":
    main()
