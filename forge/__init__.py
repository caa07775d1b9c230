"""OpenForge's command line and the few things every part shares (errors, cache folders)."""

__version__ = "0.1.0"
