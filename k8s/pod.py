"""`forge` inside the sidecar image: the commands its containers run, and nothing that needs the main environment.

The image holds the sidecar environment (mitmproxy, pyarrow; Debian's Python so uid 1337 can run it), not the
main one (torch, duckdb, ...), so the full `forge` command line cannot load there. This one has what the injected
containers and the rollout verifier call: `net-init`, `ca init`, `sidecar`, `reward` (sidecar/cli.py), `verify`
and `sidecar-ready` (below). Entry point: `python -m k8s.pod` (the image's /usr/local/bin/forge).
"""

import json
import urllib.error
import urllib.request
from pathlib import Path

import click

from forge import __version__
from forge.errors import ForgeError


@click.command(
    "verify",
    hidden=True,
    context_settings={"ignore_unknown_options": True},
    short_help="In a rollout pod: verify, post the reward.",
)
@click.option("--timeout-s", type=float, default=600.0, show_default=True)
@click.option("--termination-log", type=click.Path(path_type=Path), default=Path("/dev/termination-log"), hidden=True)
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def verify_command(timeout_s: float, termination_log: Path, command: tuple[str, ...]) -> None:
    """In a rollout pod: run the task's verifier as an unprivileged uid, post its reward to the sidecar."""
    from k8s.verify import verify_in_pod

    verdict = verify_in_pod(command, Path.cwd(), timeout_s, termination_log)
    click.echo(json.dumps(verdict.as_json()))


@click.command("sidecar-ready", hidden=True, short_help="Exit 0 once the sidecar answers.")
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


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="forge")
def pod_cli() -> None:
    """OpenForge's commands inside a rollout pod (the sidecar image)."""


def main() -> None:
    from sidecar.cli import commands as sidecar_commands

    for command in [*sidecar_commands, verify_command, sidecar_ready_command]:
        pod_cli.add_command(command)
    try:
        pod_cli.main(standalone_mode=False)
    except ForgeError as error:
        click.echo(f"forge: {error}", err=True)
        raise SystemExit(error.exit_code) from None
    except click.exceptions.Abort:
        raise SystemExit(130) from None
    except click.ClickException as error:
        error.show()
        raise SystemExit(error.exit_code) from None


if __name__ == "__main__":
    main()
