"""Request records stored linearly: a request that repeats an earlier call's request is stored as the difference.

An agent's n-th request is its (n-1)-th plus a turn or two: the same JSON text with new messages (or ``input``
items) spliced in where the list ends, and now and then a small change nearer the start (Claude Code's per-call
billing line, a cache marker that moved). Stored whole, an episode's request bytes grow with the square of its
turns. So each request text is compared with the last few of its episode and stored as (parent call, how many
characters it shares with the parent's text at the start, how many at the end, the text between): the parent's
``text[:prefix] + middle + text[len - suffix:]`` is the request again, character for character. The collector's
``calls`` view rebuilds it (``collector.sql``); a request that shares too little is stored whole.

The texts compared are the redacted ones the record keeps, so redaction is exactly what it was.
"""

from dataclasses import dataclass

from sidecar.prefix import RecentCalls


@dataclass(frozen=True)
class RequestDelta:
    parent_call_id: str | None  # None: ``middle`` is the whole request
    prefix_chars: int
    suffix_chars: int
    middle: str

    def apply(self, parent: str) -> str:
        return parent[: self.prefix_chars] + self.middle + parent[len(parent) - self.suffix_chars :]


def common_prefix_chars(a: str, b: str) -> int:
    """How many leading characters two strings share (binary search over slice compares: memcmp speed)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def common_suffix_chars(a: str, b: str, limit: int) -> int:
    """How many trailing characters two strings share, at most ``limit``."""
    n = min(len(a), len(b), limit)
    if n <= 0:
        return 0
    if a[len(a) - n :] == b[len(b) - n :]:
        return n
    lo, hi = 0, n
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[len(a) - mid :] == b[len(b) - mid :]:
            lo = mid
        else:
            hi = mid
    return lo


def delta(parent_call_id: str, parent: str, text: str) -> RequestDelta:
    """``text`` as a difference from ``parent``'s text (a shared start, a shared end, what lies between)."""
    prefix = common_prefix_chars(parent, text)
    suffix = common_suffix_chars(parent, text, min(len(parent), len(text)) - prefix)
    return RequestDelta(parent_call_id, prefix, suffix, text[prefix : len(text) - suffix])


class RequestIndex:
    """Per episode, the request texts of its last few recorded calls; bounded in episodes and in characters."""

    def __init__(
        self, max_episodes: int = 4096, calls_per_episode: int = 2, min_shared: int = 1024, max_chars: int = 256 << 20
    ) -> None:
        self.recent: RecentCalls[str] = RecentCalls(max_episodes, calls_per_episode, max_chars, len)
        self.min_shared = min_shared  # a shorter shared part is not worth a reference: stored whole

    def split(self, episode_id: str, text: str) -> RequestDelta:
        """The smallest difference from a remembered request of the episode, or the whole text."""
        best = RequestDelta(None, 0, 0, text)
        for call_id, parent in reversed(self.recent.of(episode_id)):
            candidate = delta(call_id, parent, text)
            if len(candidate.middle) < len(best.middle):
                best = candidate
        shared = best.prefix_chars + best.suffix_chars
        return best if best.parent_call_id is not None and shared >= self.min_shared else RequestDelta(None, 0, 0, text)

    def remember(self, episode_id: str, call_id: str, text: str) -> None:
        """A request whose record was logged (only those can be parents: the collector must find them)."""
        self.recent.remember(episode_id, call_id, text)
