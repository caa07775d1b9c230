"""The injector as pure functions: should this pod be injected, and the JSONPatch that does it.

`decide` reads the pod, its namespace and the namespace's opt-in label; `admit` returns the decision and its
operations: the injection (`inject_operations`), or one annotation saying why the pod was left alone. The
operations are written out explicitly, as Linkerd's injector does, so a golden patch reads as what is added and
where; JSON pointers are escaped by `jsonpointer` (`openforge.io/injected` → `openforge.io~1injected`) and every
patch is applied with `jsonpatch` before it is sent. `review` answers an AdmissionReview; the HTTPS server
(`k8s/webhook.py`) and `forge inject render` (`render`, for workloads' pod templates) are thin shells around them.

What an injected pod gets, in start order (as Istio's native-sidecar mode does it):
1. `openforge-net-init` (init container, root with NET_ADMIN/NET_RAW only, exits): `forge net-init`, the nat rules
   that send every other uid's outbound 80/443 to the sidecar, and a filter rule refusing every other uid the
   policy server's port.
2. `openforge-ca-init` (init container, uid 1337): copies the CA from its Secret into the sidecar's own emptyDir
   (mitmproxy writes into its confdir, and a Secret volume is read-only).
3. `openforge-sidecar`: a native sidecar (init container with `restartPolicy: Always`: it runs beside the app and
   a Job's pod still completes) as uid 1337, with a startup probe (the app starts once it listens) and a
   readiness probe on the admin port. Store credentials reach this container only.
4. then the pod's own init containers and containers, each with the CA bundle mounted and the trust variables
   (`SSL_CERT_FILE`, ...) and identity variables added where the container does not set them itself.
Rewards travel on a Unix socket in a volume (`openforge-reward-socket`) that only the sidecar and the verifier
container mount; the sidecar takes them from root only (the verifier container's `forge verify`, which runs the
task's verifier as uid 65534). No reward credential exists in the pod: the harness (the agent under training, an
adversary) has nothing to find, and no app container may mount a volume the injection adds.
"""

import base64
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonpatch
from jsonpointer import JsonPointer

from forge import __version__
from k8s.settings import EPISODE, HARNESS, INJECT, INJECTED, RUN, SKIPPED, TASK, VERIFIER, InjectorSettings
from sidecar.ca import CaFiles
from sidecar.replicas import parse_upstreams

NEVER_INJECTED_NAMESPACES = ("kube-system", "kube-public")
NET_INIT = "openforge-net-init"
CA_INIT = "openforge-ca-init"
SIDECAR = "openforge-sidecar"
OUR_CONTAINERS = (NET_INIT, CA_INIT, SIDECAR)
CA_VOLUME = "openforge-ca"  # the sidecar's confdir (key included): emptyDir in memory
CA_SECRET_VOLUME = "openforge-ca-secret"
BUNDLE_VOLUME = "openforge-ca-bundle"
WAL_VOLUME = "openforge-wal"
XTABLES_LOCK_VOLUME = "openforge-xtables-lock"  # iptables -w locks /run/xtables.lock: /run must be writable
TMP_VOLUME = "openforge-tmp"
REWARD_VOLUME = "openforge-reward-socket"  # emptyDir: the sidecar's reward socket, sidecar and verifier only
OUR_VOLUMES = (CA_VOLUME, CA_SECRET_VOLUME, BUNDLE_VOLUME, WAL_VOLUME, REWARD_VOLUME, XTABLES_LOCK_VOLUME, TMP_VOLUME)
CA_DIR = "/var/run/openforge/ca"
CA_SECRET_DIR = "/var/run/openforge/ca-secret"
BUNDLE_DIR = "/etc/openforge/ca-bundle"
WAL_DIR = "/var/run/openforge/wal"
REWARD_DIR = "/var/run/openforge/reward"
REWARD_SOCKET = f"{REWARD_DIR}/sidecar.sock"


# Capabilities no app container may add (named as Kubernetes does, in any case, with or without CAP_), and why.
REFUSED_CAPABILITIES = {
    "NET_ADMIN": "it could remove the iptables rules",
    "SYS_ADMIN": "it could remove the iptables rules",
    "ALL": "it could remove the iptables rules",
    "SETUID": "as root it could become the sidecar's uid, whose traffic is not redirected",
    "SETGID": "as root it could become the sidecar's gid, whose traffic is not redirected",
}
DROPPED_CAPABILITIES = ["SETUID", "SETGID"]  # dropped from every app container: root in it cannot become uid 1337


def capability(name: Any) -> str:
    """A capability as Kubernetes names it: `cap_net_admin` and `net_admin` are NET_ADMIN."""
    return str(name).upper().removeprefix("CAP_")


def _in_environment(container: dict[str, Any], how: str) -> str:
    return (
        f"container {container.get('name')} takes the reward credential into its environment ({how}): every "
        "process it starts would inherit it; only the verifier gets it, as a file"
    )


class InjectionRefused(Exception):
    """The pod asked to be injected but cannot be safely: admission is denied with this reason."""


@dataclass(frozen=True)
class Decision:
    inject: bool
    reason: str


def _opt_in(value: str | None, where: str) -> Decision | None:
    if value is None:
        return None
    if value == "enabled":
        return Decision(True, f"enabled by the {where}")
    if value == "disabled":
        return Decision(False, f"disabled by the {where}")
    return Decision(False, f"the {where} {INJECT}={value!r} is neither enabled nor disabled")


def decide(pod: dict[str, Any], namespace: str, namespace_label: str | None) -> Decision:
    """Inject or not, and why. The pod's annotation wins over its label, which wins over the namespace's label."""
    metadata = pod.get("metadata") or {}
    annotations = metadata.get("annotations") or {}
    spec = pod.get("spec") or {}
    if namespace in NEVER_INJECTED_NAMESPACES:
        return Decision(False, f"namespace {namespace} is never injected")
    if spec.get("hostNetwork"):
        return Decision(False, "hostNetwork: the iptables rules would redirect the node's own traffic")
    names = {c.get("name") for c in (spec.get("initContainers") or []) + (spec.get("containers") or [])}
    if INJECTED in annotations or SIDECAR in names:
        return Decision(False, "already injected")
    for decision in (
        _opt_in(annotations.get(INJECT), "pod annotation"),
        _opt_in((metadata.get("labels") or {}).get(INJECT), "pod label"),
        _opt_in(namespace_label, "namespace label"),
    ):
        if decision is not None:
            return decision
    return Decision(False, f"not enabled: no {INJECT}=enabled on the pod or its namespace")


def _containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return list(spec.get("initContainers") or []) + list(spec.get("containers") or [])


def _check_injectable(spec: dict[str, Any], settings: InjectorSettings, verifier: str) -> None:
    if not spec.get("containers"):
        raise InjectionRefused("the pod has no containers")
    for container in _containers(spec):
        if container.get("name") in OUR_CONTAINERS:
            raise InjectionRefused(f"the pod already has a container named {container['name']}: rename it")
        if (container.get("securityContext") or {}).get("privileged"):
            raise InjectionRefused(
                f"container {container.get('name')} is privileged: it could read the reward credential and "
                "undo the iptables rules"
            )
    # Traffic of the sidecar's uid/gid is not redirected, and NET_ADMIN could undo the rules: either would let the
    # agent's calls leave unrecorded.
    pod_context = spec.get("securityContext") or {}
    for container in _containers(spec):
        context = container.get("securityContext") or {}
        for field, what in (("runAsUser", "uid"), ("runAsGroup", "gid")):
            if context.get(field, pod_context.get(field)) == settings.proxy_uid:
                raise InjectionRefused(
                    f"container {container.get('name')} runs as {what} {settings.proxy_uid}, the sidecar's: its "
                    "traffic would bypass the sidecar"
                )
        added = {capability(c) for c in (context.get("capabilities") or {}).get("add") or []} & set(
            REFUSED_CAPABILITIES
        )
        if added:
            first = sorted(added)[0]
            raise InjectionRefused(f"container {container.get('name')} adds {first}: {REFUSED_CAPABILITIES[first]}")
        for source in container.get("envFrom") or []:
            if (source.get("secretRef") or {}).get("name") == settings.reward_token_secret:
                raise InjectionRefused(_in_environment(container, "envFrom"))
        for variable in container.get("env") or []:
            if ((variable.get("valueFrom") or {}).get("secretKeyRef") or {}).get(
                "name"
            ) == settings.reward_token_secret:
                raise InjectionRefused(_in_environment(container, f"env {variable.get('name')}"))
    if spec.get("hostPID") or spec.get("hostIPC"):
        raise InjectionRefused("hostPID/hostIPC: the pod's containers could reach the node's processes and the "
                               "sidecar's memory (the reward credential)")  # fmt: skip
    for volume in spec.get("volumes") or []:
        if volume.get("name") in OUR_VOLUMES:
            raise InjectionRefused(f"the pod already has a volume named {volume['name']}: rename it")
        if "hostPath" in volume:
            raise InjectionRefused(
                f"volume {volume.get('name')} is a hostPath: the node's files (other pods' credentials, the "
                "container runtime) are beyond what the injection protects"
            )
    for container in _containers(spec):
        ours = {m.get("name") for m in container.get("volumeMounts") or []} & set(OUR_VOLUMES)
        if ours:
            raise InjectionRefused(
                f"container {container.get('name')} mounts volume {sorted(ours)[0]}, which the injection adds: "
                "only OpenForge's containers (and the verifier, the reward socket) may"
            )
    if spec.get("shareProcessNamespace"):
        raise InjectionRefused("shareProcessNamespace lets every container read the reward credential via /proc")
    # A volume of the pod's own that holds the reward Secret may only be mounted by the verifier.
    reward_volumes = {
        v["name"]
        for v in spec.get("volumes") or []
        if (v.get("secret") or {}).get("secretName") == settings.reward_token_secret
        or any(
            (s.get("secret") or {}).get("name") == settings.reward_token_secret
            for s in (v.get("projected") or {}).get("sources") or []
        )
    }
    for container in _containers(spec):
        mounted = {m.get("name") for m in container.get("volumeMounts") or []} & reward_volumes
        if mounted and container.get("name") != verifier:
            raise InjectionRefused(
                f"container {container.get('name')} mounts the reward credential (volume {sorted(mounted)[0]}); "
                f"only the verifier ({verifier}) may"
            )


def _env_value(name: str, value: str) -> dict[str, Any]:
    return {"name": name, "value": value}


def _env_field(name: str, field_path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": field_path}}}


def identity_env(settings: InjectorSettings) -> list[dict[str, Any]]:
    """Who this pod is (downward API): the sidecar reads the episode, task and run from these."""
    return [
        _env_field("POD_NAME", "metadata.name"),
        _env_field("POD_NAMESPACE", "metadata.namespace"),
        _env_field("POD_UID", "metadata.uid"),
        _env_field("FORGE_EPISODE_ID", f"metadata.annotations['{EPISODE}']"),
        _env_field("FORGE_TASK_ID", f"metadata.annotations['{TASK}']"),
        _env_field("FORGE_RUN_ID", f"metadata.annotations['{RUN}']"),
    ]


def trust_env() -> list[dict[str, Any]]:
    """The variables that make each runtime trust the sidecar's CA (the same set `forge ca init` prints)."""
    return [_env_value(name, value) for name, value in CaFiles(Path(BUNDLE_DIR)).trust_env().items()]


def _security(uid: int, capabilities: list[str] | None = None) -> dict[str, Any]:
    context: dict[str, Any] = {
        "runAsUser": uid,
        "runAsGroup": uid,
        "runAsNonRoot": uid != 0,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    if capabilities:
        context["capabilities"]["add"] = capabilities
    return context


def net_init_container(settings: InjectorSettings) -> dict[str, Any]:
    args = ["net-init", "--proxy-uid", str(settings.proxy_uid), "--proxy-port", str(settings.proxy_port)]
    for cidr in settings.exclude_cidrs:
        args += ["--exclude-cidr", cidr]
    # The policy server's port: only the sidecar may reach it (its admin routes, unrecorded model calls).
    for port in sorted({upstream.port for upstream in parse_upstreams(settings.upstream)}):
        args += ["--reject-port", str(port)]
    return {
        "name": NET_INIT,
        "image": settings.image,
        "imagePullPolicy": settings.image_pull_policy,
        "command": ["forge"],
        "args": args,
        # iptables needs root with NET_ADMIN (and NET_RAW for its raw socket checks); nothing else.
        "securityContext": _security(0, ["NET_ADMIN", "NET_RAW"]),
        "resources": settings.init_resources.as_spec(),
        "volumeMounts": [{"name": XTABLES_LOCK_VOLUME, "mountPath": "/run"}],
    }


def ca_init_container(settings: InjectorSettings) -> dict[str, Any]:
    return {
        "name": CA_INIT,
        "image": settings.image,
        "imagePullPolicy": settings.image_pull_policy,
        "command": ["forge"],
        "args": [
            "ca",
            "init",
            "--dir",
            CA_DIR,
            "--cert",
            f"{CA_SECRET_DIR}/tls.crt",
            "--key",
            f"{CA_SECRET_DIR}/tls.key",
        ],
        "securityContext": _security(settings.proxy_uid),
        "resources": settings.init_resources.as_spec(),
        "volumeMounts": [
            {"name": CA_SECRET_VOLUME, "mountPath": CA_SECRET_DIR, "readOnly": True},
            {"name": CA_VOLUME, "mountPath": CA_DIR},
        ],
    }


def sidecar_container(settings: InjectorSettings) -> dict[str, Any]:
    args = [
        "sidecar", "--mode", "transparent", "--listen-port", str(settings.proxy_port),
        "--admin-port", str(settings.admin_port), "--upstream", settings.upstream, "--store", settings.store,
        "--wal-dir", WAL_DIR, "--ca-dir", CA_DIR, "--model-hosts", settings.model_hosts,
        "--reward-socket", REWARD_SOCKET,
    ]  # fmt: skip
    if settings.s3_endpoint:
        args += ["--s3-endpoint", settings.s3_endpoint]
    if settings.policy_model:  # else the sidecar serves the policy the server announces
        args += ["--policy-model", settings.policy_model]
    # The admin endpoint listens on loopback only (the kubelet's HTTP probes come from outside the pod), so the
    # probes run a check inside the container.
    probe = {"exec": {"command": ["forge", "sidecar-ready", "--port", str(settings.admin_port)]}}
    return {
        "name": SIDECAR,
        "image": settings.image,
        "imagePullPolicy": settings.image_pull_policy,
        "restartPolicy": "Always",
        "command": ["forge"],
        "args": args,
        # The pod's harness annotation names the harness of every call (sidecar.harness; empty when not set).
        "env": [*identity_env(settings), _env_field("FORGE_HARNESS", f"metadata.annotations['{HARNESS}']")],
        "envFrom": [{"secretRef": {"name": settings.store_secret, "optional": True}}],
        "securityContext": _security(settings.proxy_uid),
        "resources": settings.sidecar_resources.as_spec(),
        "startupProbe": {**probe, "periodSeconds": 1, "failureThreshold": 120, "timeoutSeconds": 5},
        "readinessProbe": {**probe, "periodSeconds": 5, "failureThreshold": 3, "timeoutSeconds": 5},
        "volumeMounts": [
            {"name": CA_VOLUME, "mountPath": CA_DIR},
            {"name": WAL_VOLUME, "mountPath": WAL_DIR},
            {"name": REWARD_VOLUME, "mountPath": REWARD_DIR},
            {"name": TMP_VOLUME, "mountPath": "/tmp"},
        ],
    }


def volumes(settings: InjectorSettings) -> list[dict[str, Any]]:
    # Secret files are root-owned: mode 0444 lets the non-root sidecar read them; no other container mounts
    # these volumes (an app container that names one is refused), so no other container can.
    return [
        {"name": CA_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": "16Mi"}},
        {"name": CA_SECRET_VOLUME, "secret": {"secretName": settings.ca_secret, "defaultMode": 0o444}},
        {"name": BUNDLE_VOLUME, "configMap": {"name": settings.ca_bundle_configmap}},
        {"name": WAL_VOLUME, "emptyDir": {}},
        {"name": XTABLES_LOCK_VOLUME, "emptyDir": {}},
        {"name": TMP_VOLUME, "emptyDir": {}},
        {"name": REWARD_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}},
    ]


def _pointer(*parts: str | int) -> str:
    """A JSON pointer with each part escaped (`/` → `~1`, `~` → `~0`), as RFC 6901 asks."""
    return str(JsonPointer.from_parts([str(p) for p in parts]).path)


def _add_all(path: tuple[str | int, ...], existing: Any, items: list[Any]) -> list[dict[str, Any]]:
    """Operations appending `items` to the list at `path`: the whole list when it does not exist yet."""
    if not items:
        return []
    if existing is None:
        return [{"op": "add", "path": _pointer(*path), "value": items}]
    return [{"op": "add", "path": _pointer(*path, "-"), "value": item} for item in items]


def _app_container_operations(
    path: tuple[str | int, ...], container: dict[str, Any], settings: InjectorSettings, is_verifier: bool
) -> list[dict[str, Any]]:
    """The CA bundle and our variables for one of the pod's containers; a variable it sets itself is kept."""
    own = {e.get("name") for e in container.get("env") or []}
    added = trust_env() + identity_env(settings)
    added.append(_env_value("FORGE_ADMIN_URL", f"http://127.0.0.1:{settings.admin_port}"))
    mounts = [{"name": BUNDLE_VOLUME, "mountPath": BUNDLE_DIR, "readOnly": True}]
    if is_verifier:
        added.append(_env_value("FORGE_REWARD_SOCKET", REWARD_SOCKET))
        added.append(_env_value("FORGE_SIDECAR_UID", str(settings.proxy_uid)))  # who must be listening on it
        # Read-only: connect() works on a socket there, while the verifier's code (65534; the emptyDir is mode
        # 0777) can neither remove nor replace it.
        mounts.append({"name": REWARD_VOLUME, "mountPath": REWARD_DIR, "readOnly": True})
    return (
        _add_all((*path, "env"), container.get("env"), [e for e in added if e["name"] not in own])
        + _add_all((*path, "volumeMounts"), container.get("volumeMounts"), mounts)
        # The verifier keeps SETUID/SETGID: `forge verify` (root: the sidecar takes rewards from root only) runs
        # the task's verifier as another uid (65534). No agent-written code runs in it with those capabilities.
        + ([] if is_verifier else _drop_operations(path, container))
    )


def _drop_operations(path: tuple[str | int, ...], container: dict[str, Any]) -> list[dict[str, Any]]:
    """Drop SETUID/SETGID from a container's capabilities (root without them cannot change its uid or gid)."""
    context = container.get("securityContext")
    if context is None:
        return [{"op": "add", "path": _pointer(*path, "securityContext"),
                 "value": {"capabilities": {"drop": DROPPED_CAPABILITIES}}}]  # fmt: skip
    capabilities = context.get("capabilities")
    if capabilities is None:
        return [{"op": "add", "path": _pointer(*path, "securityContext", "capabilities"),
                 "value": {"drop": DROPPED_CAPABILITIES}}]  # fmt: skip
    dropped = {capability(c) for c in capabilities.get("drop") or []}
    missing = [] if "ALL" in dropped else [c for c in DROPPED_CAPABILITIES if c not in dropped]
    return _add_all((*path, "securityContext", "capabilities", "drop"), capabilities.get("drop"), missing)


def verifier_name(pod: dict[str, Any], settings: InjectorSettings) -> str:
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    return str(annotations.get(VERIFIER) or settings.verifier_container)


def _annotate(pod: dict[str, Any], key: str, value: str) -> list[dict[str, Any]]:
    metadata = pod.get("metadata")
    if metadata is None:
        return [{"op": "add", "path": "/metadata", "value": {"annotations": {key: value}}}]
    if metadata.get("annotations") is None:
        return [{"op": "add", "path": "/metadata/annotations", "value": {key: value}}]
    return [{"op": "add", "path": _pointer("metadata", "annotations", key), "value": value}]


def inject_operations(pod: dict[str, Any], settings: InjectorSettings) -> list[dict[str, Any]]:
    """The JSONPatch that injects `pod`. InjectionRefused when it cannot be done safely."""
    spec = pod.get("spec")
    if not isinstance(spec, dict):
        raise InjectionRefused("the pod has no spec")
    verifier = verifier_name(pod, settings)
    _check_injectable(spec, settings, verifier)
    ours = [net_init_container(settings), ca_init_container(settings), sidecar_container(settings)]
    own_init = spec.get("initContainers")
    operations: list[dict[str, Any]] = []
    # Ours first: the rules and the sidecar are in place before any of the pod's own containers sends a byte.
    if own_init is None:
        operations.append({"op": "add", "path": "/spec/initContainers", "value": ours})
    else:
        operations += [{"op": "add", "path": f"/spec/initContainers/{i}", "value": c} for i, c in enumerate(ours)]
    for index, container in enumerate(own_init or []):
        at = ("spec", "initContainers", index + len(ours))
        operations += _app_container_operations(at, container, settings, container.get("name") == verifier)
    for index, container in enumerate(spec["containers"]):
        at = ("spec", "containers", index)
        operations += _app_container_operations(at, container, settings, container.get("name") == verifier)
    operations += _add_all(("spec", "volumes"), spec.get("volumes"), volumes(settings))
    return operations + _annotate(pod, INJECTED, __version__)


@dataclass(frozen=True)
class Outcome:
    decision: Decision
    operations: list[dict[str, Any]]

    def apply(self, pod: dict[str, Any]) -> dict[str, Any]:
        """The pod after the patch (a new object)."""
        return dict(jsonpatch.apply_patch(unaliased(pod), self.operations, in_place=True))


def unaliased(obj: Any) -> Any:
    """A copy sharing no list or mapping between two places (YAML anchors, or one Python list used twice, would
    otherwise let a mount added to the verifier appear in the harness too); what the API server receives as JSON
    never shares."""
    return json.loads(json.dumps(obj))


def admit(pod: dict[str, Any], namespace: str, namespace_label: str | None, settings: InjectorSettings) -> Outcome:
    """The decision and its patch: the injection, or an annotation saying why the pod was left alone."""
    decision = decide(pod, namespace, namespace_label)
    if decision.inject:
        return Outcome(decision, inject_operations(pod, settings))
    if decision.reason == "already injected":
        if _asks_injection(pod, namespace_label) and not _really_injected(pod, settings):
            raise InjectionRefused(
                f"the pod claims to be injected (annotation {INJECTED} or a container named {SIDECAR}) but lacks "
                "the injector's containers: it would run unrecorded"
            )
        return Outcome(decision, [])  # its annotations already say what happened: leave it byte for byte
    return Outcome(decision, _annotate(pod, SKIPPED, decision.reason))


def _asks_injection(pod: dict[str, Any], namespace_label: str | None) -> bool:
    metadata = pod.get("metadata") or {}
    asked = [(metadata.get("annotations") or {}).get(INJECT), (metadata.get("labels") or {}).get(INJECT)]
    return next((value == "enabled" for value in asked if value is not None), namespace_label == "enabled")


def _really_injected(pod: dict[str, Any], settings: InjectorSettings) -> bool:
    """The injector's three containers lead the init containers, as it writes them (image, command, args, user)."""
    expected = [net_init_container(settings), ca_init_container(settings), sidecar_container(settings)]
    found = ((pod.get("spec") or {}).get("initContainers") or [])[: len(expected)]
    keys = ("name", "image", "command", "args", "securityContext")
    injected = INJECTED in ((pod.get("metadata") or {}).get("annotations") or {})
    return injected and [[c.get(k) for k in keys] for c in found] == [[c.get(k) for k in keys] for c in expected]


def review(request_body: bytes, namespace_label: str | None, settings: InjectorSettings) -> dict[str, Any]:
    """The AdmissionReview (admission.k8s.io/v1) answering one request body. Never raises: a request that cannot
    be read is answered with `allowed: false` and the reason (the API server shows it to whoever created the pod).
    """
    uid = ""
    try:
        document = json.loads(request_body)
        request = document.get("request") if isinstance(document, dict) else None
        if not isinstance(request, dict):
            raise ValueError("no request object in the AdmissionReview")
        uid = str(request.get("uid") or "")
        if not uid:
            raise ValueError("the request has no uid")
        if document.get("apiVersion") != "admission.k8s.io/v1" or document.get("kind") != "AdmissionReview":
            raise ValueError("expected apiVersion admission.k8s.io/v1, kind AdmissionReview")
        kind = request.get("kind") or {}
        if kind.get("kind") != "Pod" or request.get("operation") not in (None, "CREATE"):
            return _response(uid, allowed=True)  # not ours to change (the webhook registers only pod CREATE)
        pod = request.get("object")
        if not isinstance(pod, dict):
            raise ValueError("the request has no pod object")
        namespace = str(request.get("namespace") or (pod.get("metadata") or {}).get("namespace") or "default")
    except (ValueError, AttributeError) as error:
        return _response(uid, allowed=False, code=400, message=f"malformed AdmissionReview: {error}")
    try:
        outcome = admit(pod, namespace, namespace_label, settings)
        operations = outcome.operations
        outcome.apply(pod)  # never send a patch that does not apply
    except InjectionRefused as error:
        return _response(uid, allowed=False, code=403, message=f"openforge: {error}")
    except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException, TypeError, AttributeError) as error:
        return _response(uid, allowed=False, code=400, message=f"openforge: the pod spec cannot be patched: {error}")
    if not operations:
        return _response(uid, allowed=True)
    return _response(uid, allowed=True, patch=operations)


def _response(
    uid: str, *, allowed: bool, code: int = 200, message: str = "", patch: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    response: dict[str, Any] = {"uid": uid, "allowed": allowed}
    if not allowed:
        response["status"] = {"code": code, "message": message}
    if patch is not None:
        response["patchType"] = "JSONPatch"
        response["patch"] = base64.b64encode(json.dumps(patch).encode()).decode()
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response}


# Where each workload kind keeps its pod template: `forge inject render` patches that, as the webhook later
# patches the pods made from it.
TEMPLATE_PATHS: dict[str, tuple[str, ...]] = {
    "Pod": (),
    "Deployment": ("spec", "template"),
    "StatefulSet": ("spec", "template"),
    "DaemonSet": ("spec", "template"),
    "ReplicaSet": ("spec", "template"),
    "Job": ("spec", "template"),
    "CronJob": ("spec", "jobTemplate", "spec", "template"),
}


def render(obj: Any, namespace_label: str | None, settings: InjectorSettings) -> tuple[Outcome, dict[str, Any]]:
    """`obj` (a Pod or a workload) with its pod (template) patched as the webhook would; InjectionRefused or
    ValueError when it cannot be."""
    if not isinstance(obj, dict):
        raise ValueError("not a Kubernetes object (a YAML/JSON mapping)")
    kind = obj.get("kind")
    if kind not in TEMPLATE_PATHS:
        raise ValueError(f"kind {kind!r} has no pod template (known: {', '.join(TEMPLATE_PATHS)})")
    template: Any = obj
    for key in TEMPLATE_PATHS[kind]:
        template = template.get(key) if isinstance(template, dict) else None
    if not isinstance(template, dict):
        raise ValueError(f"the {kind} has no {'.'.join(TEMPLATE_PATHS[kind])}")
    namespace = str((obj.get("metadata") or {}).get("namespace") or "default")
    outcome = admit(template, namespace, namespace_label, settings)
    operations = [
        {**op, "path": _pointer(*TEMPLATE_PATHS[kind]) + op["path"]} for op in outcome.operations
    ]  # the template's patch, moved under the workload
    return outcome, dict(jsonpatch.apply_patch(unaliased(obj), operations, in_place=True))
