"""`forge rollout --backend k8s` against a STAND-IN for the Kubernetes API server (tests/k8s/fake_apiserver.py:
no real API server can run here). The official `kubernetes` client talks to it over HTTP unchanged; the stand-in
also plays the cluster (Jobs run, end, and leave a verifier verdict in their pod's status)."""

import json
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from kubernetes import client

from k8s import inject
from k8s.kube import KUEUE_QUEUE, KubernetesBackend, KubernetesSettings, job_manifest, job_name
from k8s.rollout import Attempt, Rollout, orchestrate, rollouts_for
from k8s.settings import EPISODE, HARNESS, INJECT, RUN, TASK, InjectorSettings
from k8s.tasks import Task
from tests.k8s.fake_apiserver import FakeApiServer
from trainer.serve import free_port

FORGE = str(Path(sys.executable).parent / "forge")
TASKS = [
    Task("ok", ("sh", "-c", "python agent.py"), ("sh", "-c", "test -f answer.txt"), prompt="2+3?"),
    Task("flaky", ("true",), ("true",)),
    Task("silent", ("true",), ("true",)),
]


def cluster(job: dict) -> tuple[str, object]:
    """What happens to each Job in the stand-in's cluster: decided by its task and attempt labels."""
    labels = job["metadata"]["labels"]
    task, attempt = labels[TASK], labels["openforge.io/attempt"]
    if task == "flaky" and attempt == "1":
        return "Failed", "pod evicted: the node was drained"
    if task == "silent":
        return "Complete", None  # a verifier that wrote no verdict
    reward = 1.0 if task == "ok" else 0.5
    return "Complete", {"reward": reward, "components": {"tests": reward}, "exit_code": 0, "detail": "ok"}


def api_client(server: FakeApiServer) -> client.ApiClient:
    configuration = client.Configuration()
    configuration.host = server.url
    return client.ApiClient(configuration)


def test_jobs_are_created_watched_retried_read_and_deleted():
    settings = KubernetesSettings(namespace="rl", queue="team-a", ttl_s=120)
    with FakeApiServer(cluster) as server:
        backend = KubernetesBackend(settings, "run1", api_client(server))
        results = orchestrate(rollouts_for(TASKS, 2, "run1"), backend, concurrency=2, retries=1)

        by_task = {t.id: [r for r in results if r.rollout.task.id == t.id] for t in TASKS}
        assert [r.verdict.reward for r in by_task["ok"] if r.verdict] == [1.0, 1.0]
        assert all(r.attempts == 1 and r.reasons == [] for r in by_task["ok"])
        assert all(r.ok and r.attempts == 2 for r in by_task["flaky"])
        assert all(r.reasons == ["BackoffLimitExceeded: pod evicted: the node was drained"] for r in by_task["flaky"])
        assert all(not r.ok and r.reasons == ["the Job completed but its verifier left no verdict"] * 2
                   for r in by_task["silent"])  # fmt: skip

        assert server.max_active == 2  # the concurrency limit, reached and never passed
        assert len(server.created) == 2 + 4 + 4  # ok x2, flaky x2 (retried once each), silent x2 (retried)
        assert sorted(name for name, _ in server.deleted) == sorted(j["metadata"]["name"] for j in server.created)
        assert {policy for _, policy in server.deleted} == {"Background"} and not server.jobs
        assert server.watches <= 2  # one watch followed the whole run (a reconnect at most), no polling loop


def test_each_job_carries_the_identity_opts_in_and_validates():
    with FakeApiServer(cluster) as server:
        backend = KubernetesBackend(KubernetesSettings(namespace="rl", queue="team-a"), "run2", api_client(server))
        orchestrate(rollouts_for(TASKS[:1], 3, "run2"), backend, concurrency=3, retries=0)
    episodes = []
    for job in server.created:
        kubernetes_validate.validate(job, "1.33.0", strict=True)
        template = job["spec"]["template"]
        annotations = template["metadata"]["annotations"]
        assert annotations[INJECT] == "enabled" and template["metadata"]["labels"][INJECT] == "enabled"
        assert annotations[TASK] == "ok" and annotations[RUN] == "run2"
        episodes.append(annotations[EPISODE])
        assert job["metadata"]["labels"][KUEUE_QUEUE] == "team-a"
        assert job["spec"]["backoffLimit"] == 0 and job["spec"]["ttlSecondsAfterFinished"] == 600
        assert template["spec"]["automountServiceAccountToken"] is False
        env = {e["name"]: e["value"] for e in template["spec"]["initContainers"][0]["env"]}
        assert env["FORGE_PROMPT"] == "2+3?"
    assert sorted(episodes) == ["run2.ok.0", "run2.ok.1", "run2.ok.2"]


def test_the_webhook_gives_the_reward_credential_to_the_jobs_verifier_only():
    job = job_manifest(Attempt(Rollout(TASKS[0], 0, "run3"), 1), KubernetesSettings())
    outcome, injected = inject.render(job, None, InjectorSettings())
    assert outcome.decision.inject
    kubernetes_validate.validate(injected, "1.33.0", strict=True)
    spec = injected["spec"]["template"]["spec"]
    holders = {c["name"] for c in spec["initContainers"] + spec["containers"]
               for m in c.get("volumeMounts") or [] if m["name"] == inject.REWARD_VOLUME}  # fmt: skip
    assert holders == {inject.SIDECAR, "verifier"}
    order = [c["name"] for c in spec["initContainers"]]
    assert order == [inject.NET_INIT, inject.CA_INIT, inject.SIDECAR, "harness"]  # the harness runs behind it
    # The verifier runs `forge verify` as root with the capability to change uid: it reads the token, then runs the
    # task's verifier as 65534 (the image's own uid, the sidecar's 1337, would leave the token readable to it and
    # its traffic unredirected). The harness cannot change its uid.
    (verifier,) = spec["containers"]
    assert verifier["securityContext"]["runAsUser"] == 0
    assert "SETUID" not in (verifier["securityContext"].get("capabilities") or {}).get("drop", [])
    harness = next(c for c in spec["initContainers"] if c["name"] == "harness")
    assert {"SETUID", "SETGID"} <= set(harness["securityContext"]["capabilities"]["drop"])


def test_a_tasks_harness_is_the_pods_annotation_and_only_the_sidecar_reads_it():
    named = Task("cc", ("claude", "-p", "hi"), ("true",), harness="claude-code")
    job = job_manifest(Attempt(Rollout(named, 0, "run4"), 1), KubernetesSettings())
    assert job["spec"]["template"]["metadata"]["annotations"][HARNESS] == "claude-code"
    plain = job_manifest(Attempt(Rollout(TASKS[0], 0, "run4"), 1), KubernetesSettings())
    assert HARNESS not in plain["spec"]["template"]["metadata"]["annotations"]
    _, injected = inject.render(job, None, InjectorSettings())
    kubernetes_validate.validate(injected, "1.33.0", strict=True)
    spec = injected["spec"]["template"]["spec"]
    readers = {c["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for c in spec["initContainers"] + spec["containers"]
               for e in c.get("env") or [] if e["name"] == "FORGE_HARNESS"}  # fmt: skip
    assert readers == {inject.SIDECAR: f"metadata.annotations['{HARNESS}']"}


def test_job_names_are_dns_labels_unique_per_attempt():
    long_task = Task("t" * 40, ("true",), ("true",))
    names = {job_name(Attempt(Rollout(long_task, i, "r" * 30), n)) for i in range(3) for n in (1, 2)}
    assert len(names) == 6 and all(len(n) <= 63 and n[0].isalpha() and n[-1].isalnum() for n in names)


def test_the_cli_runs_against_a_kubeconfig_and_exits_1_when_a_rollout_failed(tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(
        json.dumps({"id": "ok", "command": "true", "verifier": "true"}) + "\n"
        + json.dumps({"id": "silent", "command": "true", "verifier": "true"}) + "\n"
    )  # fmt: skip
    with FakeApiServer(cluster) as server:
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "stand-in",
            "clusters": [{"name": "stand-in", "cluster": {"server": server.url}}],
            "users": [{"name": "u", "user": {"token": "not-a-secret"}}],
            "contexts": [{"name": "stand-in", "context": {"cluster": "stand-in", "user": "u"}}],
        }))  # fmt: skip
        done = subprocess.run(
            [FORGE, "rollout", "--backend", "k8s", "--kubeconfig", str(kubeconfig), "--tasks", str(tasks),
             "--run-id", "cli", "--retries", "0", "--namespace", "rl", "--results", str(tmp_path / "r.jsonl")],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "run cli: 2 tasks x 1 rollouts (k8s)" in done.stdout
    assert "cli.silent.0: the Job completed but its verifier left no verdict" in done.stdout
    assert done.stderr.strip() == "forge: 1 of 2 rollouts failed (reasons above)"
    written = {r["episode_id"]: r for r in map(json.loads, (tmp_path / "r.jsonl").read_text().splitlines())}
    assert written["cli.ok.0"]["reward"] == 1.0 and written["cli.silent.0"]["ok"] is False


def test_an_unreachable_api_server_is_one_line(tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "ok", "command": "true", "verifier": "true"}) + "\n")
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text("apiVersion: v1\nkind: Config\nclusters: []\ncontexts: []\nusers: []\n")
    command = [FORGE, "rollout", "--backend", "k8s", "--kubeconfig", str(kubeconfig), "--tasks", str(tasks)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "Kubernetes configuration" in done.stderr


@pytest.mark.parametrize("status", [403, 422])
def test_a_refused_job_creation_is_one_line(status):
    class Refusing(FakeApiServer):
        def create_job(self, namespace, job):
            return status, {"kind": "Status", "code": status, "reason": "Forbidden", "message": "jobs is forbidden"}

    from forge.errors import ForgeError

    with Refusing(cluster) as server:
        backend = KubernetesBackend(KubernetesSettings(), "r", api_client(server))
        with pytest.raises(ForgeError, match=f"cannot create Job .*: {status} .*jobs is forbidden"):
            orchestrate(rollouts_for(TASKS[:1], 1, "r"), backend, concurrency=1, retries=0)


def test_a_dropped_watch_is_resumed():
    with FakeApiServer(cluster) as server:
        server.drop_watches = 1
        backend = KubernetesBackend(KubernetesSettings(namespace="rl"), "run4", api_client(server))
        results = orchestrate(rollouts_for(TASKS[:1], 2, "run4"), backend, concurrency=2, retries=0)
    assert [r.verdict.reward for r in results if r.verdict] == [1.0, 1.0]
    assert server.watches == 2 and not server.jobs


def test_an_unreachable_api_server_is_one_error_not_a_traceback():
    from forge.errors import ForgeError

    configuration = client.Configuration()
    configuration.host = f"http://127.0.0.1:{free_port()}"
    backend = KubernetesBackend(KubernetesSettings(), "r", client.ApiClient(configuration))
    with pytest.raises(ForgeError, match="cannot reach the Kubernetes API server"):
        orchestrate(rollouts_for(TASKS[:1], 1, "r"), backend, concurrency=1, retries=0)
