"""`forge inject serve|render|certs` (the sidecar injector) and `forge rollout` (the rollout orchestrator)."""

import json
import signal
import sys
from pathlib import Path
from typing import Any

import click
import yaml

from forge.errors import ForgeError
from k8s import certs as certs_lib
from k8s.inject import InjectionRefused, render
from k8s.pod import sidecar_ready_command, verify_command
from k8s.settings import InjectorSettings

SETTINGS_HELP = "YAML settings (the ConfigMap's settings.yaml) [default: built-in defaults]."


@click.group("inject", short_help="The sidecar injector (admission webhook).")
def inject_group() -> None:
    """The sidecar injector: a mutating admission webhook, and the same patch offline."""


@inject_group.command("serve", short_help="Serve the webhook over HTTPS.")
@click.option("--host", default="0.0.0.0", show_default=True)
@click.option("--port", type=int, default=8443, show_default=True)
@click.option("--cert", type=click.Path(path_type=Path, dir_okay=False), required=True, help="Serving certificate.")
@click.option("--key", type=click.Path(path_type=Path, dir_okay=False), required=True, help="Its private key.")
@click.option("--settings", type=click.Path(path_type=Path, dir_okay=False), help=SETTINGS_HELP)
def serve_command(host: str, port: int, cert: Path, key: Path, settings: Path | None) -> None:
    """Serve the webhook over HTTPS (POST /inject, /inject/namespace-enabled; GET /healthz) until SIGTERM."""
    from k8s.webhook import WebhookServer

    loaded = InjectorSettings.load(settings)
    try:
        server = WebhookServer(host, port, cert, key, loaded)
    except OSError as error:
        raise ForgeError(f"cannot listen on {host}:{port}: {error.strerror}") from error
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    click.echo(f"forge inject: serving https://{host}:{server.port}", err=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.httpd.server_close()


def _documents(path: str) -> list[Any]:
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
        return [d for d in yaml.safe_load_all(text) if d is not None]
    except OSError as error:
        raise ForgeError(f"cannot read {path}: {error.strerror}") from error
    except yaml.YAMLError as error:
        raise ForgeError(f"{path} is not YAML or JSON: {str(error).splitlines()[0]}") from error


@inject_group.command("render", short_help="Print the objects the webhook would make.")
@click.option("-f", "--filename", required=True, help="A Pod, Deployment, Job, ... (YAML or JSON; - for stdin).")
@click.option("-o", "--output", type=click.Choice(["yaml", "json"]), default="yaml", show_default=True)
@click.option("--namespace-label", help="The namespace's openforge.io/inject label (e.g. enabled) [default: none].")
@click.option("--settings", type=click.Path(path_type=Path, dir_okay=False), help=SETTINGS_HELP)
def render_command(filename: str, output: str, namespace_label: str | None, settings: Path | None) -> None:
    """Print the objects as the webhook would make them (the pod template of a workload is what is patched)."""
    loaded = InjectorSettings.load(settings)
    rendered = []
    for number, document in enumerate(_documents(filename), start=1):
        try:
            outcome, obj = render(document, namespace_label, loaded)
        except (InjectionRefused, ValueError) as error:
            raise ForgeError(f"{filename}, document {number}: {error}") from error
        click.echo(f"forge inject: document {number}: {outcome.decision.reason}", err=True)
        rendered.append(obj)
    if output == "json":
        click.echo(json.dumps(rendered[0] if len(rendered) == 1 else {"apiVersion": "v1", "kind": "List",
                                                                      "items": rendered}, indent=2))  # fmt: skip
    else:
        click.echo(yaml.safe_dump_all(rendered, sort_keys=False), nl=False)


@inject_group.command("certs", short_help="Write the webhook's certificate and the CA.")
@click.option("--out", type=click.Path(path_type=Path, file_okay=False), default=Path("k8s/certs"), show_default=True)
@click.option("--service", default=certs_lib.SERVICE, show_default=True, help="The webhook's Service.")
@click.option("--namespace", default=certs_lib.NAMESPACE, show_default=True, help="The webhook's namespace.")
@click.option("--force", is_flag=True, help="Replace existing certificates (pods trusting the old CA then fail).")
def certs_command(out: Path, service: str, namespace: str, force: bool) -> None:
    """Write the webhook's serving certificate and the sidecar CA for `kubectl apply -k k8s/`.

    Prints the caBundle (base64 of the webhook CA) for a MutatingWebhookConfiguration kept by other means.
    """
    import base64

    files = certs_lib.write_cluster_secrets(out, service, namespace, force)
    click.echo(f"forge inject: wrote {files.webhook} and {files.sidecar_ca}", err=True)
    click.echo(base64.b64encode((files.webhook / "ca.crt").read_bytes()).decode())


@click.command("rollout", short_help="Run G rollouts of every task.")
@click.option(
    "--tasks",
    "tasks_file",
    type=click.Path(path_type=Path, dir_okay=False),
    required=True,
    help="JSONL, one task per line (docs/kubernetes.md).",
)
@click.option("--backend", type=click.Choice(["k8s", "local"]), default="local", show_default=True)
@click.option("-G", "--group-size", type=int, default=1, show_default=True, help="Rollouts per task (GRPO's G).")
@click.option("--concurrency", type=int, default=4, show_default=True, help="Rollouts running at once.")
@click.option("--retries", type=int, default=2, show_default=True, help="More attempts for a rollout that failed.")
@click.option("--run-id", default=None, help="[default: run-<time>]")
@click.option("--results", type=click.Path(path_type=Path, dir_okay=False), help="Write one JSON line per rollout.")
@click.option("--progress/--no-progress", default=None, help="[default: when stderr is a terminal]")
@click.option("--upstream", default="http://127.0.0.1:8000", show_default=True, help="local: the policy server.")
@click.option(
    "--policy-model",
    help="local: the policy's served name, as `forge train` prints it [default: the one the server announces].",
)
@click.option("--store", default="./forge-data", show_default=True, help="local: where calls and rewards go.")
@click.option("--s3-endpoint", help="local: S3-compatible endpoint of the store.")
@click.option(
    "--workdir",
    type=click.Path(path_type=Path, file_okay=False),
    default=Path("forge-rollouts"),
    show_default=True,
    help="local: one folder per rollout below it (logs, the harness's files).",
)
@click.option("--no-sidecar", is_flag=True, help="local: run without a sidecar (nothing recorded but rewards).")
@click.option("--namespace", default="openforge-rollouts", show_default=True, help="k8s: where the Jobs run.")
@click.option("--image", default="python:3.12-slim", show_default=True, help="k8s: harness image by default.")
@click.option("--verifier-image", default="openforge/sidecar:0.1.0", show_default=True, help="k8s: holds forge.")
@click.option("--ttl", type=int, default=600, show_default=True, help="k8s: ttlSecondsAfterFinished of each Job.")
@click.option("--queue", default="", help="k8s: Kueue LocalQueue name (label kueue.x-k8s.io/queue-name).")
@click.option("--keep-jobs", is_flag=True, help="k8s: leave finished Jobs to their TTL instead of deleting them.")
@click.option("--kubeconfig", help="k8s: kubeconfig file [default: in-cluster, then ~/.kube/config].")
@click.option("--context", help="k8s: kubeconfig context.")
def rollout_command(
    tasks_file: Path, backend: str, group_size: int, concurrency: int, retries: int, run_id: str | None,
    results: Path | None, progress: bool | None, upstream: str, policy_model: str | None, store: str,
    s3_endpoint: str | None,
    workdir: Path, no_sidecar: bool, namespace: str, image: str, verifier_image: str, ttl: int, queue: str,
    keep_jobs: bool, kubeconfig: str | None, context: str | None,
) -> None:  # fmt: skip
    """Run G rollouts of every task (a Job each on Kubernetes, a process each locally) and summarise rewards."""
    import time

    from k8s import rollout as lib
    from k8s.tasks import load_tasks

    tasks = load_tasks(tasks_file)
    if group_size < 1:
        raise ForgeError("--group-size must be at least 1")
    run = run_id or time.strftime("run-%Y%m%d-%H%M%S")
    show = sys.stderr.isatty() if progress is None else progress
    out = results.open("w") if results else None

    def record(result: lib.RolloutResult) -> None:
        if out:
            out.write(json.dumps(result.as_json()) + "\n")
            out.flush()

    try:
        if backend == "k8s":
            from k8s.kube import KubernetesBackend, KubernetesSettings, load_client

            settings = KubernetesSettings(namespace, image, verifier_image, ttl, queue, keep_jobs=keep_jobs)
            kube = KubernetesBackend(settings, run, load_client(kubeconfig, context))
            done = lib.orchestrate(lib.rollouts_for(tasks, group_size, run), kube, concurrency, retries, record, show)
        else:
            done = lib.run_local(
                tasks, group_size, run, workdir, store, None if no_sidecar else upstream, concurrency, retries,
                s3_endpoint, record, show, policy_model=policy_model,
            )  # fmt: skip
    finally:
        if out:
            out.close()
    click.echo(f"run {run}: {len(tasks)} tasks x {group_size} rollouts ({backend})")
    click.echo(lib.summary(done))
    if not all(r.ok for r in done):
        raise ForgeError(f"{sum(not r.ok for r in done)} of {len(done)} rollouts failed (reasons above)", exit_code=1)


# `forge verify` and `forge sidecar-ready` run inside pods (k8s/pod.py); listed here (hidden) to try them locally.
commands: list[click.Command] = [inject_group, rollout_command, verify_command, sidecar_ready_command]
