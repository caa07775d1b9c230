"""`forge serve` as a user runs it: clear one-line failures, and a clean stop that leaves no engine behind."""

import contextlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from trainer.serve import PolicyServer, default_checkpoint, default_dtype, free_port, kv_cache_gb_for

FORGE = str(Path(sys.executable).parent / "forge")


def run_forge(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([FORGE, *args], capture_output=True, text=True, timeout=timeout)


def test_the_server_command_has_what_openforge_needs(tmp_path):
    args = PolicyServer(model=tmp_path, port=1234, extra_args=["--seed", "3"]).command()
    for flag in ("--enable-auto-tool-choice", "--enable-lora", "--enable-scale-out", "--enforce-eager"):
        assert flag in args
    assert args[args.index("--tool-call-parser") + 1] == "hermes"
    assert args[-2:] == ["--seed", "3"]  # passed through after `--`, unchanged and last


def test_long_contexts_are_allowed_past_the_native_length(tmp_path):
    short = PolicyServer(model=tmp_path, run_dir=tmp_path, max_model_len=4096).environment()
    long = PolicyServer(model=tmp_path, run_dir=tmp_path, max_model_len=16384).environment()
    assert "VLLM_ALLOW_LONG_MAX_MODEL_LEN" not in short and long["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] == "1"
    overrides = PolicyServer(model=tmp_path, run_dir=tmp_path, max_model_len=16384).command()
    assert json.loads(overrides[overrides.index("--hf-overrides") + 1]) == {"max_position_embeddings": 16384}
    assert "--hf-overrides" not in PolicyServer(model=tmp_path, run_dir=tmp_path, max_model_len=4096).command()
    assert long["TMPDIR"] == str(PolicyServer(model=tmp_path, run_dir=tmp_path).tmp_dir)  # its own folder
    assert long["VLLM_SERVER_DEV_MODE"] == "1"


def test_the_dtype_is_fp32_on_every_cpu_native_bf16_or_not_and_passed_to_vllm(tmp_path):
    # fp32 whatever the CPU's flags: on a machine with native bf16 the suite was flaky at the bf16 logprob bound.
    assert default_dtype() == ("auto" if Path("/dev/nvidiactl").exists() else "float32")
    assert default_checkpoint("float32").name == "fp32" and default_checkpoint("auto").name == "bf16"
    args = PolicyServer(model=tmp_path, dtype="float32").command()
    assert args[args.index("--dtype") + 1] == "float32"
    assert "--dtype" not in PolicyServer(model=tmp_path, dtype="auto").command()


def test_a_missing_model_folder_fails_at_once_in_one_line(tmp_path):
    started = time.monotonic()
    result = run_forge("serve", "--model", str(tmp_path / "missing"), "--port", str(free_port()))
    assert time.monotonic() - started < 15
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "no model folder" in result.stderr and "Traceback" not in result.stderr


def test_a_port_in_use_fails_at_once_in_one_line(prepared_model):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_forge("serve", "--model", str(prepared_model.serve_dir), "--port", str(port))
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and f"port {port}" in result.stderr and "already in use" in result.stderr


def test_the_kv_cache_is_sized_for_the_longest_request(prepared_model):
    # SmolLM2-135M: 30 layers x 3 KV heads x 64 dims, keys and values: 45 KiB a token in fp32, 22.5 KiB in bf16
    assert kv_cache_gb_for(prepared_model.train_dir, "float32", 4096) == 1
    assert kv_cache_gb_for(prepared_model.train_dir, "float32", 32768) == 2  # 1.41 GiB: vLLM refuses 1
    assert kv_cache_gb_for(prepared_model.serve_dir, "auto", 32768) == 1  # the bf16 checkpoint's own dtype
    assert PolicyServer(model=prepared_model.train_dir, dtype="float32", max_model_len=32768, kv_cache_gb=3,
                        run_dir=Path("/tmp/r")).environment()["VLLM_CPU_KVCACHE_SPACE"] == "3"  # fmt: skip


@pytest.mark.integration
def test_a_kv_cache_too_small_for_the_max_model_len_is_one_line_saying_what_to_pass(prepared_model):
    """vLLM's own refusal (a 40-line traceback before) read into one line; the size it says it needs is what the
    default would have given."""
    result = run_forge("serve", "--model", str(prepared_model.serve_dir), "--port", str(free_port()),
                       "--max-model-len", "32768", "--kv-cache-gb", "1", timeout=300)  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    assert "pass --kv-cache-gb 2 or more" in result.stderr, result.stderr
    needed = float(result.stderr.split(" needs ")[1].split(" GiB")[0])
    assert 1 < needed <= kv_cache_gb_for(prepared_model.serve_dir, default_dtype(), 32768)


def processes() -> list[tuple[int, str, int, int]]:
    """(pid, state, ppid, pgid) of every process, from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            found.append((int(entry.name), fields[0], int(fields[1]), int(fields[2])))
    return found


def children(pid: int) -> list[int]:
    return [child for child, _, ppid, _ in processes() if ppid == pid]


def group_members(pgid: int) -> list[int]:
    return [pid for pid, state, _, group in processes() if group == pgid and state != "Z"]


@pytest.mark.integration
# SIGTERM only: SIGINT goes to the same handler (trainer/serve.py registers one for both); a second vLLM start for
# it cost the suite a minute (issue 25).
@pytest.mark.parametrize("signum", [signal.SIGTERM], ids=["SIGTERM"])
def test_serve_prints_its_url_and_stops_cleanly_on_a_signal(prepared_model, signum):
    """At a 32k context, whose KV cache the old default of 1 GiB could not hold: the default is sized for it."""
    port = free_port()
    process = subprocess.Popen(
        [FORGE, "serve", "--model", str(prepared_model.serve_dir), "--port", str(port), "--max-model-len", "32768"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    lines: queue.Queue[str] = queue.Queue()

    def read_lines() -> None:
        for line in process.stdout or []:
            lines.put(line)

    threading.Thread(target=read_lines, daemon=True).start()
    engine_group = None
    try:
        deadline = time.monotonic() + 300
        ready = ""
        while not ready and time.monotonic() < deadline:
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                assert process.poll() is None, "forge serve exited before it was ready"
                continue
            ready = line if "policy server ready" in line else ""
        assert f"http://127.0.0.1:{port}/v1" in ready
        (engine_group,) = children(process.pid)  # the vLLM API server leads its own process group
        assert len(group_members(engine_group)) >= 2, "expected the API server and its engine core"
        process.send_signal(signum)
        assert process.wait(timeout=60) == 0
        assert group_members(engine_group) == [], "engine processes outlived forge serve"
    finally:
        if process.poll() is None:
            process.kill()
        if engine_group is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(engine_group, signal.SIGKILL)


def test_a_deep_run_folder_gets_a_short_tmpdir_for_vllms_sockets(tmp_path):
    """vLLM puts ZMQ IPC sockets in TMPDIR (ipc://TMPDIR/<36-char uuid>); a Unix socket path is at most 107 bytes: a
    run folder deep in pytest's tmp (or a user's --out) failed `forge demo` with a ZMQError before this."""
    from trainer.serve import PolicyServer

    deep = tmp_path / ("x" * 80) / "policy-server"
    server = PolicyServer(model=tmp_path, run_dir=deep)
    tmpdir = server.environment()["TMPDIR"]
    assert len(tmpdir) + 1 + 36 < 107 and not tmpdir.startswith(str(deep))
    shallow = PolicyServer(model=tmp_path, run_dir=Path("/tmp/r"))
    assert shallow.environment()["TMPDIR"] == "/tmp/r/tmp"
