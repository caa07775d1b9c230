"""The Kubernetes backend of `forge rollout`: one Job per rollout attempt, followed with a watch, never polled.

The Job's pod carries the episode, task and run annotations and opts in to injection, so the webhook adds the
sidecar. Inside it the harness runs first (an init container, after the injected native sidecar; its exit status
is logged, never fatal) and the verifier last (the main container, `forge verify`, which alone besides the
sidecar gets the reward credential): it posts the reward to the sidecar and leaves its verdict in its
termination message, which the orchestrator reads from the pod's status. A Job that fails (pod evicted, image
not pulled, deadline passed, reward refused) is retried by the scheduler with the reason Kubernetes gave.
Finished Jobs are deleted once read; `ttlSecondsAfterFinished` cleans up after an orchestrator that died.
"""

import contextlib
import hashlib
import json
import re
import time
from dataclasses import dataclass
from typing import Any

import urllib3

from forge.errors import ForgeError
from k8s.rollout import Attempt, Outcome, Rollout
from k8s.settings import EPISODE, HARNESS, INJECT, RUN, TASK, VERIFIER
from k8s.verify import Verdict

MANAGED_BY = "app.kubernetes.io/managed-by"
ROLLOUT_LABEL = "openforge.io/rollout"
ATTEMPT_LABEL = "openforge.io/attempt"
KUEUE_QUEUE = "kueue.x-k8s.io/queue-name"
WORKSPACE = "/workspace"
WATCH_RECONNECTS = 5


@dataclass(frozen=True)
class KubernetesSettings:
    namespace: str = "openforge-rollouts"
    image: str = "python:3.12-slim"  # a task's harness image when it names none
    verifier_image: str = "openforge/sidecar:0.1.0"  # must hold `forge` (forge verify posts the reward)
    ttl_s: int = 600
    queue: str = ""  # a Kueue LocalQueue: Kueue then admits the Jobs (quota, fair sharing)
    service_account: str = ""
    keep_jobs: bool = False


def job_name(attempt: Attempt) -> str:
    """A DNS-1123 name under 63 characters, unique per run, task, index and attempt."""
    rollout = attempt.rollout
    readable = re.sub(r"[^a-z0-9-]+", "-", f"{rollout.run_id}-{rollout.task.id}".lower()).strip("-")[:36]
    digest = hashlib.sha256(f"{rollout.episode_id}/{attempt.number}".encode()).hexdigest()[:8]
    return f"forge-{readable}-{rollout.index}-a{attempt.number}-{digest}"[:63].rstrip("-")


def label_value(value: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "-", value)[:63].strip("-_.")


def job_manifest(attempt: Attempt, settings: KubernetesSettings) -> dict[str, Any]:
    rollout = attempt.rollout
    task = rollout.task
    labels = {
        MANAGED_BY: "openforge", RUN: label_value(rollout.run_id), TASK: label_value(task.id),
        ROLLOUT_LABEL: str(rollout.index), ATTEMPT_LABEL: str(attempt.number),
    }  # fmt: skip
    job_labels = dict(labels)
    if settings.queue:
        job_labels[KUEUE_QUEUE] = settings.queue
    env = [{"name": k, "value": v} for k, v in sorted(task.env.items())]
    env.append({"name": "FORGE_PROMPT", "value": task.prompt})
    workspace = [{"name": "workspace", "mountPath": WORKSPACE}]
    # The harness's exit status is written down and the step succeeds anyway: an agent that fails its task
    # still gets a verdict (reward 0), and only infrastructure failures make the Job fail and be retried.
    harness = {
        "name": "harness", "image": task.image or settings.image, "workingDir": WORKSPACE,
        "command": ["sh", "-c", 'status=0; "$@" || status=$?; echo "harness exited $status"; exit 0', "harness",
                    *task.command],
        "env": env, "volumeMounts": workspace,
    }  # fmt: skip
    verifier = {
        "name": "verifier", "image": task.verifier_image or settings.verifier_image, "workingDir": WORKSPACE,
        "command": ["forge", "verify", "--timeout-s", str(int(task.timeout_s)), "--", *task.verifier],
        "env": [dict(e) for e in env], "volumeMounts": [dict(m) for m in workspace],
        "terminationMessagePolicy": "File",
        # Root, so `forge verify` can post on the sidecar's reward socket (it takes rewards from root only) and run
        # the task's verifier (which reads agent-written files) as uid 65534, which cannot; the image's own user
        # (1337, the sidecar's) would also pass the socket's check and put the verifier's traffic outside the redirect.
        # No privilege escalation: root's setuid() to 65534 still works (CAP_SETUID); a setuid or file-capability
        # program in the verifier's image no longer takes 65534 back to root (whose rewards the sidecar takes).
        "securityContext": {"runAsUser": 0, "runAsGroup": 0, "allowPrivilegeEscalation": False},
    }  # fmt: skip
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,  # the agent must not reach the API server (and the Secrets)
        "enableServiceLinks": False,
        "initContainers": [harness],
        "containers": [verifier],
        "volumes": [{"name": "workspace", "emptyDir": {}}],
    }
    if settings.service_account:
        pod_spec["serviceAccountName"] = settings.service_account
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": job_name(attempt), "namespace": settings.namespace, "labels": job_labels},
        "spec": {
            "backoffLimit": 0,  # retries are the orchestrator's, with a reason each
            "activeDeadlineSeconds": int(task.timeout_s) + 300,  # + image pulls and the sidecar's start
            "ttlSecondsAfterFinished": settings.ttl_s,
            "template": {
                "metadata": {
                    "labels": {**labels, INJECT: "enabled"},  # the label lets the API server select the pod
                    "annotations": {
                        INJECT: "enabled",
                        EPISODE: attempt.episode_id,
                        TASK: task.id,
                        RUN: rollout.run_id,
                        VERIFIER: "verifier",
                        **({HARNESS: task.harness} if task.harness else {}),
                    },
                },
                "spec": pod_spec,
            },
        },
    }


def finished(job: dict[str, Any]) -> str | None:
    """'Complete' or 'Failed' once the Job is done (from its conditions), else None."""
    for condition in (job.get("status") or {}).get("conditions") or []:
        if condition.get("type") in ("Complete", "Failed") and condition.get("status") == "True":
            return str(condition["type"])
    return None


def failure_reason(job: dict[str, Any]) -> str:
    for condition in (job.get("status") or {}).get("conditions") or []:
        if condition.get("type") == "Failed":
            return f"{condition.get('reason') or 'Failed'}: {condition.get('message') or 'the Job failed'}"
    return "the Job failed"


def verdict_of(pods: list[dict[str, Any]]) -> Verdict | None:
    """The verifier's verdict, from its termination message in the pod's status."""
    for pod in pods:
        for status in (pod.get("status") or {}).get("containerStatuses") or []:
            terminated = (status.get("state") or {}).get("terminated") or {}
            if status.get("name") == "verifier" and terminated.get("exitCode") == 0 and terminated.get("message"):
                try:
                    data = json.loads(terminated["message"])
                    components = {str(k): float(v) for k, v in (data.get("components") or {}).items()}
                    return Verdict(float(data["reward"]), components, int(data.get("exit_code", 0)),
                                   str(data.get("detail", "")))  # fmt: skip
                except (ValueError, KeyError, TypeError, AttributeError):
                    return None
    return None


class KubernetesBackend:
    """Jobs through the official `kubernetes` client; finished Jobs come from one watch on the run's label."""

    def __init__(self, settings: KubernetesSettings, run_id: str, api_client: Any = None) -> None:
        from kubernetes import client

        self.settings = settings
        self.run_id = run_id
        self.api_client = api_client or client.ApiClient()
        self.batch = client.BatchV1Api(self.api_client)
        self.core = client.CoreV1Api(self.api_client)
        self.running: dict[str, Attempt] = {}
        self.resource_version: str | None = None
        self.events: Any = None

    def start(self, attempt: Attempt) -> None:
        from kubernetes.client.exceptions import ApiException

        manifest = job_manifest(attempt, self.settings)
        name = manifest["metadata"]["name"]
        self.running[name] = attempt
        try:
            # The client serialises a plain dict as it is (its stubs ask for a V1Job).
            self.batch.create_namespaced_job(self.settings.namespace, manifest)  # type: ignore[arg-type]
        except ApiException as error:
            self.running.pop(name)
            raise ForgeError(f"cannot create Job {name}: {error.status} {error.reason}: {_message(error)}") from error
        except (urllib3.exceptions.HTTPError, OSError) as error:
            self.running.pop(name)
            raise ForgeError(f"cannot reach the Kubernetes API server: {error}") from error

    def _stream(self) -> Any:
        from kubernetes import watch

        kwargs: dict[str, Any] = {"label_selector": f"{RUN}={label_value(self.run_id)},{MANAGED_BY}=openforge"}
        if self.resource_version:
            kwargs["resource_version"] = self.resource_version
        return watch.Watch().stream(self.batch.list_namespaced_job, self.settings.namespace, timeout_seconds=300,
                                    **kwargs)  # fmt: skip

    def wait(self) -> tuple[Attempt, Outcome]:
        from kubernetes.client.exceptions import ApiException

        broken = 0
        while True:
            if self.events is None:
                self.events = self._stream()
            try:
                event = next(self.events)
            except StopIteration:  # the server closed the watch (its timeout): resume from where it was
                self.events = None
                continue
            except ApiException as error:
                if error.status == 410:  # our resourceVersion is too old: start over (finished Jobs show again)
                    self.resource_version, self.events = None, None
                    continue
                raise ForgeError(f"watching Jobs failed: {error.status} {error.reason}") from error
            except (urllib3.exceptions.HTTPError, OSError) as error:  # a dropped connection: watch again, a few times
                self.events = None
                broken += 1
                if broken > WATCH_RECONNECTS:
                    raise ForgeError(f"lost the watch on Jobs {broken} times in a row: {error}") from error
                time.sleep(min(2.0**broken, 30))
                continue
            broken = 0
            job = event["raw_object"] if "raw_object" in event else event["object"]
            if not isinstance(job, dict):
                job = self.api_client.sanitize_for_serialization(job)
            self.resource_version = (job.get("metadata") or {}).get("resourceVersion") or self.resource_version
            name = (job.get("metadata") or {}).get("name")
            state = finished(job)
            if name not in self.running or state is None:
                continue
            attempt = self.running.pop(name)
            outcome = self._outcome(name, state, job)
            if not self.settings.keep_jobs:
                self._delete(name)
            return attempt, outcome

    def _outcome(self, name: str, state: str, job: dict[str, Any]) -> Outcome:
        if state == "Failed":
            return Outcome(None, failure_reason(job))
        pods = self.core.list_namespaced_pod(self.settings.namespace, label_selector=f"job-name={name}")
        verdict = verdict_of(self.api_client.sanitize_for_serialization(pods).get("items") or [])
        if verdict is None:
            return Outcome(None, "the Job completed but its verifier left no verdict")
        return Outcome(verdict)

    def _delete(self, name: str) -> None:
        from kubernetes.client.exceptions import ApiException

        try:
            self.batch.delete_namespaced_job(name, self.settings.namespace, propagation_policy="Background")
        except ApiException as error:
            if error.status != 404:  # already gone (its TTL) is fine
                raise ForgeError(f"cannot delete Job {name}: {error.status} {error.reason}") from error

    def cancel(self) -> None:
        for name in list(self.running):
            with contextlib.suppress(ForgeError):  # the TTL removes it later
                self._delete(name)
        self.running.clear()


def _message(error: Any) -> str:
    try:
        return str(json.loads(error.body).get("message"))
    except (TypeError, ValueError, AttributeError):
        return str(error.body or "")


def load_client(kubeconfig: str | None, context: str | None) -> Any:
    """An ApiClient from a kubeconfig (or the pod's service account when run in a cluster)."""
    from kubernetes import client, config

    try:
        if kubeconfig or context:
            return config.new_client_from_config(config_file=kubeconfig, context=context)
        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        return client.ApiClient()
    except (config.ConfigException, OSError) as error:
        raise ForgeError(f"no Kubernetes configuration: {error}") from error


__all__ = ["KubernetesBackend", "KubernetesSettings", "Rollout", "job_manifest", "load_client"]
