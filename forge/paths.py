"""Where OpenForge keeps what it builds once and reuses: environments, prepared models, run folders."""

import os
from pathlib import Path

SYSTEM_CACHE = Path("/var/cache/openforge")


def cache_dir() -> Path:
    """``$FORGE_CACHE``, else /var/cache/openforge when writable (other uids can read it), else ~/.cache."""
    if env := os.environ.get("FORGE_CACHE"):
        return Path(env)
    if SYSTEM_CACHE.is_dir() and os.access(SYSTEM_CACHE, os.W_OK):
        return SYSTEM_CACHE
    return Path.home() / ".cache" / "openforge"


# The embedded default policy; trainer.model prepares it there, the collector's viewer reads its tokenizer there.
DEFAULT_MODEL = "SmolLM2-135M-Instruct"


def default_model_root(cache: Path | None = None) -> Path:
    """Where the embedded default model's checkpoints are prepared (`bf16/`, `fp32/`), whether or not they are."""
    return (cache or cache_dir()) / "models" / DEFAULT_MODEL


def repo_root() -> Path:
    """The checkout this code runs from (the environments' links live there)."""
    return Path(__file__).resolve().parent.parent
