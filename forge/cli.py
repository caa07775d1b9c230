"""`forge`: one command line for every part of OpenForge, its help grouped by part in data-flow order."""

import importlib
from typing import Any

import click

from forge import __version__
from forge.errors import ForgeError

# (section title, module with a `commands` list). Order is the data flow: serve the policy, capture, collect,
# train; Kubernetes beside them. A part whose module does not exist yet is shown as not built, never faked.
PARTS: list[tuple[str, str]] = [
    ("Policy server and model (trainer/)", "trainer.cli"),
    ("Capture (sidecar/)", "sidecar.cli"),
    ("Episodes and SQL (collector/)", "collector.cli"),
    ("Training (trainer/)", "trainer.train_cli"),
    ("Kubernetes (k8s/)", "k8s.cli"),
    ("The whole loop (forge/demo/)", "forge.demo.cli"),
    ("Evaluation, no training (forge/evaluation/)", "forge.evaluation.cli"),
]


class ForgeGroup(click.Group):
    """A click group that lists its commands under their part and turns ForgeError into one line + exit code."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sections: list[tuple[str, list[str]]] = []

    def add_part(self, title: str, commands: list[click.Command]) -> None:
        for command in commands:
            self.add_command(command)
        self.sections.append((title, [c.name for c in commands if c.name]))

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        for title, names in self.sections:
            rows = []
            for name in names:
                command = self.get_command(ctx, name)
                if command is not None and not command.hidden:
                    rows.append((name, command.get_short_help_str(limit=70)))
            with formatter.section(title):
                if rows:
                    formatter.write_dl(rows)
                else:
                    formatter.write_text("(not built yet: see the open issues)")

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except ForgeError as error:
            click.echo(f"forge: {error}", err=True)
            ctx.exit(error.exit_code)


@click.group(cls=ForgeGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="forge")
def cli() -> None:
    """OpenForge: train LLM agents inside the real harnesses they ship in.

    A sidecar intercepts the harness's model calls, serves them from the policy under training (vLLM) and
    records them token by token; the collector turns records into episodes; the trainer learns from them and
    publishes new weights back to vLLM.
    """


def _load_parts(group: ForgeGroup) -> None:
    for title, module_name in PARTS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name != module_name:
                raise
            group.add_part(title, [])
            continue
        group.add_part(title, list(module.commands))


_load_parts(cli)


def main() -> None:
    cli()
