"""Whom a call belongs to: its episode, task and run, and how far a client's own word counts.

The operator's flags come first (``--episode-id``, ``--task-id``, ``--run-id``). In a pod (``POD_UID`` or
``FORGE_EPISODE_ID`` from the downward API) the pod's identity comes next and what a client says (the
``x-forge-episode-id``/``x-forge-task-id`` headers, a regular-mode proxy user name) is ignored and counted, unless
``--trust-episode-header``: the agent under training runs shell commands in that pod and could relabel its own
calls. Outside a pod (a local rollout, a user's own proxy) the client's word is taken.
"""

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sidecar.metrics import Metrics

if TYPE_CHECKING:  # the sidecar's environment has mitmproxy; the main one reads this module without it
    from mitmproxy import http

log = logging.getLogger("openforge.sidecar")

EPISODE_HEADER = "x-forge-episode-id"
TASK_HEADER = "x-forge-task-id"


@dataclass(frozen=True)
class Rules:
    """What decides an identity, besides what the call itself says."""

    episode_id: str  # --episode-id ("" when not given)
    task_id: str
    run_id: str
    trust_client: bool  # --trust-episode-header
    pod_episode: str | None  # the pod's episode (downward API), when the sidecar runs in one
    default_episode: str  # for a call nobody names: "<sidecar id>-default"


def header_map(headers: "http.Headers") -> dict[str, str]:
    """A request's headers as lower-case name → first value, read from mitmproxy's raw fields in one pass (its
    multidict lookups cost more than the whole read when a call asks for several). Bytes that are not UTF-8 become
    U+FFFD: a lone surrogate (``surrogateescape``) could not be bound by the WAL's SQLite or written as UTF-8."""
    found: dict[str, str] = {}
    for name, value in headers.fields:
        found.setdefault(name.decode("latin-1").lower(), value.decode("utf-8", "replace"))
    return found


def proxy_identity(user: str | None) -> tuple[str | None, str | None]:
    """Episode and task from a regular-mode proxy user name: ``EPISODE`` or ``EPISODE;task=TASK`` (the password
    is never read: it may hold a secret). `forge rollout`'s local backend names both."""
    if not user:
        return None, None
    episode, _, rest = user.partition(";task=")
    return episode or None, rest or None


def identify(
    rules: Rules, headers: Mapping[str, str], proxy_user: str | None, metrics: Metrics,
    environ: Mapping[str, str] = os.environ,
) -> tuple[str, str | None, str]:  # fmt: skip
    """Episode, task and run of one call (see the module's docstring for the order)."""
    user_episode, user_task = proxy_identity(proxy_user)
    claimed_episode = user_episode or headers.get(EPISODE_HEADER)
    claimed_task = user_task or headers.get(TASK_HEADER)
    pod_task = environ.get("FORGE_TASK_ID")
    if rules.pod_episode and not rules.trust_client:
        episode = rules.episode_id or rules.pod_episode
        task = rules.task_id or pod_task or None
        if (claimed_episode and claimed_episode != episode) or (claimed_task and claimed_task != task):
            metrics.inc("episode_relabel_refused_total")
            if metrics.get("episode_relabel_refused_total") == 1:
                log.warning(
                    "a client named another episode or task than the pod's (%s): ignored, counted in "
                    "episode_relabel_refused_total (--trust-episode-header allows it)",
                    episode,
                )
    else:
        episode = rules.episode_id or claimed_episode or rules.pod_episode or rules.default_episode
        task = rules.task_id or claimed_task or pod_task or None
    run = rules.run_id or environ.get("FORGE_RUN_ID") or "default"
    return episode, task, run
