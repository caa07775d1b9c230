"""The injected containers' own commands, run in a network namespace the test makes (root; CI runs as root): the
pod as the kubelet would start it, with the namespace helpers of the transparent-mode tests (tests/support/netns.py).

In start order: the CA init container's command (from a Secret written by `forge inject certs`), the net-init
container's command (as root), the sidecar container's command (as uid 1337, its downward-API variables filled as
the kubelet would), its probe; then an unmodified client (uid 4242, only the app containers' trust variables)
calls https://api.openai.com and is served and recorded under the pod's episode. The policy is the fake
vLLM-shaped upstream (bench/fake_upstream.py) behind the same relay the transparent tests use for vLLM: the
token exactness of transparent mode is tested there, against real vLLM.
"""

import json
import shutil
import sys
import time
from pathlib import Path

import pytest

from bench.fake_upstream import FakeUpstream
from k8s import inject
from k8s.certs import write_cluster_secrets
from k8s.settings import InjectorSettings
from tests.support.netns import (
    CLIENT_UID,
    PROXY_UID,
    Relay,
    build_pod_network,
    closed_to_others,
    readable_code,
    root_cause,
    sh,
    stop,
)
from tests.support.sidecar import read_calls, wait_for
from trainer.serve import free_port

pytestmark = [pytest.mark.integration, pytest.mark.skipif(root_cause() is not None, reason=str(root_cause()))]
ROOT = Path(__file__).resolve().parents[2]
FORGE = str(Path(sys.executable).parent / "forge")
MODEL_HOST = "api.openai.com"


def read_rewards(store: str) -> list[dict]:
    from collector.sql import connect

    return connect(store).execute("SELECT * FROM rewards").arrow().read_all().to_pylist()


def in_work(args: list[str], work: Path) -> list[str]:
    """The container's arguments with its volumes' mount paths moved into the test's folder."""
    mounts = {inject.CA_DIR: work / "ca", inject.CA_SECRET_DIR: work / "secret", inject.WAL_DIR: work / "wal",
              inject.REWARD_DIR: work / "reward"}  # fmt: skip
    for path, local in sorted(mounts.items(), key=lambda item: -len(item[0])):  # ca-secret before ca
        args = [a.replace(path, str(local)) for a in args]
    return args


def image_forge(work: Path) -> tuple[list[str], dict[str, str]]:
    """`forge` as the sidecar image runs it (`python -m k8s.pod` in the sidecar env) from a copy every uid can read:
    CI may clone into a folder only root can enter, and uids 1337 and the verifier's run it."""
    code = work / "image-src"
    for package in ("forge", "sidecar", "k8s"):
        shutil.copytree(ROOT / package, code / package, ignore=shutil.ignore_patterns("__pycache__"))
    for path in [code, *code.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    venv = (ROOT / ".venv-sidecar").resolve()
    return [str(venv / "bin" / "python"), "-m", "k8s.pod"], {"PYTHONPATH": str(code), "FORGE_SIDECAR_VENV": str(venv)}


def test_the_injected_commands_make_a_recording_pod(tmp_path):
    if blocked := closed_to_others((ROOT / ".venv-sidecar" / "bin").resolve()):
        pytest.fail(f"{blocked} is closed to other uids: build the envs where uid {PROXY_UID} can read")
    settings = InjectorSettings(policy_model="forge-run9")  # the policy's name, as `forge train` printed it
    with FakeUpstream() as upstream:
        net = build_pod_network([MODEL_HOST])
        relay = Relay((net.root_address, free_port()), ("127.0.0.1", int(upstream.url.rsplit(":", 1)[1])))
        sidecar = None
        try:
            relay.open()
            work = net.work
            secret = write_cluster_secrets(tmp_path / "certs").sidecar_ca
            shutil.copytree(secret, work / "secret")
            (work / "ca").mkdir()
            (work / "wal").mkdir()
            (work / "store").mkdir()
            for path in (work / "ca", work / "wal", work / "store"):
                shutil.chown(path, PROXY_UID, PROXY_UID)
            (work / "secret").chmod(0o755)
            for file in (work / "secret").iterdir():
                file.chmod(0o444)  # the Secret volume's defaultMode

            ca_init = in_work(inject.ca_init_container(settings)["args"], work)
            pod_forge, pod_env = image_forge(work)
            net.pod.run([*pod_forge, *ca_init], uid=PROXY_UID,
                        env={"PATH": "/usr/bin:/bin", "HOME": str(work / "wal"), **pod_env})  # fmt: skip
            net_init = inject.net_init_container(settings)["args"]
            net.pod.run([FORGE, *net_init])
            rules = net.pod.run(["iptables-save", "-t", "nat"]).stdout
            assert f"--uid-owner {PROXY_UID} -j RETURN" in rules and "--to-ports 15001" in rules

            (work / "reward").mkdir()
            (work / "reward").chmod(0o777)  # the reward socket's emptyDir
            args = in_work(inject.sidecar_container(settings)["args"], work)
            args[args.index("--upstream") + 1] = f"http://{relay.listen[0]}:{relay.listen[1]}"
            args[args.index("--store") + 1] = str(work / "store")
            command = json.loads(sh([FORGE, *args, "--flush-seconds", "0.3", "--print-command"]).stdout)
            command[0] = str(Path(command[0]).resolve())  # no symlink into the checkout for uid 1337
            code = readable_code(ROOT, work)
            command[command.index("-s") + 1] = str(code / "sidecar" / "addon.py")
            downward_api = {
                "FORGE_EPISODE_ID": "run9.add.0",
                "FORGE_TASK_ID": "add",
                "FORGE_RUN_ID": "run9",
                "POD_NAME": "forge-run9-add-0",
                "POD_UID": "0d3c",
                "POD_NAMESPACE": "openforge-rollouts",
                "FORGE_HARNESS": "my-agent",  # the pod's openforge.io/harness annotation
            }
            env = {"PATH": "/usr/bin:/bin", "HOME": str(work / "wal"), **downward_api}  # fmt: skip
            sidecar = net.pod.popen(command, work / "sidecar.log", uid=PROXY_UID, env=env)

            probe = inject.sidecar_container(settings)["startupProbe"]["exec"]["command"]
            deadline = time.monotonic() + 30
            while net.pod.run([FORGE, *probe[1:]], check=False).returncode != 0:
                assert sidecar.poll() is None, (work / "sidecar.log").read_text()
                assert time.monotonic() < deadline, "the sidecar never became ready"
                time.sleep(0.3)

            trust = {e["name"]: e["value"].replace(inject.BUNDLE_DIR, str(work / "ca")) for e in inject.trust_env()}
            body = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hello from a pod"}]}
            done = net.pod.run(
                ["curl", "-sS", "--fail-with-body", f"https://{MODEL_HOST}/v1/chat/completions",
                 "-H", "content-type: application/json", "-d", json.dumps(body)],
                uid=CLIENT_UID, env={"PATH": "/usr/bin:/bin", **trust},
            )  # fmt: skip
            assert json.loads(done.stdout)["choices"][0]["message"]["content"] == "SmolLAM"
            (call,) = wait_for(lambda: read_calls(str(work / "store")), what="the pod's call record")
            assert call["episode_id"] == "run9.add.0" and call["task_id"] == "add" and call["run_id"] == "run9"
            assert call["host"] == MODEL_HOST and call["status"] == "ok"
            assert call["harness"] == "my-agent"  # the annotation beats curl's own user agent
            # Served by the policy the injector named (not the model the server lists first), and labelled with its
            # version: the upstream got that name, and the record says it served the call.
            assert json.loads(upstream.server.requests[-1]["body"])["model"] == "forge-run9"  # type: ignore[attr-defined]
            assert call["model_served"] == "forge-run9" and call["policy_version"] == "fake-1"

            # Loopback TCP, which the harness shares, takes no reward: the pod holds no credential. The verifier
            # container's `forge verify` (root) posts on the sidecar's socket; the verifier itself runs as 65534.
            forged = net.pod.run(
                ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "-XPOST", "http://127.0.0.1:15002/reward",
                 "-d", json.dumps({"episode_id": "run9.add.0", "reward": 1.0})],
                uid=CLIENT_UID, env={"PATH": "/usr/bin:/bin"},
            )  # fmt: skip
            assert forged.stdout == "403"
            verifier = next(
                e
                for e in inject._app_container_operations(
                    ("spec", "containers", 0), {"name": "verifier"}, settings, is_verifier=True
                )
                if e["path"].endswith("env")
            )
            verifier_env = {"PATH": "/usr/bin:/bin", "FORGE_EPISODE_ID": "run9.add.0", **pod_env,
                            **{e["name"]: e["value"] for e in verifier["value"] if "value" in e}}  # fmt: skip
            verifier_env["FORGE_REWARD_SOCKET"] = verifier_env["FORGE_REWARD_SOCKET"].replace(
                inject.REWARD_DIR, str(work / "reward")
            )
            log = str(work / "termination-log")
            # In the pod's own working folder: the checkout may be closed to the verifier's uid.
            verify = ["env", "-C", str(work), *pod_forge, "verify", "--termination-log", log, "--", "sh", "-c",
                      'test "$(id -u)" = 65534 && echo 0.5 > "$FORGE_VERDICT_FILE"']  # fmt: skip
            done = net.pod.run(verify, env=verifier_env)
            assert json.loads(done.stdout)["reward"] == 0.5, done.stderr
            (reward,) = wait_for(lambda: read_rewards(str(work / "store")), what="the verifier's reward")
            assert reward["episode_id"] == "run9.add.0" and reward["reward"] == 0.5
        finally:
            if sidecar is not None:
                stop(sidecar)
            relay.close()
            net.teardown()
