"""`forge --help` and every subcommand's `--help` say what they do; expected errors are one line, no traceback."""

import click
import pytest
from click.testing import CliRunner

from forge.cli import PARTS, cli


def all_commands(group: click.Group, prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], click.Command]]:
    found = []
    for name, command in group.commands.items():
        found.append(((*prefix, name), command))
        if isinstance(command, click.Group):
            found += all_commands(command, (*prefix, name))
    return found


def test_root_help_lists_every_part_in_data_flow_order():
    result = CliRunner().invoke(cli, ["--help"])
    assert result.exit_code == 0
    positions = [result.output.index(title) for title, _ in PARTS]
    assert positions == sorted(positions)
    for name in ("serve", "model"):
        assert f"  {name}" in result.output


@pytest.mark.parametrize("path", [p for p, c in all_commands(cli) if isinstance(c, click.Group)] + [()], ids=str)
def test_every_command_listed_in_a_help_says_what_it_does_in_a_line_of_its_own(path):
    """A help's list of commands shows each one's short help whole: no line cut with "...", none rewrapped."""
    result = CliRunner().invoke(cli, [*path, "--help"], prog_name="forge", terminal_width=80)
    listed = [line for line in result.output.split("Commands:" if path else "Options:")[-1].splitlines() if line]
    assert listed and not [line for line in listed if line.rstrip().endswith("...")], result.output
    for line in listed:
        if line.startswith("  ") and not line.startswith("   "):  # a command's row, not a continuation line
            assert line.rstrip().endswith("."), line


@pytest.mark.parametrize("path", [p for p, _ in all_commands(cli)], ids=" ".join)
def test_every_subcommand_has_help_that_says_what_it_does(path):
    result = CliRunner().invoke(cli, [*path, "--help"], prog_name="forge")
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"Usage: forge {' '.join(path)} ")
    command = dict(all_commands(cli))[path]
    assert command.help and len(command.help.split()) >= 5
    # help text rewraps, also after a hyphen ("mini-\n  swe-agent"): compared without any whitespace
    assert "".join(command.help.split("\n")[0].split()) in "".join(result.output.split())


def test_an_expected_error_is_one_line_with_a_non_zero_exit(tmp_path):
    result = CliRunner().invoke(cli, ["model", "path", "--cache", str(tmp_path)])
    assert result.exit_code != 0
    assert "Traceback" not in result.output
    assert "forge model prepare" in result.output
