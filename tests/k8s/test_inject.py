"""The injector's decision and patch, as golden files: `golden/<case>.request.json` is a real AdmissionReview
(admission.k8s.io/v1) and `golden/<case>.response.json` the answer, its base64 patch decoded so a reader can diff
the two. `FORGE_UPDATE_GOLDEN=1` rewrites the answers (then read the diff before committing it).

Every patched pod is checked beyond the golden file: the patch applies with `jsonpatch`, the pod validates with
kubernetes-validate --strict, and the reward credential reaches the sidecar and the verifier only.
"""

import base64
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonpatch
import kubernetes_validate
import pytest
import yaml

from k8s import inject
from k8s.settings import INJECTED, SKIPPED, InjectorSettings

GOLDEN = Path(__file__).parent / "golden"
# The case and the namespace label the API server's webhook entry stands for (None: the pod opted in itself).
CASES: dict[str, str | None] = {
    "namespace-enabled": "enabled",
    "annotation-enabled": None,
    "annotation-disabled-in-enabled-namespace": "enabled",
    "not-enabled": None,
    "kube-system": None,
    "already-injected": "enabled",
    "host-network": "enabled",
    "existing-init-containers-env-volumes": "enabled",
    "job-pod": "enabled",
    "annotations-need-escaping": None,
    "refused-share-process-namespace": "enabled",
    "refused-harness-mounts-reward-token": "enabled",
    "refused-harness-mounts-reward-socket": "enabled",
    "refused-volume-name-taken": "enabled",
    "refused-app-runs-as-proxy-uid": "enabled",
    "refused-app-adds-net-admin": "enabled",
    "refused-host-pid": "enabled",
    "refused-host-path": "enabled",
    "refused-reward-secret-in-env": "enabled",
    "refused-reward-secret-env-from": "enabled",
    "refused-app-adds-cap-net-admin-lower-case": "enabled",
    "refused-app-adds-all-lower-case": "enabled",
    "refused-app-adds-setuid": "enabled",
    "refused-claims-injected": "enabled",
    "refused-sidecar-named-container": "enabled",
}
KUBERNETES_VERSIONS = ("1.33.0", "1.37.0")  # native sidecars are GA from 1.33


def answer(case: str) -> dict[str, Any]:
    request = (GOLDEN / f"{case}.request.json").read_bytes()
    return inject.review(request, CASES[case], InjectorSettings())["response"]


def readable(response: dict[str, Any]) -> dict[str, Any]:
    shown = dict(response)
    if "patch" in shown:
        shown["patch"] = json.loads(base64.b64decode(shown["patch"]))
    return shown


def patched_pod(case: str) -> dict[str, Any]:
    pod = json.loads((GOLDEN / f"{case}.request.json").read_text())["request"]["object"]
    response = answer(case)
    return jsonpatch.apply_patch(pod, json.loads(base64.b64decode(response["patch"])))


def test_every_case_has_its_request_and_answer():
    requests = {p.name.removesuffix(".request.json") for p in GOLDEN.glob("*.request.json")}
    assert requests == set(CASES)


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_answer_equals_the_golden_file(case):
    shown = readable(answer(case))
    expected_file = GOLDEN / f"{case}.response.json"
    if os.environ.get("FORGE_UPDATE_GOLDEN"):
        expected_file.write_text(json.dumps(shown, indent=2) + "\n")
    assert shown == json.loads(expected_file.read_text())
    request = json.loads((GOLDEN / f"{case}.request.json").read_text())
    assert shown["uid"] == request["request"]["uid"]  # the API server matches the answer by it


INJECTED_CASES = [
    "namespace-enabled", "annotation-enabled", "existing-init-containers-env-volumes", "job-pod",
    "annotations-need-escaping",
]  # fmt: skip


def test_exactly_the_opted_in_pods_are_injected():
    patched = [c for c in sorted(CASES) if "patch" in answer(c)]
    injected = [c for c in patched if INJECTED in patched_pod(c)["metadata"]["annotations"]]
    assert injected == sorted(INJECTED_CASES)
    assert all(SKIPPED in patched_pod(c)["metadata"]["annotations"] for c in patched if c not in injected)


@pytest.mark.parametrize("case", sorted(c for c in CASES if "patch" in answer(c)))
@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_patched_pod_validates_strictly(case, version):
    kubernetes_validate.validate(patched_pod(case), version, strict=True)


@pytest.mark.parametrize("case", INJECTED_CASES)
def test_no_app_container_can_change_its_uid_or_gid(case):
    """Root with CAP_SETUID/SETGID (a container's default) could become uid 1337, whose traffic is not redirected.
    The verifier container alone keeps them: it runs `forge verify`, which reads the reward token and then runs the
    task's verifier as another uid (65534) that cannot read it."""
    pod = patched_pod(case)
    verifier = inject.verifier_name(pod, InjectorSettings())
    for container in pod["spec"]["initContainers"] + pod["spec"]["containers"]:
        if container["name"] not in inject.OUR_CONTAINERS and container["name"] != verifier:
            dropped = set(container["securityContext"]["capabilities"]["drop"])
            assert {"SETUID", "SETGID"} <= dropped or "ALL" in dropped, container["name"]


@pytest.mark.parametrize("case", INJECTED_CASES)
def test_the_reward_credential_reaches_the_sidecar_and_the_verifier_only(case):
    pod = patched_pod(case)
    assert pod["metadata"]["annotations"][INJECTED]
    holders = {
        c["name"]
        for c in pod["spec"]["initContainers"] + pod["spec"]["containers"]
        for m in c.get("volumeMounts") or []
        if m["name"] == inject.REWARD_VOLUME
    }
    has_verifier = any(c["name"] == "verifier" for c in pod["spec"]["initContainers"] + pod["spec"]["containers"])
    assert holders == ({inject.SIDECAR, "verifier"} if has_verifier else {inject.SIDECAR})
    with_token_path = {
        c["name"]
        for c in pod["spec"]["initContainers"] + pod["spec"]["containers"]
        if any(e["name"] == "FORGE_REWARD_TOKEN_FILE" for e in c.get("env") or [])
    }
    assert with_token_path <= {"verifier"}
    store_secret = {c["name"] for c in pod["spec"]["initContainers"] + pod["spec"]["containers"] if c.get("envFrom")}
    assert store_secret == {inject.SIDECAR}  # the harness could otherwise write records itself


@pytest.mark.parametrize("case", INJECTED_CASES)
def test_the_injected_pod_starts_rules_then_sidecar_then_its_own_containers(case):
    pod = patched_pod(case)
    original = json.loads((GOLDEN / f"{case}.request.json").read_text())["request"]["object"]["spec"]
    init = pod["spec"]["initContainers"]
    assert [c["name"] for c in init[:3]] == [inject.NET_INIT, inject.CA_INIT, inject.SIDECAR]
    assert [c["name"] for c in init[3:]] == [c["name"] for c in original.get("initContainers") or []]
    sidecar = init[2]
    assert sidecar["restartPolicy"] == "Always" and sidecar["securityContext"]["runAsUser"] == 1337
    assert sidecar["readinessProbe"]["exec"]["command"][-1] == "15002"
    assert set(init[0]["securityContext"]["capabilities"]["add"]) == {"NET_ADMIN", "NET_RAW"}
    for container in init[3:] + pod["spec"]["containers"]:
        env = {e["name"]: e for e in container["env"]}
        for name in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "NODE_EXTRA_CA_CERTS", "CODEX_CA_CERTIFICATE"):
            assert name in env
        assert env["FORGE_EPISODE_ID"]["valueFrom"]["fieldRef"]["fieldPath"].endswith("['openforge.io/episode-id']")
        assert [e["name"] for e in container["env"]].count("SSL_CERT_FILE") == 1


def test_the_apps_own_variables_are_kept():
    pod = patched_pod("existing-init-containers-env-volumes")
    harness = next(c for c in pod["spec"]["containers"] if c["name"] == "harness")
    assert harness["env"][0] == {"name": "SSL_CERT_FILE", "value": "/etc/ssl/team-bundle.pem"}
    assert harness["env"][1]["valueFrom"]["secretKeyRef"]["name"] == "openai"
    assert harness["volumeMounts"][0] == {"name": "workspace", "mountPath": "/workspace"}
    assert pod["spec"]["volumes"][0] == {"name": "workspace", "emptyDir": {}}


def test_annotation_keys_are_escaped_in_the_patch_paths():
    paths = [op["path"] for op in readable(answer("annotations-need-escaping"))["patch"]]
    assert "/metadata/annotations/openforge.io~1injected" in paths
    assert inject._pointer("metadata", "annotations", "a/b~c") == "/metadata/annotations/a~1b~0c"


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("kube-system", "namespace kube-system is never injected"),
        ("host-network", "hostNetwork"),
        ("not-enabled", "not enabled"),
        ("annotation-disabled-in-enabled-namespace", "disabled by the pod annotation"),
    ],
)
def test_a_skipped_pod_says_why(case, reason):
    (operation,) = readable(answer(case))["patch"]
    if operation["path"] == "/metadata/annotations":
        assert reason in operation["value"][SKIPPED]
    else:
        assert (
            operation["path"] == "/metadata/annotations/openforge.io~1inject-skipped" and reason in operation["value"]
        )


def test_an_already_injected_pod_is_left_byte_for_byte():
    assert readable(answer("already-injected")) == {"uid": answer("already-injected")["uid"], "allowed": True}


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("refused-share-process-namespace", "shareProcessNamespace"),
        ("refused-harness-mounts-reward-token", "container harness mounts the reward credential"),
        (
            "refused-harness-mounts-reward-socket",
            "container harness mounts volume openforge-reward-socket, which the injection adds",
        ),
        ("refused-volume-name-taken", "already has a volume named openforge-wal"),
        ("refused-app-runs-as-proxy-uid", "container harness runs as uid 1337, the sidecar's"),
        ("refused-app-adds-net-admin", "container harness adds NET_ADMIN"),
        ("refused-host-pid", "hostPID"),
        ("refused-host-path", "volume node-root is a hostPath"),
        ("refused-reward-secret-in-env", "container harness takes the reward credential into its environment"),
        ("refused-reward-secret-env-from", "container harness takes the reward credential into its environment"),
        ("refused-app-adds-cap-net-admin-lower-case", "container harness adds NET_ADMIN"),
        ("refused-app-adds-all-lower-case", "container harness adds ALL"),
        ("refused-app-adds-setuid", "container harness adds SETUID"),
        ("refused-claims-injected", "claims to be injected"),
        ("refused-sidecar-named-container", "claims to be injected"),
    ],
)
def test_a_pod_that_cannot_be_injected_safely_is_refused_with_the_reason(case, reason):
    response = answer(case)
    assert response["allowed"] is False and response["status"]["code"] == 403
    assert reason in response["status"]["message"] and "patch" not in response


def admission(request: Any, api_version: str = "admission.k8s.io/v1") -> bytes:
    return json.dumps({"apiVersion": api_version, "kind": "AdmissionReview", "request": request}).encode()


NOT_PATCHABLE = {"metadata": {"annotations": {"openforge.io/inject": "enabled"}}, "spec": {"containers": "harness"}}


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{not json", "malformed AdmissionReview"),
        (b"[]", "no request object"),
        (admission({}), "no uid"),
        (admission({"uid": "u1", "kind": {"kind": "Pod"}, "object": {}}, "admission.k8s.io/v1beta1"), "k8s.io/v1"),
        (admission({"uid": "u2", "kind": {"kind": "Pod"}, "operation": "CREATE", "object": "pod"}), "no pod object"),
        (admission({"uid": "u3", "kind": {"kind": "Pod"}, "namespace": "x", "object": NOT_PATCHABLE}), "cannot be"),
    ],
)
def test_a_malformed_review_gets_an_error_answer_not_a_crash(body, message):
    response = inject.review(body, None, InjectorSettings())["response"]
    assert response["allowed"] is False and message in response["status"]["message"]
    assert response["status"]["code"] == 400


def test_other_kinds_and_operations_pass_untouched():
    body = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": "u4", "kind": {"kind": "Pod"}, "operation": "UPDATE", "object": {}}}  # fmt: skip
    assert inject.review(json.dumps(body).encode(), "enabled", InjectorSettings())["response"] == {
        "uid": "u4",
        "allowed": True,
    }


def test_render_patches_a_workloads_pod_template_like_the_webhook_patches_the_pod():
    pod = json.loads((GOLDEN / "namespace-enabled.request.json").read_text())["request"]["object"]
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "agents", "namespace": "rollouts"},
        "spec": {"selector": {"matchLabels": {"app": "a"}},
                 "template": {"metadata": {"labels": {"app": "a"}}, "spec": pod["spec"]}},
    }  # fmt: skip
    _, rendered = inject.render(deployment, "enabled", InjectorSettings())
    _, rendered_pod = inject.render(pod, "enabled", InjectorSettings())
    assert rendered["spec"]["template"]["spec"] == rendered_pod["spec"]
    kubernetes_validate.validate(rendered, "1.33.0", strict=True)
    with pytest.raises(ValueError, match="kind 'Service' has no pod template"):
        inject.render({"kind": "Service"}, None, InjectorSettings())


def test_yaml_anchors_shared_between_containers_do_not_carry_the_credential_to_the_harness():
    pod = yaml.safe_load("""
apiVersion: v1
kind: Pod
metadata: {name: p, annotations: {openforge.io/inject: enabled}}
spec:
  containers:
  - {name: harness, image: h, volumeMounts: &mounts [{name: w, mountPath: /w}], env: &env [{name: A, value: b}]}
  - {name: verifier, image: v, volumeMounts: *mounts, env: *env}
  volumes: [{name: w, emptyDir: {}}]
""")
    _, rendered = inject.render(pod, None, InjectorSettings())
    harness, verifier = rendered["spec"]["containers"]
    assert [m["name"] for m in harness["volumeMounts"]] == ["w", inject.BUNDLE_VOLUME]
    assert inject.REWARD_VOLUME in [m["name"] for m in verifier["volumeMounts"]]
    assert "FORGE_REWARD_TOKEN_FILE" not in [e["name"] for e in harness["env"]]


FORGE = str(Path(sys.executable).parent / "forge")


def test_render_prints_the_injected_workload_and_refuses_in_one_line(tmp_path):
    job: dict[str, Any] = {
        "apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "j", "namespace": "rl"},
        "spec": {"template": {"metadata": {"annotations": {"openforge.io/inject": "enabled"}},
                              "spec": {"restartPolicy": "Never", "containers": [{"name": "verifier", "image": "v"}]}}},
    }  # fmt: skip
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    done = subprocess.run([FORGE, "inject", "render", "-f", str(path), "-o", "json"], capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    rendered = json.loads(done.stdout)
    kubernetes_validate.validate(rendered, "1.33.0", strict=True)
    assert rendered["spec"]["template"]["metadata"]["annotations"][INJECTED]
    assert "document 1: enabled by the pod annotation" in done.stderr

    job["spec"]["template"]["spec"]["shareProcessNamespace"] = True
    path.write_text(yaml.safe_dump(job))
    refused = subprocess.run([FORGE, "inject", "render", "-f", str(path)], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1
    assert "document 1: shareProcessNamespace" in refused.stderr


def test_the_policys_name_reaches_the_sidecar_when_the_settings_give_it():
    """A LoRA run's policy is served as forge-<run>: the injector's `policy_model` becomes the sidecar's
    --policy-model (empty: the sidecar serves what the policy server announces)."""
    request = (GOLDEN / "namespace-enabled.request.json").read_bytes()

    def sidecar_args(settings: InjectorSettings) -> list[str]:
        response = inject.review(request, "enabled", settings)["response"]
        pod = jsonpatch.apply_patch(json.loads(request)["request"]["object"],
                                    json.loads(base64.b64decode(response["patch"])))  # fmt: skip
        return next(c for c in pod["spec"]["initContainers"] if c["name"] == inject.SIDECAR)["args"]

    named = sidecar_args(InjectorSettings(policy_model="forge-run7"))
    assert named[named.index("--policy-model") + 1] == "forge-run7"
    assert "--policy-model" not in sidecar_args(InjectorSettings())
