"""`forge sidecar` (mitmdump with the OpenForge addon, from the sidecar environment) and `forge reward`."""

import math
import os
import uuid
from datetime import UTC, datetime
from pathlib import Path

import click

from forge.errors import ForgeError
from forge.paths import repo_root
from sidecar.record import to_table
from sidecar.store import Store, StoreError, open_store

ADDON = Path(__file__).resolve().parent / "addon.py"


def sidecar_python_bin() -> Path:
    """The sidecar environment's bin folder: $FORGE_SIDECAR_VENV, else the checkout's .venv-sidecar."""
    return Path(os.environ.get("FORGE_SIDECAR_VENV") or repo_root() / ".venv-sidecar") / "bin"


def checked_store(uri: str, s3_endpoint: str | None) -> Store:
    try:
        return open_store(uri, s3_endpoint)
    except StoreError as error:
        raise ForgeError(str(error)) from error


def mitmdump_command(
    mode: str, listen_host: str, listen_port: int, upstream: str, store: str, wal_dir: Path, confdir: Path,
    episode_id: str | None, options: dict[str, object],
) -> list[str]:  # fmt: skip
    args = [
        str(sidecar_python_bin() / "mitmdump"), "-q", "-s", str(ADDON),
        "--mode", mode, "--listen-host", listen_host, "--listen-port", str(listen_port),
        "--set", f"confdir={confdir}",
        # Lazy: a model host is rerouted before any connection to it is tried (a pod may have no route to it).
        "--set", "connection_strategy=lazy",
        "--set", "flow_detail=0", "--set", "termlog_verbosity=warn",
        "--set", f"forge_upstream={upstream}", "--set", f"forge_store={store}", "--set", f"forge_wal_dir={wal_dir}",
    ]  # fmt: skip
    if episode_id:
        args += ["--set", f"forge_episode_id={episode_id}"]
    elif mode == "regular":
        args += ["--set", "proxyauth=any"]  # each client's proxy user name is its episode id
    for name, value in options.items():
        if value not in (None, ""):
            args += ["--set", f"forge_{name}={value}"]
    return args


@click.command("sidecar")
@click.option("--mode", default="regular", show_default=True, help="regular | reverse:URL | transparent")
@click.option("--listen-host", default="127.0.0.1", show_default=True)
@click.option("--listen-port", type=int, default=15001, show_default=True)
@click.option("--upstream", default="http://127.0.0.1:8000", show_default=True, help="The policy server (vLLM).")
@click.option("--store", default="./forge-data", show_default=True, help="Folder or s3://bucket/prefix.")
@click.option("--s3-endpoint", help="S3-compatible endpoint URL (credentials from AWS_* variables).")
@click.option("--wal-dir", type=click.Path(path_type=Path), help="Write-ahead log folder [default: ./forge-wal].")
@click.option("--episode-id", help="Episode of every call (else: proxy user name, X-Forge-Episode-Id, env).")
@click.option("--task-id")
@click.option("--run-id")
@click.option("--admin-port", type=int, default=0, help="Loopback port for POST /reward and GET /metrics.")
@click.option("--model-map", default="*", show_default=True, help="PATTERN[=MODEL],...: names served by MODEL.")
@click.option(
    "--model-hosts",
    default="api.openai.com,api.anthropic.com",
    show_default=True,
    help="Hosts whose model calls are taken (served by the policy).",
)
@click.option("--policy-version", help="Fixed policy version (default: the server's /weight_info).")
@click.option("--flush-seconds", type=float, default=5.0, show_default=True)
@click.option("--flush-rows", type=int, default=2000, show_default=True)
@click.option("--max-wal-bytes", type=int, default=4 << 30, show_default=True)
@click.option("--max-completion-tokens", type=int, default=0, help="Bound every completion (rollout length); 0: off.")
def sidecar_command(
    mode: str, listen_host: str, listen_port: int, upstream: str, store: str, s3_endpoint: str | None,
    wal_dir: Path | None, episode_id: str | None, task_id: str | None, run_id: str | None, admin_port: int,
    model_map: str, model_hosts: str, policy_version: str | None, flush_seconds: float, flush_rows: int,
    max_wal_bytes: int, max_completion_tokens: int,
) -> None:  # fmt: skip
    """Run the capture sidecar: serve model calls from the policy and record them token by token.

    Model calls (Chat Completions, Completions, Responses, Anthropic Messages to a model host, or to any host
    in reverse mode) go to --upstream with token ids and logprobs requested, and are recorded to --store;
    everything else passes through untouched and unrecorded. SIGTERM flushes all records before exiting.
    """
    if not (mode in ("regular", "transparent") or mode.startswith("reverse:")):
        raise ForgeError(f"unknown --mode {mode!r}: use regular, reverse:URL or transparent")
    checked_store(store, s3_endpoint)
    mitmdump = sidecar_python_bin() / "mitmdump"
    if not mitmdump.exists():
        raise ForgeError(f"no sidecar environment at {mitmdump.parent.parent}: run `make env`")
    wal = (wal_dir or Path("forge-wal")).resolve()
    confdir = wal / "mitmproxy"
    confdir.mkdir(parents=True, exist_ok=True)
    args = mitmdump_command(
        mode, listen_host, listen_port, upstream, store, wal, confdir, episode_id,
        {"task_id": task_id, "run_id": run_id, "admin_port": admin_port or None, "model_map": model_map,
         "model_hosts": model_hosts, "policy_version": policy_version, "s3_endpoint": s3_endpoint,
         "flush_seconds": flush_seconds, "flush_rows": flush_rows, "max_wal_bytes": max_wal_bytes,
         "max_completion_tokens": max_completion_tokens or None},
    )  # fmt: skip
    os.execv(args[0], args)  # mitmdump itself gets SIGTERM and flushes in its `done` hook


def parse_components(values: tuple[str, ...]) -> dict[str, float]:
    components = {}
    for item in values:
        name, sep, number = item.partition("=")
        try:
            components[name] = float(number)
        except ValueError:
            sep = ""
        if not sep or not name:
            raise ForgeError(f"--component {item!r}: write NAME=NUMBER")
    return components


@click.command("reward")
@click.option("--store", default="./forge-data", show_default=True, help="Folder or s3://bucket/prefix.")
@click.option("--s3-endpoint", help="S3-compatible endpoint URL.")
@click.option("--episode-id", required=True)
@click.option("--value", type=float, required=True, help="The reward.")
@click.option("--call-id", help="The call the reward is for (default: the whole episode).")
@click.option("--run-id", default="default", show_default=True)
@click.option("--component", multiple=True, help="NAME=NUMBER, repeatable: parts of the reward.")
@click.option("--source", default="cli", show_default=True)
def reward_command(
    store: str, s3_endpoint: str | None, episode_id: str, value: float, call_id: str | None, run_id: str,
    component: tuple[str, ...], source: str,
) -> None:  # fmt: skip
    """Record a reward for an episode (or one call) in the store, as a verifier would."""
    if not math.isfinite(value):
        raise ForgeError("--value must be a finite number")
    target = checked_store(store, s3_endpoint)
    now = datetime.now(UTC)
    row = {"episode_id": episode_id, "call_id": call_id, "reward": value, "source": source, "at": now,
           "components": list(parse_components(component).items()) or None}  # fmt: skip
    name = f"rewards/run={run_id}/date={now:%Y-%m-%d}/cli-{uuid.uuid4().hex}.parquet"
    try:
        path = target.write_parquet(name, to_table([row], "rewards"))
    except OSError as error:
        raise ForgeError(f"could not write to the store {store}: {error}") from error
    click.echo(path)


commands: list[click.Command] = [sidecar_command, reward_command]
