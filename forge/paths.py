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


def repo_root() -> Path:
    """The checkout this code runs from (the environments' links live there)."""
    return Path(__file__).resolve().parent.parent
