"""`forge sidecar` (mitmdump with the OpenForge addon, from the sidecar environment) and `forge reward`."""

import json
import math
import os
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import click

from forge.errors import ForgeError
from forge.paths import repo_root
from sidecar import ca, netinit
from sidecar.admin import TokenFileError, read_token_file
from sidecar.record import reward_row, to_table
from sidecar.replicas import UpstreamError, parse_upstreams
from sidecar.settings import BY_NAME
from sidecar.store import Store, StoreError, open_store

ADDON = Path(__file__).resolve().parent / "addon.py"
F = TypeVar("F", bound=Callable[..., Any])


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
    episode_id: str | None, options: dict[str, object], mitmproxy_options: dict[str, str] | None = None,
) -> list[str]:  # fmt: skip
    args = [
        str(sidecar_python_bin() / "mitmdump"), "-s", str(ADDON),
        "--mode", mode, "--listen-host", listen_host, "--listen-port", str(listen_port),
        "--set", f"confdir={confdir}",
        # Lazy: a model host is rerouted before any connection to it is tried (a pod may have no route to it).
        "--set", "connection_strategy=lazy",
        # Warnings and errors (not -q: it would override this with "error" after the --set options are read).
        "--set", "flow_detail=0", "--set", "termlog_verbosity=warn",
        # No mitm.it page (the CA travels by `forge ca` and the injector): its hook then leaves every call alone.
        "--set", "onboarding=false",
        "--set", f"forge_upstream={upstream}", "--set", f"forge_store={store}", "--set", f"forge_wal_dir={wal_dir}",
    ]  # fmt: skip
    if episode_id:
        args += ["--set", f"forge_episode_id={episode_id}"]
    elif mode == "regular":
        args += ["--set", "proxyauth=any"]  # each client's proxy user name is its episode id
    for name, value in options.items():
        if value not in (None, ""):
            args += ["--set", f"forge_{name}={value}"]
    for name, value in (mitmproxy_options or {}).items():
        args += ["--set", f"{name}={value}"]
    return args


def sidecar_option(name: str, **overrides: Any) -> Callable[[F], F]:
    """`forge sidecar`'s click option for one of the sidecar's options (``sidecar.settings.OPTIONS``: its help, its
    default, its choices), as the addon declares it to mitmproxy."""
    option = BY_NAME[name]
    kwargs: dict[str, Any] = {"help": option.help}
    if option.kind is bool:
        kwargs["is_flag"] = True
    else:
        kwargs["type"] = click.Choice(option.choices) if option.choices else option.kind
        if option.default not in ("", None):
            kwargs |= {"default": option.default, "show_default": True}
    return click.option("--" + name.replace("_", "-"), **(kwargs | overrides))


def upstream_trust(confdir: Path, extra_cas: tuple[Path, ...]) -> dict[str, str]:
    """Extra CAs to verify upstream servers with: the system CAs plus them, in one bundle (verification stays on)."""
    if not extra_cas:
        return {}
    parts = [ca.SYSTEM_BUNDLE.read_bytes()] if ca.SYSTEM_BUNDLE.exists() else []
    for path in extra_cas:
        try:
            parts.append(path.read_bytes())
        except OSError as error:
            raise ForgeError(f"--upstream-ca {path}: {error.strerror}") from error
    bundle = confdir / "upstream-ca-bundle.pem"
    bundle.write_bytes(b"\n".join(p.rstrip(b"\n") for p in parts) + b"\n")
    bundle.chmod(0o644)
    return {"ssl_verify_upstream_trusted_ca": str(bundle)}


@click.command("sidecar", short_help="Run the capture sidecar.")
@click.option("--mode", default="regular", show_default=True, help="regular | reverse:URL | transparent")
@click.option("--listen-host", help="[default: 127.0.0.1; transparent: all addresses, so ::1 too]")
@click.option("--listen-port", type=int, default=15001, show_default=True)
@sidecar_option("upstream", multiple=True, default=[BY_NAME["upstream"].default])
@sidecar_option("health_seconds", type=click.FloatRange(min=0.1))
@sidecar_option("store")
@sidecar_option("s3_endpoint")
@sidecar_option("wal_dir", type=click.Path(path_type=Path), default=None,
                help=BY_NAME["wal_dir"].help + " [default: ./forge-wal]")  # fmt: skip
@sidecar_option("episode_id")
@sidecar_option("task_id")
@sidecar_option("run_id")
@sidecar_option("admin_port")
@sidecar_option("reward_token_file", type=click.Path(path_type=Path, dir_okay=False))
@sidecar_option("reward_socket", type=click.Path(path_type=Path, dir_okay=False))
@sidecar_option("trust_episode_header")
@sidecar_option("policy_model")
@sidecar_option("model_map")
@sidecar_option("model_hosts")
@sidecar_option("policy_version")
@sidecar_option("flush_seconds")
@sidecar_option("flush_rows")
@sidecar_option("max_wal_bytes")
@sidecar_option("fsync")
@sidecar_option("drain_seconds")
@sidecar_option("tokens_in")
@sidecar_option("max_completion_tokens")
@click.option("--ca-dir", type=click.Path(path_type=Path, file_okay=False),
              help="The CA to sign model hosts with (`forge ca init --dir`) [default: WAL_DIR/mitmproxy].")  # fmt: skip
@click.option("--upstream-ca", type=click.Path(path_type=Path, dir_okay=False), multiple=True,
              help="Extra CA (PEM) to verify upstream servers with, besides the system CAs; repeatable.")  # fmt: skip
@click.option("--print-command", is_flag=True, hidden=True, help="Print mitmdump's command line (JSON), run nothing.")
def sidecar_command(
    mode: str, listen_host: str | None, listen_port: int, upstream: tuple[str, ...], health_seconds: float, store: str,
    s3_endpoint: str | None, wal_dir: Path | None, episode_id: str | None, task_id: str | None,
    run_id: str | None, admin_port: int, reward_token_file: Path | None, reward_socket: Path | None,
    trust_episode_header: bool, policy_model: str | None, model_map: str,
    model_hosts: str,
    policy_version: str | None, flush_seconds: float, flush_rows: int, max_wal_bytes: int, fsync: str,
    drain_seconds: float, tokens_in: str, max_completion_tokens: int, ca_dir: Path | None,
    upstream_ca: tuple[Path, ...], print_command: bool,
) -> None:  # fmt: skip
    """Run the capture sidecar: serve model calls from the policy and record them token by token.

    Model calls (Chat Completions, Completions, Responses, Anthropic Messages to a model host, or to any host
    in reverse mode) go to --upstream with token ids and logprobs requested, and are recorded to --store;
    everything else passes through untouched and unrecorded. SIGTERM waits up to --drain-seconds for calls in
    flight and flushes every record before exiting; it exits 3 when records had to stay in the WAL.

    --mode transparent (behind `forge net-init`): the original destination comes from the redirect; TLS is
    opened only for model hosts (by SNI, certificates from --ca-dir), everything else passes through untouched.
    """
    if not (mode in ("regular", "transparent") or mode.startswith("reverse:")):
        raise ForgeError(f"unknown --mode {mode!r}: use regular, reverse:URL or transparent")
    checked_store(store, s3_endpoint)
    try:
        upstreams = ",".join(u.url if not u.dns else f"dns+{u.url}" for u in parse_upstreams(upstream))
    except UpstreamError as error:
        raise ForgeError(str(error)) from error
    if reward_token_file:
        try:
            read_token_file(reward_token_file)
        except TokenFileError as error:
            raise ForgeError(str(error)) from error
        reward_token_file = reward_token_file.resolve()
    mitmdump = sidecar_python_bin() / "mitmdump"
    if not mitmdump.exists():
        raise ForgeError(f"no sidecar environment at {mitmdump.parent.parent}: run `make env`")
    wal = (wal_dir or Path("forge-wal")).resolve()
    confdir = ca_dir.resolve() if ca_dir else wal / "mitmproxy"
    if ca_dir and not (confdir / ca.CA_FILE).exists():
        raise ForgeError(f"no CA in {confdir}: run `forge ca init --dir {ca_dir}` first")
    wal.mkdir(mode=0o700, parents=True, exist_ok=True)  # records and the reward token: the sidecar's uid only
    confdir.mkdir(parents=True, exist_ok=True)
    transparent = mode == "transparent"
    if listen_host is None:
        listen_host = "" if transparent else "127.0.0.1"  # REDIRECT sends IPv4 to 127.0.0.1 and IPv6 to ::1
    args = mitmdump_command(
        mode, listen_host, listen_port, upstreams, store, wal, confdir, episode_id,
        {"task_id": task_id, "run_id": run_id, "admin_port": admin_port or None, "model_map": model_map,
         "policy_model": policy_model, "reward_socket": reward_socket.resolve() if reward_socket else None,
         "reward_token_file": reward_token_file, "trust_episode_header": "true" if trust_episode_header else None,
         "model_hosts": model_hosts, "policy_version": policy_version, "s3_endpoint": s3_endpoint,
         "flush_seconds": flush_seconds, "flush_rows": flush_rows, "max_wal_bytes": max_wal_bytes,
         "fsync": fsync, "drain_seconds": drain_seconds, "health_seconds": health_seconds,
         "max_completion_tokens": max_completion_tokens or None, "tokens_in": tokens_in,
         "tls_passthrough": "true" if transparent else None},
        upstream_trust(wal if ca_dir else confdir, upstream_ca),
    )  # fmt: skip
    if print_command:
        click.echo(json.dumps(args))
        return
    os.environ["PYTHONUNBUFFERED"] = "1"  # mitmdump prints log lines without flushing: a pod's log is a pipe
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


@click.command("reward", short_help="Record a reward, as a verifier would.")
@click.option("--store", default="./forge-data", show_default=True, help="Folder or s3://bucket/prefix.")
@click.option("--s3-endpoint", help="S3-compatible endpoint URL.")
@click.option("--sidecar", "sidecar_url", help="Post to this sidecar's admin endpoint (http://127.0.0.1:PORT) "
              "instead of writing to the store; needs --token-file.")  # fmt: skip
@click.option("--token-file", type=click.Path(path_type=Path, dir_okay=False),
              help="With --sidecar: the file holding the sidecar's reward token (--reward-token-file).")  # fmt: skip
@click.option("--episode-id", required=True)
@click.option("--value", type=float, required=True, help="The reward.")
@click.option("--call-id", help="The call the reward is for (default: the whole episode).")
@click.option("--run-id", default="default", show_default=True)
@click.option("--component", multiple=True, help="NAME=NUMBER, repeatable: parts of the reward.")
@click.option("--source", default="cli", show_default=True, help="Recorded source (a sidecar sets its own).")
def reward_command(
    store: str, s3_endpoint: str | None, sidecar_url: str | None, token_file: Path | None, episode_id: str,
    value: float, call_id: str | None, run_id: str, component: tuple[str, ...], source: str,
) -> None:  # fmt: skip
    """Record a reward for an episode (or one call), as a verifier would: in the store (write access to it is the
    credential), or through a sidecar's admin endpoint with its reward token (--sidecar, --token-file)."""
    if not math.isfinite(value):
        raise ForgeError("--value must be a finite number")
    components = parse_components(component)
    if sidecar_url or token_file:
        if not (sidecar_url and token_file):
            raise ForgeError("--sidecar and --token-file go together: the admin endpoint needs the reward token")
        click.echo(post_reward(sidecar_url, token_file, {"episode_id": episode_id, "call_id": call_id,
                                                         "reward": value, "components": components}))  # fmt: skip
        return
    target = checked_store(store, s3_endpoint)
    row = reward_row(episode_id, value, source, call_id=call_id, components=components or None)
    day = datetime.fromtimestamp(row["at"] / 1e6, UTC)
    name = f"rewards/run={run_id}/date={day:%Y-%m-%d}/cli-{uuid.uuid4().hex}.parquet"
    try:
        path = target.write_parquet(name, to_table([row], "rewards"))
    except OSError as error:
        raise ForgeError(f"could not write to the store {store}: {error}") from error
    click.echo(path)


def post_reward(sidecar_url: str, token_file: Path, payload: dict[str, object]) -> str:
    """POST /reward on a sidecar's admin endpoint with the bearer token; its answer, or a one-line ForgeError."""
    try:
        token = read_token_file(token_file)
    except TokenFileError as error:
        raise ForgeError(str(error)) from error
    request = urllib.request.Request(
        f"{sidecar_url.rstrip('/')}/reward", data=json.dumps(payload).encode(), method="POST",
        headers={"authorization": f"Bearer {token}", "content-type": "application/json"},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.read().decode()
    except urllib.error.HTTPError as error:
        detail = error.read().decode(errors="replace")[:500]
        raise ForgeError(f"the sidecar refused the reward ({error.code}): {detail}") from None
    except (urllib.error.URLError, OSError) as error:
        raise ForgeError(f"cannot reach the sidecar at {sidecar_url}: {getattr(error, 'reason', error)}") from None


def port_list(value: str, option: str) -> tuple[int, ...]:
    try:
        return tuple(int(p) for p in value.replace(" ", "").split(",") if p)
    except ValueError:
        raise ForgeError(f"{option} {value!r}: write comma-separated port numbers, e.g. 80,443") from None


@click.command("net-init", short_help="Send a pod's outbound traffic to the sidecar.")
@click.option("--proxy-uid", type=int, default=1337, show_default=True, help="The sidecar's uid (not redirected).")
@click.option("--proxy-gid", type=int, help="The sidecar's gid (not redirected) [default: --proxy-uid].")
@click.option("--proxy-port", type=int, default=15001, show_default=True, help="The sidecar's listen port.")
@click.option("--ports", default="80,443", show_default=True, help="Outbound TCP ports sent to the sidecar.")
@click.option("--exclude-cidr", multiple=True, help="Destination network never redirected (v4 or v6); repeatable.")
@click.option("--exclude-port", multiple=True, help="Destination port never redirected; repeatable or 1,2.")
@click.option(
    "--reject-port",
    multiple=True,
    help="Destination port only the sidecar's uid may reach (the policy "
    "server's: its admin routes, and calls that would go unrecorded); repeatable or 1,2.",
)
@click.option("--ipv4-only", is_flag=True, help="Leave ip6tables alone (a kernel without IPv6).")
@click.option("--dry-run", is_flag=True, help="Print the rules, change nothing.")
@click.option("--cleanup", is_flag=True, help="Remove exactly what net-init added.")
def net_init_command(
    proxy_uid: int, proxy_gid: int | None, proxy_port: int, ports: str, exclude_cidr: tuple[str, ...],
    exclude_port: tuple[str, ...], reject_port: tuple[str, ...], ipv4_only: bool, dry_run: bool, cleanup: bool,
) -> None:  # fmt: skip
    """Send the pod's outbound 80/443 to the sidecar (iptables and ip6tables nat rules), as an init container.

    Needs NET_ADMIN. Re-running it is harmless. While the rules are in place and the sidecar is down, those
    connections are refused: model calls fail closed, nothing bypasses the sidecar.
    """
    families = (4,) if ipv4_only else (4, 6)
    if cleanup:
        if dry_run:
            for family in families:
                for args in netinit.cleanup_rules():
                    click.echo(" ".join([netinit.FAMILIES[family], "-w", *args]))
            return
        for line in netinit.cleanup(families):
            click.echo(line)
        return
    config = netinit.NetInit(
        proxy_uid=proxy_uid, proxy_gid=proxy_gid, proxy_port=proxy_port, ports=port_list(ports, "--ports"),
        exclude_cidrs=tuple(c for item in exclude_cidr for c in item.split(",") if c),
        exclude_ports=tuple(p for item in exclude_port for p in port_list(item, "--exclude-port")),
        reject_ports=tuple(p for item in reject_port for p in port_list(item, "--reject-port")),
        families=families,
    )  # fmt: skip
    if dry_run:
        for line in netinit.dry_run(config):
            click.echo(line)
        return
    for line in netinit.apply(config):
        click.echo(line)


@click.group("ca", short_help="The CA the sidecar signs model hosts with.")
def ca_group() -> None:
    """The CA the sidecar signs model hosts with, and the bundle the harness trusts."""


@ca_group.command("init", short_help="Make or take the CA; write the trust bundle.")
@click.option("--dir", "directory", type=click.Path(path_type=Path, file_okay=False), default=Path("forge-ca"),
              show_default=True, help="Where the CA and bundle go (give it to `forge sidecar --ca-dir`).")  # fmt: skip
@click.option("--cert", type=click.Path(path_type=Path, dir_okay=False, exists=True), help="A given CA certificate.")
@click.option("--key", type=click.Path(path_type=Path, dir_okay=False, exists=True), help="Its private key.")
@click.option("--force", is_flag=True, help="Replace an existing CA with a new one.")
@click.option("--owner", type=int, help="uid to own the files (the sidecar's, e.g. 1337).")
def ca_init_command(directory: Path, cert: Path | None, key: Path | None, force: bool, owner: int | None) -> None:
    """Make (or take) the sidecar's CA and write ca-bundle.pem (system CAs + ours); print the trust env."""
    files = ca.init_ca(directory.resolve(), cert, key, force=force, owner=owner)
    click.echo(f"CA: {files.ca}  bundle: {files.bundle}")
    click.echo("# the harness's environment:")
    for name, value in files.trust_env().items():
        click.echo(f"{name}={value}")


commands: list[click.Command] = [sidecar_command, reward_command, net_init_command, ca_group]
