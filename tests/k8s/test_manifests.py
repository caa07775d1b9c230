"""The kustomize base in k8s/: rendered by the real `kubectl kustomize` (offline) after `forge inject certs`, and
every object validated with kubernetes-validate --strict (its command line, as a user would run it)."""

import base64
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from k8s.settings import InjectorSettings

K8S = Path(__file__).resolve().parents[2] / "k8s"
FORGE = str(Path(sys.executable).parent / "forge")
KUBECTL = shutil.which("kubectl")
pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed (Debian image: package kubectl)")


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of k8s/ with the certificates `forge inject certs` writes (the checkout's own k8s/certs untouched)."""
    copy = tmp_path_factory.mktemp("base") / "k8s"
    shutil.copytree(K8S, copy, ignore=shutil.ignore_patterns("*.py", "__pycache__", "certs"))
    subprocess.run([FORGE, "inject", "certs", "--out", str(copy / "certs")], check=True, capture_output=True)
    return copy


@pytest.fixture(scope="module")
def rendered(base: Path) -> tuple[Path, list[dict[str, Any]]]:
    done = subprocess.run([str(KUBECTL), "kustomize", str(base)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = base.parent / "rendered.yaml"
    out.write_text(done.stdout)
    return out, [d for d in yaml.safe_load_all(done.stdout) if d]


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


@pytest.mark.parametrize("version", ["1.33.0", "1.37.0"])
def test_every_rendered_object_validates_strictly(rendered, version):
    path, objects = rendered
    done = subprocess.run(
        [sys.executable, "-m", "kubernetes_validate", "--strict", "-k", version, str(path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count(" passed for resource ") == len(objects)


def test_the_base_has_every_part(rendered):
    _, objects = rendered
    names = {(o["kind"], o["metadata"]["name"]) for o in objects}
    for part in [
        ("Namespace", "openforge-system"), ("Namespace", "openforge-rollouts"),
        ("Deployment", "openforge-injector"), ("Service", "openforge-injector"),
        ("MutatingWebhookConfiguration", "openforge-injector"), ("Deployment", "openforge-policy"),
        ("Service", "openforge-policy"), ("Service", "openforge-policy-replicas"), ("Job", "openforge-trainer"),
        ("ConfigMap", "openforge-store"),
        ("NetworkPolicy", "openforge-rollouts-egress"), ("Role", "openforge-orchestrator"),
        ("Secret", "openforge-ca"), ("ConfigMap", "openforge-ca-bundle"),
    ]:  # fmt: skip
        assert part in names


def test_the_webhook_trusts_the_generated_ca_and_never_sees_system_namespaces(rendered, base):
    _, objects = rendered
    (config,) = by_kind(objects, "MutatingWebhookConfiguration")
    ca = (base / "certs/webhook/ca.crt").read_bytes()
    for webhook in config["webhooks"]:
        assert base64.b64decode(webhook["clientConfig"]["caBundle"]) == ca
        assert webhook["failurePolicy"] == "Fail" and webhook["sideEffects"] == "None"
        excluded = next(e for e in webhook["namespaceSelector"]["matchExpressions"] if e["operator"] == "NotIn"
                        and e["key"] == "kubernetes.io/metadata.name")  # fmt: skip
        assert {"kube-system", "kube-public", "openforge-system"} <= set(excluded["values"])
    paths = [w["clientConfig"]["service"]["path"] for w in config["webhooks"]]
    assert paths == ["/inject/namespace-enabled", "/inject"]  # the paths the server gives meaning to


def test_the_injector_settings_in_the_base_are_valid_and_the_defaults(rendered):
    _, objects = rendered
    settings = next(o for o in by_kind(objects, "ConfigMap") if o["metadata"]["name"] == "openforge-injector")
    assert (
        InjectorSettings.from_mapping(yaml.safe_load(settings["data"]["settings.yaml"]), "base") == InjectorSettings()
    )


def test_the_trainer_publishes_to_every_replica_the_sidecars_route_to(rendered):
    """The trainer's --policy-url is the headless Service (every pod), the injector's sidecar upstream, not the
    load-balanced one: a publish through that would reach one pod and leave the others on old weights."""
    _, objects = rendered
    job = next(o for o in by_kind(objects, "Job") if o["metadata"]["name"] == "openforge-trainer")
    command = job["spec"]["template"]["spec"]["containers"][0]["command"]
    spec = command[command.index("--policy-url") + 1]
    assert spec == InjectorSettings().upstream == "dns+http://openforge-policy-replicas.openforge-system.svc:8000"
    headless = next(o for o in by_kind(objects, "Service") if o["metadata"]["name"] == "openforge-policy-replicas")
    assert headless["spec"]["clusterIP"] == "None"


def test_least_privilege(rendered):
    _, objects = rendered
    (role,) = by_kind(objects, "Role")
    assert role["metadata"]["namespace"] == "openforge-rollouts"
    assert {v for rule in role["rules"] for v in rule["verbs"]} <= {"create", "get", "list", "watch", "delete"}
    assert not by_kind(objects, "ClusterRole") and not by_kind(objects, "ClusterRoleBinding")
    injector = next(o for o in by_kind(objects, "Deployment") if o["metadata"]["name"] == "openforge-injector")
    assert injector["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    secrets = {(o["metadata"]["namespace"], o["metadata"]["name"]) for o in by_kind(objects, "Secret")}
    assert secrets == {("openforge-system", "openforge-injector-tls"), ("openforge-rollouts", "openforge-ca")}


def test_without_the_certificates_kustomize_says_which_file_is_missing(tmp_path):
    copy = tmp_path / "k8s"
    shutil.copytree(K8S, copy, ignore=shutil.ignore_patterns("*.py", "__pycache__", "certs"))
    done = subprocess.run([str(KUBECTL), "kustomize", str(copy)], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "certs/" in done.stderr


def test_only_rollout_pods_and_the_trainer_reach_the_policy_server(rendered):
    """Ingress to the policy pods (their admin routes included): the rollout pods, where net-init lets only the
    sidecar's uid reach the port, and the trainer, which publishes. Nothing else in the cluster."""
    _, objects = rendered
    policy = next(o for o in by_kind(objects, "Deployment") if o["metadata"]["name"] == "openforge-policy")
    labels = policy["spec"]["template"]["metadata"]["labels"]
    guarding = [
        p for p in by_kind(objects, "NetworkPolicy")
        if p["metadata"]["namespace"] == "openforge-system" and "Ingress" in p["spec"]["policyTypes"]
        and p["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    ]  # fmt: skip
    assert len(guarding) == 1
    (rule,) = guarding[0]["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 8000}]
    assert sorted(rule["from"], key=json.dumps) == sorted([
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "openforge-rollouts"}}},
        {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "openforge-trainer"}}},
    ], key=json.dumps)  # fmt: skip
