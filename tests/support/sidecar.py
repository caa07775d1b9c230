"""The real sidecar (`forge sidecar`: mitmdump with the addon, from the sidecar env) as the tests and benchmarks
start it, and what they read back from its store."""

import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from collector.sampling import plain_temperature
from trainer.serve import free_port

FORGE = str(Path(sys.executable).parent / "forge")
START_TIMEOUT_S = 30.0
# Teacher-forcing a harness prompt computes prompt logprobs over every prompt position (prefix cache off): a
# 9k-token Claude Code prompt takes minutes on one CPU core.
FORCED_TIMEOUT_S = 600.0


@dataclass
class Sidecar:
    process: subprocess.Popen
    port: int
    admin_port: int
    store: str
    wal_dir: Path
    log_path: Path
    args: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.admin_port}/metrics", timeout=5) as answer:
            lines = answer.read().decode().splitlines()
        return {
            name.removeprefix("forge_sidecar_"): float(value) for name, value in (line.rsplit(" ", 1) for line in lines)
        }

    def reward_token(self) -> str:
        """The token the sidecar wrote (no --reward-token-file given): what a verifier reads."""
        return (self.wal_dir / "reward-token").read_text().strip()

    def post_admin(self, path: str, payload: object, token: str | None = "") -> tuple[int, dict]:
        """POST to the admin endpoint with the sidecar's reward token ("": the one it wrote; None: none)."""
        headers = {"authorization": f"Bearer {token or self.reward_token()}"} if token is not None else {}
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.admin_port}{path}",
            data=json.dumps(payload).encode(),
            method="POST",
            headers=headers,
        )
        try:
            with urllib.request.urlopen(request, timeout=5) as answer:
                return answer.status, json.load(answer)
        except urllib.error.HTTPError as error:
            return error.code, json.load(error)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, timeout: float = 30.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def kill9(self) -> None:
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait()


class SidecarFactory:
    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.started: list[Sidecar] = []

    def __call__(
        self, upstream: str, *, mode: str = "reverse", store: str | None = None, wal_dir: Path | None = None,
        port: int | None = None, extra: tuple[str, ...] = (), env: dict[str, str] | None = None,
        episode_id: str | None = "episode-1",
    ) -> Sidecar:  # fmt: skip
        n = len(self.started)
        store = store or str(self.tmp_path / "store")
        wal_dir = wal_dir or self.tmp_path / f"wal-{n}"
        port, admin_port = port or free_port(), free_port()
        args = [
            FORGE, "sidecar", "--mode", f"reverse:{upstream}" if mode == "reverse" else mode,
            "--listen-port", str(port), "--upstream", upstream, "--store", store, "--wal-dir", str(wal_dir),
            "--admin-port", str(admin_port), "--flush-seconds", "0.3", *extra,
        ]  # fmt: skip
        if episode_id:
            args += ["--episode-id", episode_id]
        log_path = self.tmp_path / f"sidecar-{n}.log"
        with log_path.open("ab") as log:
            process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        sidecar = Sidecar(process, port, admin_port, store, wal_dir, log_path, args)
        self.started.append(sidecar)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if process.poll() is not None:
                pytest.fail(f"forge sidecar exited with {process.returncode}:\n{sidecar.log()}")
            try:
                sidecar.metrics()
                return sidecar
            except OSError:
                time.sleep(0.1)
        sidecar.stop()
        pytest.fail(f"forge sidecar did not start within {START_TIMEOUT_S} s:\n{sidecar.log()}")

    def stop_all(self) -> None:
        for sidecar in self.started:
            sidecar.stop()


def wait_for(condition, timeout: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def read_calls(store: str, where: str = "true", s3_endpoint: str | None = None) -> list[dict]:
    """The calls view (whole prompts rebuilt) as dicts, ordered by episode and seq."""
    from collector.sql import connect

    con = connect(store, s3_endpoint)
    return con.execute(f"SELECT * FROM calls WHERE {where} ORDER BY episode_id, seq").arrow().read_all().to_pylist()


def stored_strings(store: str) -> Iterator[tuple[str, str]]:
    """Every string a local store's Parquet files hold, decoded (a grep of the files' bytes sees only zstd
    pages): (where, text) for each string value of every column, and for JSON text also each string inside it."""
    import pyarrow.parquet as pq

    for path in sorted(Path(store).rglob("*.parquet")):
        table = pq.read_table(path)
        for name in table.column_names:
            for value in table.column(name).to_pylist():
                yield from _strings(f"{path.name}:{name}", value)


def _strings(where: str, value: object) -> Iterator[tuple[str, str]]:
    if isinstance(value, str):
        yield where, value
        if value[:1] in ("{", "["):
            try:
                decoded = json.loads(value)
            except ValueError:
                return
            yield from _strings(f"{where} (decoded JSON)", decoded)
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _strings(where, key)
            yield from _strings(where, item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _strings(where, item)


def assert_no_secret_anywhere(sidecar: "Sidecar", secrets: list[str]) -> None:
    """No secret in any decoded string of the store, in the sidecar's log, or in the WAL folder. The WAL is SQLite:
    its pages and journal hold each row's text uncompressed (a flushed row's too, until its page is reused), so
    a byte search there sees every record the sidecar ever logged."""
    found = [
        (where, secret) for where, text in stored_strings(sidecar.store) for secret in secrets if secret in text
    ]  # fmt: skip
    log = sidecar.log()
    found += [("log", secret) for secret in secrets if secret in log]
    for path in sidecar.wal_dir.rglob("*"):
        if path.is_file() and path.name != "reward-token":
            data = path.read_bytes()
            found += [(str(path), secret) for secret in secrets if secret.encode() in data]
    assert not found, f"secrets found: {found[:20]}"


def assert_sampled_by_vllm(vllm, policy_server, call: dict) -> None:
    """The completion ids of a sampled (not greedy) call are the ones vLLM sampled: teacher-forcing them after the
    prompt gives vLLM's logprob of each equal to the recorded behaviour logprob. Served in fp32 (the default on this
    CPU) prefill and step-by-step decoding agree within 2e-5 nat (measured on Codex and Claude Code calls); in bf16
    within a few hundredths, with outliers of several nats. A wrong id differs by whole nats.
    (NaN: vLLM gave no logprob for that id; the record's note says so.)"""
    assert_all_sampled_by_vllm(vllm, policy_server, [call])


def assert_all_sampled_by_vllm(vllm, policy_server, calls: list[dict]) -> None:
    """``assert_sampled_by_vllm`` for each call, with one teacher-forcing request per chain: a call whose prompt +
    completion begins a longer call's is checked at its positions inside that call's request. vLLM prefills every
    prompt that asks for prompt_logprobs in full, so a six-call harness session costs one 8k-token prefill, not six."""
    carriers: list[list[int]] = []
    carried: dict[int, int] = {}  # call index → carrier index
    wholes = [list(c["prompt_token_ids"]) + list(c["completion_token_ids"]) for c in calls]
    for i in sorted(range(len(calls)), key=lambda i: -len(wholes[i])):
        whole = wholes[i]
        home = next((c for c, ids in enumerate(carriers) if ids[: len(whole)] == whole), None)
        if home is None:
            carriers.append(whole)
            home = len(carriers) - 1
        carried[i] = home
    forced = [_prompt_logprobs(vllm, policy_server, ids) for ids in carriers]
    for i, call in enumerate(calls):
        start = len(call["prompt_token_ids"])
        _assert_forced(policy_server, call, forced[carried[i]][start : start + len(call["completion_token_ids"])])


def _prompt_logprobs(vllm, policy_server, ids: list[int]) -> list[dict]:
    answer = vllm.post("/v1/completions", timeout=FORCED_TIMEOUT_S, json={
        "model": policy_server.name, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 0,
    }).json()  # fmt: skip
    assert "choices" in answer, f"teacher forcing failed: {answer}"
    return answer["choices"][0]["prompt_logprobs"]


def _assert_forced(policy_server, call: dict, forced: list[dict]) -> None:
    ids = call["completion_token_ids"]
    # The recorded logprobs are the sampling distribution's (forge serve: processed); vLLM's prompt logprobs are
    # raw (temperature 1, nothing applied): the two agree for a call sampled at a plain temperature 1.
    assert plain_temperature(call["sampling"]) == 1.0, f"not sampled at a plain temperature 1: {call['sampling']}"
    gaps = [
        abs(position[str(token)]["logprob"] - recorded)
        for token, recorded, position in zip(ids, call["completion_logprobs"], forced, strict=True)
        if not math.isnan(recorded)
    ]
    assert call["n_unknown_logprobs"] == len(ids) - len(gaps)
    if not gaps:  # vLLM gave none (a Responses answer that is only a function call): said, never hidden
        assert call["note"] and "NaN" in call["note"], call["note"]
        return
    median_limit, max_limit = (1e-3, 1e-2) if policy_server.dtype == "float32" else (0.05, 5.0)
    assert statistics.median(gaps) < median_limit and max(gaps) < max_limit, (call["call_id"], gaps)


def call_table(calls: list[dict]) -> str:
    """One line per call: what a failed harness test prints, so every call's fate is seen at once."""
    lines = [f"{'seq':>3}  {'status':<14} {'finish':<10} {'prompt':>6} {'ids':>4} {'NaN':>4}  error / note"]
    for c in calls:
        lines.append(
            f"{c['seq']:>3}  {c['status']:<14} {c['finish_reason']!s:<10} {c['prompt_len'] or 0:>6} "
            f"{len(c['completion_token_ids'] or []):>4} {c['n_unknown_logprobs'] or 0:>4}  "
            f"{(c['error'] or c['note'] or '')[:160]}"
        )
    return "\n".join(lines)
