"""`forge net-init`: the rules as data, and applied for real with iptables/ip6tables in a namespace (root)."""

import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from forge.errors import ForgeError
from sidecar.netinit import CHAIN, NetInit, checked, cleanup_rules, dry_run, rules
from tests.support.netns import CLIENT_UID, PROXY_UID, build_pod_network, root_cause, wait_listening

FORGE = str(Path(sys.executable).parent / "forge")


def test_the_chain_returns_the_proxy_loopback_and_exclusions_before_it_redirects():
    config = NetInit(proxy_uid=1337, proxy_port=15001, exclude_cidrs=("10.0.0.0/8", "fd00::/8"), exclude_ports=(22,))
    v4 = [" ".join(args) for args in rules(config, 4)]
    assert v4 == [
        f"-t nat -N {CHAIN}",
        f"-t nat -A {CHAIN} -m owner --uid-owner 1337 -j RETURN",
        f"-t nat -A {CHAIN} -m owner --gid-owner 1337 -j RETURN",
        f"-t nat -A {CHAIN} -o lo -j RETURN",
        f"-t nat -A {CHAIN} -d 127.0.0.0/8 -j RETURN",
        f"-t nat -A {CHAIN} -d 10.0.0.0/8 -j RETURN",
        f"-t nat -A {CHAIN} -p tcp --dport 22 -j RETURN",
        f"-t nat -A {CHAIN} -p tcp -m multiport --dports 80,443 -j REDIRECT --to-ports 15001",
        f"-t nat -A OUTPUT -p tcp -j {CHAIN}",
    ]
    v6 = [" ".join(args) for args in rules(config, 6)]
    assert f"-t nat -A {CHAIN} -d ::1/128 -j RETURN" in v6 and f"-t nat -A {CHAIN} -d fd00::/8 -j RETURN" in v6
    assert not any("10.0.0.0/8" in line or "127.0.0.0/8" in line for line in v6)  # each family gets its own


def test_a_separate_gid_and_other_ports():
    config = NetInit(proxy_uid=1337, proxy_gid=2000, proxy_port=15006, ports=(443,))
    lines = [" ".join(args) for args in rules(config, 4)]
    assert f"-t nat -A {CHAIN} -m owner --gid-owner 2000 -j RETURN" in lines
    assert lines[-2].endswith("--dports 443 -j REDIRECT --to-ports 15006")


def test_dry_run_prints_both_families_with_their_binaries():
    lines = dry_run(NetInit(proxy_uid=1337, proxy_port=15001))
    assert (
        lines[0] == f"iptables -w -t nat -N {CHAIN}" and lines[-1] == f"ip6tables -w -t nat -A OUTPUT -p tcp -j {CHAIN}"
    )
    only4 = dry_run(NetInit(proxy_uid=1337, proxy_port=15001, families=(4,)))
    assert not any(line.startswith("ip6tables") for line in only4)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (NetInit(proxy_uid=1337, proxy_port=443), "also a redirected port"),
        (NetInit(proxy_uid=1337, proxy_port=70000), "out of range"),
        (NetInit(proxy_uid=1337, proxy_port=15001, ports=()), "--ports is empty"),
        (NetInit(proxy_uid=1337, proxy_port=15001, exclude_cidrs=("10.0.0/33",)), "not an IPv4 or IPv6 network"),
        (NetInit(proxy_uid=-1, proxy_port=15001), "must be >= 0"),
    ],
)
def test_bad_options_fail_with_one_line(config, message):
    with pytest.raises(ForgeError, match=message):
        checked(config)


def test_the_cli_says_what_is_wrong_in_one_line():
    done = subprocess.run([FORGE, "net-init", "--dry-run", "--ports", "80,https"], capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0 and "--ports '80,https'" in done.stderr
    cleanup = subprocess.run([FORGE, "net-init", "--cleanup", "--dry-run"], capture_output=True, text=True)
    assert cleanup.returncode == 0 and cleanup.stdout.count("\n") == 2 * len(cleanup_rules())


# -- applied for real ---------------------------------------------------------------------------------------
def needs_root(test):
    return pytest.mark.integration(pytest.mark.skipif(root_cause() is not None, reason=str(root_cause()))(test))


@pytest.fixture
def namespace() -> Iterator[str]:
    name = f"forge-netinit-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def in_ns(name: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", "netns", "exec", name, *args], capture_output=True, text=True, check=check)


def saved(name: str) -> str:
    """Both families' tables as iptables-save writes them, without its timestamp comments."""
    dumps = (in_ns(name, binary).stdout for binary in ("iptables-save", "ip6tables-save"))
    return "\n".join(line for dump in dumps for line in dump.splitlines() if not line.startswith("#"))


@needs_root
@pytest.mark.parametrize("preexisting", [False, True], ids=["fresh-namespace", "with-other-nat-rules"])
def test_apply_is_idempotent_and_cleanup_restores_the_tables_exactly(namespace, preexisting):
    if preexisting:  # someone else's nat rules (e.g. a CNI's) must survive both
        for binary in ("iptables", "ip6tables"):
            in_ns(namespace, binary, "-t", "nat", "-N", "OTHER")
            in_ns(namespace, binary, "-t", "nat", "-A", "OUTPUT", "-p", "udp", "-j", "OTHER")
    before = saved(namespace)
    apply = [FORGE, "net-init", "--proxy-uid", "1337", "--proxy-port", "15001", "--exclude-cidr", "10.9.0.0/16",
             "--reject-port", "8000"]  # fmt: skip
    in_ns(namespace, *apply)
    once = saved(namespace)
    assert "--uid-owner 1337 -j RETURN" in once and "--to-ports 15001" in once and "-d 10.9.0.0/16 -j RETURN" in once
    assert len(re.findall(r"--dports 8000 -j REJECT", once)) == 2
    assert len(re.findall(rf"-A OUTPUT -p tcp -j {CHAIN}", once)) == 2  # one jump per family
    in_ns(namespace, *apply)
    assert saved(namespace) == once  # re-running is harmless
    in_ns(namespace, FORGE, "net-init", "--cleanup")
    assert saved(namespace) == before
    again = in_ns(namespace, FORGE, "net-init", "--cleanup")
    assert "nothing to remove" in again.stdout and saved(namespace) == before


@needs_root
def test_re_running_with_new_options_replaces_the_old_rules(namespace):
    in_ns(namespace, FORGE, "net-init", "--proxy-port", "15001")
    in_ns(namespace, FORGE, "net-init", "--proxy-port", "15009", "--ports", "443")
    rules_now = in_ns(namespace, "iptables", "-t", "nat", "-S", CHAIN).stdout
    assert "--to-ports 15009" in rules_now and "--to-ports 15001" not in rules_now and "80,443" not in rules_now


@needs_root
def test_without_net_admin_it_fails_with_one_clear_line(namespace):
    if subprocess.run(["which", "capsh"], capture_output=True).returncode != 0:
        pytest.skip("capsh is not installed")
    done = in_ns(namespace, "capsh", "--drop=cap_net_admin", "--", "-c", f"{FORGE} net-init", check=False)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("forge: ") and "NET_ADMIN" in lines[0]
    assert CHAIN not in in_ns(namespace, "iptables-save").stdout  # nothing half-applied


POLICY_ROUTES = ("/update_weight_version", "/v1/load_lora_adapter", "/collective_rpc", "/v1/completions")


@needs_root
def test_only_the_sidecars_uid_reaches_the_policy_servers_port():
    """The agent's shell cannot call the policy server's admin routes (relabel versions, load an old adapter) or
    make model calls that go unrecorded: with --reject-port, every uid but the sidecar's is refused there."""
    net = build_pod_network([])
    try:
        policy = net.internet.run(["ip", "-4", "-o", "addr", "show", "scope", "global"]).stdout.split()[3]
        address = policy.split("/")[0]
        net.processes.append(net.internet.popen(
            ["/usr/bin/python3", "-m", "http.server", "--bind", address, "8000"], net.work / "policy.log"))  # fmt: skip
        wait_listening(net.internet, address, 8000)
        net.pod.run([FORGE, "net-init", "--proxy-uid", str(PROXY_UID), "--proxy-port", "15001",
                     "--reject-port", "8000"])  # fmt: skip
        for route in POLICY_ROUTES:
            curl = ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "--max-time", "5",
                    f"http://{address}:8000{route}"]  # fmt: skip
            harness = net.pod.run(curl, uid=CLIENT_UID, check=False)
            assert harness.returncode == 7, f"the harness reached {route}: {harness.stdout}"  # 7: connection refused
            assert net.pod.run(curl, uid=PROXY_UID, check=False).stdout == "404", route  # the sidecar still does
    finally:
        net.teardown()
