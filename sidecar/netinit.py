"""`forge net-init`: the pod's nat rules that send the harness's outbound 80/443 to the sidecar (IPv4 and IPv6).

What an init container runs, as Istio's does: an own nat chain, jumped to from OUTPUT, that RETURNs the
sidecar's own uid/gid (so its upstream connections are not looped back), loopback and any excluded CIDRs or
ports, and REDIRECTs the chosen ports to the sidecar. ``rules`` is a pure function (the commands, as data);
``apply`` and ``cleanup`` shell out to iptables/ip6tables. Re-running ``apply`` rebuilds the chain in place;
``cleanup`` removes exactly what ``apply`` added, the nat table too when ``apply`` created it.

Fail closed: while the rules are in place and nothing listens on the proxy port, the harness's connections to
80/443 are refused; no model call can bypass the sidecar. With ``reject_ports`` (the policy server's port), a
filter chain refuses every other uid those ports outright: the agent's shell cannot reach the policy server's
admin routes (``/collective_rpc``, ``/update_weight_version``, ...) nor make a model call the sidecar never sees.
"""

import ipaddress
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field

from forge.errors import ForgeError

CHAIN = "FORGE_OUTPUT"
FILTER_CHAIN = "FORGE_REJECT"  # filter table: the ports only the sidecar's uid may reach
# An empty chain that says "net-init created the nat table", so cleanup can remove the table too.
CREATED_MARK = "FORGE_NAT_CREATED"  # (in the filter table: net-init created that one)
FAMILIES = {4: "iptables", 6: "ip6tables"}
LOOPBACK = {4: "127.0.0.0/8", 6: "::1/128"}
NFT_FAMILY = {4: "ip", 6: "ip6"}


@dataclass(frozen=True)
class NetInit:
    """What to redirect: the options of `forge net-init`."""

    proxy_uid: int
    proxy_port: int
    proxy_gid: int | None = None
    ports: tuple[int, ...] = (80, 443)
    exclude_cidrs: tuple[str, ...] = ()
    exclude_ports: tuple[int, ...] = ()
    reject_ports: tuple[int, ...] = ()  # only the sidecar's uid/gid may connect to these (the policy server's)
    families: tuple[int, ...] = (4, 6)
    binaries: dict[int, str] = field(default_factory=lambda: dict(FAMILIES))


def checked(config: NetInit) -> NetInit:
    """Reject what iptables would reject later, in one line each."""
    for port in (config.proxy_port, *config.ports, *config.exclude_ports, *config.reject_ports):
        if not 0 < port < 65536:
            raise ForgeError(f"port {port} is out of range (1-65535)")
    if not config.ports:
        raise ForgeError("--ports is empty: name the ports to redirect (e.g. 80,443)")
    if config.proxy_port in config.ports:
        raise ForgeError(f"--proxy-port {config.proxy_port} is also a redirected port: traffic would loop")
    for ids in (config.proxy_uid, config.proxy_gid):
        if ids is not None and ids < 0:
            raise ForgeError(f"uid/gid {ids} must be >= 0")
    for cidr in config.exclude_cidrs:
        try:
            ipaddress.ip_network(cidr, strict=False)
        except ValueError:
            raise ForgeError(f"--exclude-cidr {cidr!r} is not an IPv4 or IPv6 network (e.g. 10.0.0.0/8)") from None
    return config


def rules(config: NetInit, family: int) -> list[list[str]]:
    """The iptables/ip6tables arguments that build the chain and the jump to it, in order (no binary name)."""
    nat = ["-t", "nat"]
    chain = [*nat, "-A", CHAIN]
    gid = config.proxy_gid if config.proxy_gid is not None else config.proxy_uid
    commands = [
        [*nat, "-N", CHAIN],
        [*chain, "-m", "owner", "--uid-owner", str(config.proxy_uid), "-j", "RETURN"],
        [*chain, "-m", "owner", "--gid-owner", str(gid), "-j", "RETURN"],
        [*chain, "-o", "lo", "-j", "RETURN"],
        [*chain, "-d", LOOPBACK[family], "-j", "RETURN"],
    ]
    for cidr in config.exclude_cidrs:
        network = ipaddress.ip_network(cidr, strict=False)
        if network.version == family:
            commands.append([*chain, "-d", str(network), "-j", "RETURN"])
    for port in config.exclude_ports:
        commands.append([*chain, "-p", "tcp", "--dport", str(port), "-j", "RETURN"])
    ports = ",".join(str(p) for p in config.ports)
    commands.append(
        [*chain, "-p", "tcp", "-m", "multiport", "--dports", ports, "-j", "REDIRECT", "--to-ports",
         str(config.proxy_port)]
    )  # fmt: skip
    commands.append([*nat, "-A", "OUTPUT", "-p", "tcp", "-j", CHAIN])
    return commands


def reject_rules(config: NetInit) -> list[list[str]]:
    """The filter chain refusing ``reject_ports`` to every uid but the sidecar's, and the jump to it (empty when
    there are none). Loopback stays open: a task's own local server may use the same port."""
    if not config.reject_ports:
        return []
    table = ["-t", "filter"]
    chain = [*table, "-A", FILTER_CHAIN]
    gid = config.proxy_gid if config.proxy_gid is not None else config.proxy_uid
    ports = ",".join(str(p) for p in config.reject_ports)
    return [
        [*table, "-N", FILTER_CHAIN],
        [*chain, "-m", "owner", "--uid-owner", str(config.proxy_uid), "-j", "RETURN"],
        [*chain, "-m", "owner", "--gid-owner", str(gid), "-j", "RETURN"],
        [*chain, "-o", "lo", "-j", "RETURN"],
        [*chain, "-p", "tcp", "-m", "multiport", "--dports", ports, "-j", "REJECT", "--reject-with", "tcp-reset"],
        [*table, "-A", "OUTPUT", "-p", "tcp", "-j", FILTER_CHAIN],
    ]


def cleanup_rules(table: str = "nat", chain: str = CHAIN) -> list[list[str]]:
    """Removing a chain: drop the jump, flush and delete the chain (apply guards the jump with -C)."""
    return [
        ["-t", table, "-D", "OUTPUT", "-p", "tcp", "-j", chain],
        ["-t", table, "-F", chain],
        ["-t", table, "-X", chain],
    ]


def dry_run(config: NetInit) -> list[str]:
    """The commands `apply` would run, as shell lines."""
    checked(config)
    return [
        " ".join([config.binaries[f], "-w", *args])
        for f in config.families
        for args in [*rules(config, f), *reject_rules(config)]
    ]


class Tables:
    """One family's iptables binary, run with the xtables lock (-w); errors become one ForgeError line."""

    def __init__(self, binary: str) -> None:
        if shutil.which(binary) is None:
            raise ForgeError(f"{binary} is not installed (Debian: apt-get install -y iptables)")
        self.binary = binary

    def run(self, args: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([self.binary, "-w", *args], capture_output=True, text=True, timeout=30)
        if check and done.returncode != 0:
            said = (done.stderr or done.stdout).strip().splitlines()
            reason = said[0] if said else f"exit {done.returncode}"
            if "ermission denied" in reason or "you must be root" in reason:
                raise ForgeError(
                    f"{self.binary} needs the NET_ADMIN capability (run as root or grant NET_ADMIN): {reason}"
                )
            raise ForgeError(f"{self.binary} {' '.join(args)} failed: {reason}")
        return done

    def has_table(self, table: str = "nat") -> bool:
        # The whole dump: `-save -t nat` (and `-t nat -S`) would create the table they look for.
        done = subprocess.run([f"{self.binary}-save"], capture_output=True, text=True, timeout=30)
        if done.returncode != 0 or "ermission denied" in done.stderr:
            self.run(["-t", table, "-S"])  # raises the clear line (no NET_ADMIN, ...)
        return f"*{table}" in done.stdout.splitlines()

    def has_chain(self, name: str, table: str = "nat") -> bool:
        return self.run(["-t", table, "-S", name], check=False).returncode == 0


def apply(config: NetInit) -> list[str]:
    """Install the rules for every family; rebuilds the chain when it exists. Returns what was done."""
    checked(config)
    done = []
    for family in config.families:
        tables = Tables(config.binaries[family])
        table_existed = tables.has_table("nat")  # before anything below makes the table exist
        filter_existed = tables.has_table("filter") if config.reject_ports else True
        commands = rules(config, family)
        create, body, jump = commands[0], commands[1:-1], commands[-1]
        if tables.has_chain(CHAIN):
            tables.run(["-t", "nat", "-F", CHAIN])  # re-run: the same chain, rebuilt with today's options
        else:
            tables.run(create)
            if not table_existed:
                tables.run(["-t", "nat", "-N", CREATED_MARK])
        for args in body:
            tables.run(args)
        if tables.run(["-t", "nat", "-C", "OUTPUT", *jump[4:]], check=False).returncode != 0:
            tables.run(jump)  # one jump, however often net-init runs
        done.append(f"{tables.binary}: nat chain {CHAIN} redirects tcp {','.join(map(str, config.ports))} "
                    f"to :{config.proxy_port} (uid {config.proxy_uid} and loopback excluded)")  # fmt: skip
        if tables.has_chain(FILTER_CHAIN, "filter"):  # re-run: today's options only
            _remove_chain(tables, "filter", FILTER_CHAIN)
        for args in reject_rules(config):
            tables.run(args)
        if not filter_existed:
            tables.run(["-t", "filter", "-N", CREATED_MARK])
        if config.reject_ports:
            done.append(f"{tables.binary}: filter chain {FILTER_CHAIN} refuses tcp "
                        f"{','.join(map(str, config.reject_ports))} to every uid but {config.proxy_uid}")  # fmt: skip
    return done


def cleanup(families: Sequence[int] = (4, 6), binaries: dict[int, str] | None = None) -> list[str]:
    """Remove what `apply` added (the chain, its jump, the nat table if apply created it)."""
    done = []
    for family in families:
        tables = Tables((binaries or FAMILIES)[family])
        if tables.has_chain(FILTER_CHAIN, "filter"):
            _remove_chain(tables, "filter", FILTER_CHAIN)
            done.append(f"{tables.binary}: removed the filter chain {FILTER_CHAIN}")
            if tables.has_chain(CREATED_MARK, "filter"):
                tables.run(["-t", "filter", "-X", CREATED_MARK])
                _drop_table_if_empty(tables, family, "filter")
        tables.run(["-t", "nat", "-S", "OUTPUT"])
        if not tables.has_chain(CHAIN):
            done.append(f"{tables.binary}: no {CHAIN} chain, nothing to remove")
            continue
        while tables.run(["-t", "nat", "-C", "OUTPUT", "-p", "tcp", "-j", CHAIN], check=False).returncode == 0:
            tables.run(cleanup_rules()[0])
        for args in cleanup_rules()[1:]:
            tables.run(args)
        if tables.has_chain(CREATED_MARK):
            tables.run(["-t", "nat", "-X", CREATED_MARK])
            _drop_table_if_empty(tables, family, "nat")
        done.append(f"{tables.binary}: removed the nat chain {CHAIN}")
    return done


def _remove_chain(tables: Tables, table: str, chain: str) -> None:
    drop_jump, *rest = cleanup_rules(table, chain)
    while tables.run(drop_jump, check=False).returncode == 0:  # every jump to it, however many were added
        pass
    for args in rest:
        tables.run(args)


def _drop_table_if_empty(tables: Tables, family: int, table: str) -> None:
    """net-init made this table: remove it too when nothing else was added to it since (nftables only)."""
    listing = tables.run(["-t", table, "-S"]).stdout.split()
    if any(word in ("-A", "-N") for word in listing) or "DROP" in listing:
        return
    version = tables.run(["--version"], check=False).stdout
    if "nf_tables" in version and shutil.which("nft"):
        subprocess.run(["nft", "delete", "table", NFT_FAMILY[family], table], capture_output=True, timeout=30)
