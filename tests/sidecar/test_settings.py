"""The sidecar's options are declared once (sidecar/settings.py): mitmproxy's --set options and `forge sidecar`'s click
options are made from the same table, and parsed once into a frozen object; a bad value names the option."""

import dataclasses
import subprocess
from pathlib import Path
from types import SimpleNamespace

import click
import pytest

from sidecar.cli import sidecar_command
from sidecar.settings import OPTIONS, Settings

ROOT = Path(__file__).resolve().parents[2]


def as_mitmproxy_sets(**values: object) -> SimpleNamespace:
    """mitmproxy's options as the addon declares them (forge_<name>, floats as text), with these values."""
    options = {f"forge_{o.name}": o.mitmproxy_default for o in OPTIONS}
    options |= {f"forge_{name}": value for name, value in values.items()}
    return SimpleNamespace(**options)


def test_the_declared_defaults_parse_to_the_settings_defaults():
    assert Settings.parse(as_mitmproxy_sets()) == Settings()


def test_values_are_parsed_once_into_a_frozen_object():
    settings = Settings.parse(as_mitmproxy_sets(health_seconds="0.5", fsync="always", model_hosts="A.example, b"))
    assert settings.health_seconds == 0.5 and settings.fsync == "always"
    assert settings.model_hosts_set == {"a.example", "b"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.fsync = "never"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("name", "value", "said"),
    [("health_seconds", "soon", "forge_health_seconds: 'soon' is not a number"),
     ("drain_seconds", "-1", "forge_drain_seconds: -1.0 is negative"),
     ("fsync", "sometimes", "forge_fsync: 'sometimes' is not one of always, interval, never"),
     ("tokens_in", "on", "forge_tokens_in: 'on' is not one of auto, observe, off")],
)  # fmt: skip
def test_a_bad_value_names_the_option_and_what_it_takes(name, value, said):
    with pytest.raises(ValueError, match=f"^{said}$"):
        Settings.parse(as_mitmproxy_sets(**{name: value}))


def test_the_click_command_takes_its_help_defaults_and_choices_from_the_same_table():
    params = {p.name: p for p in sidecar_command.params if isinstance(p, click.Option)}
    shared = [o for o in OPTIONS if o.name in params]
    assert len(shared) >= 20, sorted(params)
    for option in shared:
        param = params[option.name]
        assert param.help is not None and param.help.startswith(option.help), option.name
        if option.choices:
            assert isinstance(param.type, click.Choice) and tuple(param.type.choices) == option.choices
        if option.name not in ("upstream", "wal_dir") and option.default not in ("", None, False):
            assert param.default == option.default, option.name


def test_mitmdump_refuses_a_bad_value_at_start(tmp_path):
    """In the sidecar's environment: the addon's `configure` turns a bad value into mitmproxy's OptionsError and
    mitmdump stops before serving anything."""
    mitmdump = ROOT / ".venv-sidecar" / "bin" / "mitmdump"
    done = subprocess.run(
        [str(mitmdump), "-s", str(ROOT / "sidecar" / "addon.py"), "--listen-host", "127.0.0.1", "--listen-port", "0",
         "--set", f"confdir={tmp_path}", "--set", f"forge_wal_dir={tmp_path / 'wal'}",
         "--set", f"forge_store={tmp_path / 'store'}", "--set", "forge_fsync=sometimes"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode != 0
    assert "OptionsError: forge_fsync: 'sometimes' is not one of always, interval, never" in done.stdout + done.stderr
    assert not (tmp_path / "wal").exists(), "the WAL was opened although the options were refused"
