"""Capture: the mitmproxy addon that serves a harness's model calls from the policy and records them.

Runs inside the sidecar environment (mitmproxy, pyarrow and the stdlib only); its CLI shell runs in the main one.
"""

__version__ = "0.1.0"
