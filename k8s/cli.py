"""`forge inject serve|render|certs` (the sidecar injector) and `forge rollout` (the rollout orchestrator)."""

import json
import signal
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import click
import yaml

from forge.errors import ForgeError
from k8s import certs as certs_lib
from k8s.inject import InjectionRefused, render
from k8s.settings import InjectorSettings

SETTINGS_HELP = "YAML settings (the ConfigMap's settings.yaml) [default: built-in defaults]."


@click.group("inject")
def inject_group() -> None:
    """The sidecar injector: a mutating admission webhook, and the same patch offline."""


@inject_group.command("serve")
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


@inject_group.command("render")
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


@inject_group.command("certs")
@click.option("--out", type=click.Path(path_type=Path, file_okay=False), default=Path("k8s/certs"), show_default=True)
@click.option("--service", default=certs_lib.SERVICE, show_default=True, help="The webhook's Service.")
@click.option("--namespace", default=certs_lib.NAMESPACE, show_default=True, help="The webhook's namespace.")
@click.option("--force", is_flag=True, help="Replace existing certificates (pods trusting the old CA then fail).")
def certs_command(out: Path, service: str, namespace: str, force: bool) -> None:
    """Write the webhook's serving certificate, the sidecar CA and the reward token for `kubectl apply -k k8s/`.

    Prints the caBundle (base64 of the webhook CA) for a MutatingWebhookConfiguration kept by other means.
    """
    import base64

    files = certs_lib.write_cluster_secrets(out, service, namespace, force)
    click.echo(f"forge inject: wrote {files.webhook}, {files.sidecar_ca} and {files.reward_token}", err=True)
    click.echo(base64.b64encode((files.webhook / "ca.crt").read_bytes()).decode())


@click.command("sidecar-ready", hidden=True)
@click.option("--port", type=int, default=15002, show_default=True)
def sidecar_ready_command(port: int) -> None:
    """Exit 0 when the sidecar's admin endpoint answers on loopback (the injected container's probes)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as answer:
            if answer.status == 200:
                return
    except (OSError, urllib.error.URLError) as error:
        raise ForgeError(f"the sidecar's admin endpoint on 127.0.0.1:{port} does not answer: {error}") from error
    raise ForgeError(f"the sidecar's admin endpoint on 127.0.0.1:{port} is not healthy")


commands: list[click.Command] = [inject_group, sidecar_ready_command]
