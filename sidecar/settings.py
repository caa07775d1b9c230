"""The sidecar's options, declared once: mitmproxy's ``--set forge_NAME=...`` options (``addon.Forge.load``) and
`forge sidecar`'s click options (``sidecar/cli.py``) are both made from ``OPTIONS``; ``Settings.parse`` reads the
mitmproxy options once (``configure``) into a frozen object the hooks read.

No mitmproxy import here: the click command runs in the main environment.
"""

from dataclasses import dataclass, fields
from typing import Any

DEFAULT_MODEL_HOSTS = "api.openai.com,api.anthropic.com"
TOKENS_IN_MODES = ("auto", "observe", "off")
FSYNC_MODES = ("always", "interval", "never")


@dataclass(frozen=True)
class Option:
    """One sidecar option. ``kind`` is what the value is (float options travel to mitmproxy as text: its ``--set``
    parses no float); ``choices``: the only values taken."""

    name: str  # the mitmproxy option is forge_<name>; the click option --<name with dashes>
    kind: type
    default: Any
    help: str
    choices: tuple[str, ...] | None = None

    @property
    def mitmproxy_type(self) -> type:
        return str if self.kind is float else self.kind

    @property
    def mitmproxy_default(self) -> Any:
        return str(self.default) if self.kind is float else self.default


OPTIONS: tuple[Option, ...] = (
    Option("upstream", str, "http://127.0.0.1:8000", "The policy servers (vLLM replicas): comma-separated "
           "http(s)://HOST:PORT, or dns+http(s)://NAME:PORT for every address of NAME (a headless Service); an "
           "episode sticks to one."),
    Option("upstream_refresh_seconds", float, 10.0, "How often dns+ upstreams are resolved again."),
    Option("health_seconds", float, 2.0, "How often each policy replica is asked whether it is up (a refused "
           "connection is noticed at once)."),
    Option("upstream_idle_seconds", float, 2.0, "Open a new connection to a policy replica rather than reuse one "
           "idle this long: under the server's keep-alive (vLLM's: 5 s), so no call races the server closing it."),
    Option("store", str, "./forge-data", "Where records go: a folder or s3://bucket/prefix."),
    Option("s3_endpoint", str, "", "S3-compatible endpoint URL (credentials from AWS_* variables)."),
    Option("wal_dir", str, "./forge-wal", "Write-ahead log folder (replayed at start)."),
    Option("episode_id", str, "", "Episode of every call (else: proxy user name, X-Forge-Episode-Id, env)."),
    Option("task_id", str, "", "Task id of every call."),
    Option("run_id", str, "", "Run id of every call."),
    Option("policy_model", str, "", "Served name of the policy under training, as `forge train` prints it "
           "[default: the one the server announces: its only LoRA adapter, else its base model]."),
    Option("model_map", str, "*", "PATTERN[=MODEL],...: requested names served by MODEL [default MODEL: the "
           "policy]."),
    Option("policy_version", str, "", "Fixed policy version (default: the server's /weight_info)."),
    Option("model_hosts", str, DEFAULT_MODEL_HOSTS, "Hosts whose model calls are taken (served by the policy)."),
    Option("max_completion_tokens", int, 0, "Bound every completion (rollout length); 0: off."),
    Option("admin_port", int, 0, "Loopback port for POST /reward and GET /metrics; 0: off."),
    Option("reward_socket", str, "", "Also take POST /reward on this Unix socket (mode 0600), from root or the "
           "sidecar's own uid only (a pod's verifier); without a reward token file, TCP takes no reward."),
    Option("reward_token_file", str, "", "The bearer token POST /reward needs, in a file the harness's uid cannot "
           "read [default: a new random one, mode 0600, at WAL_DIR/reward-token]."),
    Option("trust_episode_header", bool, False, "In a pod (POD_UID/FORGE_EPISODE_ID set), let X-Forge-Episode-Id/"
           "X-Forge-Task-Id or the proxy user name choose a call's episode; by default the pod's identity wins."),
    Option("flush_rows", int, 2000, "Close a WAL segment after this many records."),
    Option("flush_bytes", int, 64 << 20, "Close a WAL segment after this many bytes."),
    Option("flush_seconds", float, 5.0, "Close a WAL segment after this many seconds."),
    Option("max_wal_bytes", int, 4 << 30, "Bound of the WAL on disk; past it new records are dropped."),
    Option("fsync", str, "interval", "When WAL commits reach the disk: every record (survives a machine crash), "
           "each second, or never (a process kill loses nothing either way).", FSYNC_MODES),
    Option("drain_seconds", float, 20.0, "On SIGTERM, wait this long for calls in flight (then record them as "
           "cut) before flushing."),
    Option("tokens_in", str, "auto", "A call whose history re-tokenizes differently from the sampled ids: auto "
           "serves it tokens-in from those ids (the episode does not fork), observe only records it.",
           TOKENS_IN_MODES),
    Option("tls_passthrough", bool, False, "Open TLS only for model hosts (by SNI); pass the rest through."),
)  # fmt: skip
BY_NAME = {option.name: option for option in OPTIONS}


@dataclass(frozen=True)
class Settings:
    """The sidecar's options as the hooks read them, parsed and checked once."""

    upstream: str = BY_NAME["upstream"].default
    upstream_refresh_seconds: float = BY_NAME["upstream_refresh_seconds"].default
    health_seconds: float = BY_NAME["health_seconds"].default
    upstream_idle_seconds: float = BY_NAME["upstream_idle_seconds"].default
    store: str = BY_NAME["store"].default
    s3_endpoint: str = ""
    wal_dir: str = BY_NAME["wal_dir"].default
    episode_id: str = ""
    task_id: str = ""
    run_id: str = ""
    policy_model: str = ""
    model_map: str = BY_NAME["model_map"].default
    policy_version: str = ""
    model_hosts: str = DEFAULT_MODEL_HOSTS
    max_completion_tokens: int = 0
    admin_port: int = 0
    reward_socket: str = ""
    reward_token_file: str = ""
    trust_episode_header: bool = False
    flush_rows: int = BY_NAME["flush_rows"].default
    flush_bytes: int = BY_NAME["flush_bytes"].default
    flush_seconds: float = BY_NAME["flush_seconds"].default
    max_wal_bytes: int = BY_NAME["max_wal_bytes"].default
    fsync: str = BY_NAME["fsync"].default
    drain_seconds: float = BY_NAME["drain_seconds"].default
    tokens_in: str = BY_NAME["tokens_in"].default
    tls_passthrough: bool = False

    @classmethod
    def parse(cls, options: Any) -> "Settings":
        """From mitmproxy's options (``forge_<name>`` attributes); ValueError names the option and what it takes."""
        values = {}
        for option in OPTIONS:
            raw = getattr(options, f"forge_{option.name}")
            if option.kind is float:
                try:
                    raw = float(raw)
                except (TypeError, ValueError):
                    raise ValueError(f"forge_{option.name}: {raw!r} is not a number") from None
                if not raw >= 0:
                    raise ValueError(f"forge_{option.name}: {raw} is negative")
            if option.choices and raw not in option.choices:
                raise ValueError(f"forge_{option.name}: {raw!r} is not one of {', '.join(option.choices)}")
            values[option.name] = raw
        return cls(**values)

    @property
    def model_hosts_set(self) -> set[str]:
        return {host.strip().lower() for host in self.model_hosts.split(",") if host.strip()}

    @property
    def model_map_rules(self) -> list[tuple[str, str]]:
        return [
            (pattern.strip(), target.strip())
            for pattern, _, target in (rule.partition("=") for rule in self.model_map.split(","))
        ]


assert {f.name for f in fields(Settings)} == set(BY_NAME), "Settings and OPTIONS name the same options"
