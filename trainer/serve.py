"""The policy server: vLLM (the CPU build here, `vllm` on GPUs) started with what OpenForge relies on.

Token ids and logprobs come with every OpenAI-style answer (`return_token_ids`, `logprobs`); tool calls are
parsed (hermes); LoRA adapters load at run time; the dev endpoints reload weights in place
(`/collective_rpc reload_weights`); `--enable-scale-out` adds tokens-in generation. The server runs in its own
environment (its transformers pin conflicts with veRL's), in its own process group, with its own TMPDIR and
cache folder, so stopping it leaves no engine process and no litter behind.
"""

import contextlib
import hashlib
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from forge.errors import ForgeError
from forge.paths import cache_dir, repo_root
from sidecar.policy import PolicyServerClient, PolicyServerError
from trainer.model import MARKER, MODEL_NAME, prepared_model

# SmolLM2's trained context. Past it vLLM needs VLLM_ALLOW_LONG_MAX_MODEL_LEN, and its rotary table must be
# sized to the longer length (max_position_embeddings): without that, a prompt past 8192 tokens reads past the
# table on CPU and every later answer has -inf logprobs (measured: one 9k-token Claude Code prompt broke the server).
NATIVE_CONTEXT = 8192
MAX_TMPDIR_LEN = 64  # + "/" + a 36-character uuid stays under a Unix socket path's 107 bytes


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def kv_cache_bytes_per_token(model: Path, dtype: str) -> int:
    """Keys and values of one token over every layer, as vLLM caches them (the model's config; ``auto``: its dtype)."""
    config = json.loads((model / "config.json").read_text())
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    dtype = dtype if dtype != "auto" else str(config.get("dtype") or config.get("torch_dtype") or "bfloat16")
    return 2 * config["num_hidden_layers"] * config.get("num_key_value_heads", heads) * head_dim * DTYPE_BYTES[dtype]


def kv_cache_gb_for(model: Path, dtype: str, max_model_len: int) -> int:
    """Whole GiB (vLLM's CPU KV cache is set in GiB) holding one request of ``max_model_len`` tokens with room to
    spare (a quarter more, at least 1 GiB): vLLM refuses to start when one request at the longest length cannot fit."""
    need = kv_cache_bytes_per_token(model, dtype) * max_model_len
    return max(1, math.ceil(need * 1.25 / 2**30))


# vLLM's refusal when one request at --max-model-len does not fit the KV cache (vllm/v1/core/kv_cache_utils.py)
_KV_TOO_SMALL = re.compile(r"\(([\d.]+) GiB KV cache is needed, which is larger than the available KV cache memory "
                           r"\(([\d.]+) GiB\)")  # fmt: skip


def default_dtype() -> str:
    """vLLM's ``--dtype``: ``auto`` on GPUs, ``float32`` on every CPU.

    Fidelity decides it: the trainer computes in fp32, and a bf16 server's sampled logprobs differ from the
    trainer's by ~0.05 nat median on every token even where bf16 is native (AMX/avx512_bf16), and by nats where it
    is emulated (AVX2, also 4.6x slower on a long prefill). SmolLM2-135M in fp32 is cheap on a CPU.
    """
    return "auto" if Path("/dev/nvidiactl").exists() else "float32"


def default_checkpoint(dtype: str | None = None) -> Path:
    """The prepared checkpoint for a serving dtype (default: ``default_dtype()``): fp32 weights for fp32 serving
    (no bf16 rounding), else bf16."""
    return prepared_model().dir_for("fp32" if (dtype or default_dtype()) == "float32" else "bf16")


def policy_python() -> Path:
    """The policy server environment's interpreter: $FORGE_POLICY_PYTHON, else the checkout's .venv-policy."""
    if env := os.environ.get("FORGE_POLICY_PYTHON"):
        return Path(env)
    return repo_root() / ".venv-policy" / "bin" / "python"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def check_port_free(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: TIME_WAIT is not "in use"
        try:
            s.bind((host, port))
        except OSError as error:
            raise ForgeError(f"port {port} on {host} is already in use: pick another with --port") from error


def check_model_dir(model: Path) -> None:
    if not model.is_dir():
        raise ForgeError(
            f"no model folder at {model}: pass an HF checkpoint folder with --model, or run `forge model prepare`"
        )
    if not (model / "config.json").is_file():
        raise ForgeError(f"{model} is not an HF checkpoint folder (no config.json): pass one with --model")


def default_served_name(model: Path) -> str:
    return MODEL_NAME if (model / MARKER).is_file() else model.name


@dataclass
class PolicyServer:
    """One vLLM OpenAI-compatible server process; a context manager that starts and stops it."""

    model: Path
    port: int = 8000
    host: str = "127.0.0.1"
    max_model_len: int = 4096
    served_model_name: str | None = None
    extra_args: list[str] = field(default_factory=list)
    kv_cache_gb: int | None = None  # CPU KV cache in GiB; None: sized for max_model_len (kv_cache_gb_for)
    enforce_eager: bool = True
    python: Path | None = None
    run_dir: Path | None = None
    start_timeout: float = 300.0
    dtype: str = field(default_factory=default_dtype)
    process: subprocess.Popen | None = field(default=None, init=False, repr=False)

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def openai_url(self) -> str:
        return f"{self.base_url}/v1"

    @property
    def name(self) -> str:
        return self.served_model_name or default_served_name(self.model)

    @property
    def log_path(self) -> Path:
        assert self.run_dir is not None
        return self.run_dir / "vllm.log"

    def command(self) -> list[str]:
        python = self.python or policy_python()
        args = [
            str(python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model),
            "--served-model-name", self.name,
            "--host", self.host,
            "--port", str(self.port),
            "--max-model-len", str(self.max_model_len),
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
            "--enable-lora", "--max-lora-rank", "8",
            "--enable-scale-out",
            # Each sampled token's logprob under the distribution it was drawn from (temperature, truncation,
            # processors applied: collector.sampling); at temperature 1 with nothing else (the publish probe): raw.
            "--logprobs-mode", "processed_logprobs",
            # A parameter a call does not send takes vLLM's neutral default, not the model's generation config (a
            # top_p there would shape every call without the record saying so).
            "--generation-config", "vllm",
            "--disable-uvicorn-access-log",
        ]  # fmt: skip
        if self.enforce_eager:
            args.append("--enforce-eager")
        if self.dtype != "auto":
            args += ["--dtype", self.dtype]
        if self.max_model_len > NATIVE_CONTEXT:
            args += ["--hf-overrides", json.dumps({"max_position_embeddings": self.max_model_len})]
        return args + list(self.extra_args)

    def environment(self) -> dict[str, str]:
        assert self.run_dir is not None
        env = dict(os.environ)
        env.update(
            TMPDIR=str(self.tmp_dir),
            VLLM_CACHE_ROOT=str(self.run_dir / "vllm-cache"),
            VLLM_CPU_KVCACHE_SPACE=str(self.kv_cache_space),
            VLLM_SERVER_DEV_MODE="1",
            VLLM_ALLOW_RUNTIME_LORA_UPDATING="True",
            VLLM_NO_USAGE_STATS="1",
            VLLM_DO_NOT_TRACK="1",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
        )
        if self.max_model_len > NATIVE_CONTEXT:
            env["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
        return env

    def start(self, timeout: float | None = None) -> "PolicyServer":
        """Start vLLM and wait until it answers `/v1/models`; on failure, stop it and say why (with its log)."""
        self.launch()
        return self.wait_ready(timeout)

    def launch(self) -> None:
        """Start the vLLM process, not waiting for it. From the thread that outlives it: the process is told to
        stop when the thread that started it ends (PR_SET_PDEATHSIG is per thread)."""
        python = self.python or policy_python()
        check_model_dir(self.model)
        check_port_free(self.host, self.port)
        if not python.exists():
            raise ForgeError(f"no policy server environment at {python}: run `make env` (or set FORGE_POLICY_PYTHON)")
        if self.run_dir is None:
            self.run_dir = cache_dir() / "runs" / f"serve-{time.strftime('%Y%m%d-%H%M%S')}-{self.port}"
        (self.run_dir / "tmp").mkdir(parents=True, exist_ok=True)
        self.tmp_dir.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                self.command(), env=self.environment(), stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,  # own process group: stop() reaches the engine
                preexec_fn=_terminate_with_parent,
            )  # fmt: skip

    def wait_ready(self, timeout: float | None = None) -> "PolicyServer":
        """Wait until the launched server answers `/v1/models`; on failure, stop it and say why (with its log)."""
        assert self.process is not None
        timeout = timeout or self.start_timeout
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                code = self.process.returncode
                self.stop()
                raise self.failure(f"vLLM exited with code {code} while starting")
            if self.ready():
                return self
            time.sleep(0.5)
        self.stop()
        raise self.failure(f"vLLM did not answer within {timeout:.0f} s")

    def ready(self) -> bool:
        try:
            with contextlib.closing(PolicyServerClient(self.base_url, timeout=2, connect_timeout=2)) as client:
                models = client.get("/v1/models")
        except PolicyServerError:
            return False
        return isinstance(models, dict) and bool(models.get("data"))

    @property
    def kv_cache_space(self) -> int:
        if self.kv_cache_gb is not None:
            return self.kv_cache_gb
        try:
            return kv_cache_gb_for(self.model, self.dtype, self.max_model_len)
        except (OSError, ValueError, KeyError, TypeError):  # a config we cannot read: vLLM's own check decides
            return 1

    def failure(self, what: str) -> ForgeError:
        """Why the server did not start, in one line where the cause is known, else with its log's last lines."""
        log = self.log_path.read_text(errors="replace") if self.run_dir and self.log_path.exists() else ""
        if match := _KV_TOO_SMALL.search(log):
            need = math.ceil(float(match.group(1)))
            return ForgeError(f"{what}: one request of --max-model-len {self.max_model_len} needs {match.group(1)} GiB "
                              f"of KV cache, {match.group(2)} GiB was given: pass --kv-cache-gb {need} or more, or a "
                              f"smaller --max-model-len (log: {self.log_path})")  # fmt: skip
        return ForgeError(f"{what}; its log ({self.log_path}) ends:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        if self.run_dir is None or not self.log_path.exists():
            return "(no log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the whole process group (API server and engine core), SIGKILL what is left after ``timeout``."""
        process, self.process = self.process, None
        if process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout)
            _kill_group(process.pid, timeout=5.0)
            process.wait()
        if self.run_dir is not None:
            shutil.rmtree(self.tmp_dir, ignore_errors=True)
            for scratch in ("tmp", "vllm-cache"):
                shutil.rmtree(self.run_dir / scratch, ignore_errors=True)

    @property
    def tmp_dir(self) -> Path:
        """The server's TMPDIR: the run folder's tmp/, or a short folder in the system's when that path is long —
        vLLM puts ZMQ IPC sockets there (ipc://TMPDIR/<uuid>), and a socket path is at most 107 bytes."""
        assert self.run_dir is not None
        own = self.run_dir / "tmp"
        if len(str(own)) <= MAX_TMPDIR_LEN:
            return own
        digest = hashlib.sha256(str(own).encode()).hexdigest()[:12]
        return Path(tempfile.gettempdir()) / f"forge-vllm-{digest}"

    def __enter__(self) -> "PolicyServer":
        return self.start() if self.process is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_together(servers: list[PolicyServer]) -> None:
    """Start several servers at once (their start-ups overlap), from this thread; on a failure, stop them all."""
    try:
        for server in servers:
            server.launch()
        for server in servers:
            server.wait_ready()
    except BaseException:
        for server in servers:
            server.stop()
        raise


def _terminate_with_parent() -> None:
    """In the child before exec: SIGTERM it when the process that started it dies, even by SIGKILL (an OOM kill
    of `forge demo` must not leave a 3 GB vLLM behind); vLLM's API server then stops its engine."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG (Linux)


def _kill_group(pgid: int, timeout: float) -> None:
    """Wait for the group's other members (engine processes) to exit after SIGTERM; SIGKILL them if they don't."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def run_until_signalled(server: PolicyServer, echo=print) -> int:
    """Run ``server`` in the foreground until SIGINT/SIGTERM (then stop it cleanly) or until it dies."""

    def on_signal(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    # Both signals explicitly: a process started in the background of a script inherits SIGINT ignored.
    previous = {signum: signal.signal(signum, on_signal) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.start()
        echo(f"policy server ready: {server.openai_url} (model {server.name}; log {server.log_path})")
        sys.stdout.flush()
        assert server.process is not None
        code = server.process.wait()
        echo(f"forge: vLLM exited with code {code}; its log:\n{server.log_tail()}")
        server.stop()
        return code or 1
    except KeyboardInterrupt:
        echo("stopping the policy server")
        server.stop()
        return 0
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
