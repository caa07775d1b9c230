"""Prompts stored linearly: each call's prompt as a reference to an earlier call of its episode plus a suffix.

An agent's n-th prompt is usually its (n-1)-th prompt + completion + a little more. Keeping, per episode, the
token sequence (prompt + completion) of its last few calls lets a prompt be stored as (parent call, how many of
the parent's tokens it starts with, the rest), so an episode's storage grows with its unique tokens, not with
the square of its turns. Sequences are packed int32 bytes: comparing them is a memcmp, not a Python loop.
"""

from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

T = TypeVar("T", bytes, str)


def common_prefix_len(a: bytes | memoryview, b: bytes | memoryview) -> int:
    """The number of leading int32 items two packed sequences share (binary search over memcmp)."""
    a, b = memoryview(a), memoryview(b)
    n = min(len(a), len(b)) // 4
    if a[: n * 4] == b[: n * 4]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[: mid * 4] == b[: mid * 4]:
            lo = mid
        else:
            hi = mid
    return lo


class RecentCalls(Generic[T]):
    """Per episode, (call id, item) of its last few calls; bounded in episodes and in total size (the least recently
    used episodes go first)."""

    def __init__(self, max_episodes: int, calls_per_episode: int, max_size: int, size: Callable[[T], int]) -> None:
        self.episodes: OrderedDict[str, deque[tuple[str, T]]] = OrderedDict()
        self.max_episodes = max_episodes
        self.calls_per_episode = calls_per_episode
        self.max_size = max_size
        self.size: Callable[[T], int] = size
        self.total = 0

    def of(self, episode_id: str) -> Sequence[tuple[str, T]]:
        return self.episodes.get(episode_id, ())

    def remember(self, episode_id: str, call_id: str, item: T) -> None:
        calls = self.episodes.get(episode_id)
        if calls is None:
            calls = self.episodes[episode_id] = deque()
        else:
            self.episodes.move_to_end(episode_id)
        calls.append((call_id, item))
        self.total += self.size(item)
        if len(calls) > self.calls_per_episode:
            self.total -= self.size(calls.popleft()[1])
        while self.episodes and (len(self.episodes) > self.max_episodes or self.total > self.max_size):
            _, evicted = self.episodes.popitem(last=False)
            self.total -= sum(self.size(item) for _, item in evicted)


class PrefixIndex:
    """Per episode, the sequences of its last few calls; bounded in episodes and in bytes (least recent go)."""

    def __init__(
        self, max_episodes: int = 4096, calls_per_episode: int = 4, min_prefix: int = 16, max_bytes: int = 256 << 20
    ) -> None:
        self.recent: RecentCalls[bytes] = RecentCalls(max_episodes, calls_per_episode, max_bytes, len)
        self.min_prefix = min_prefix  # shorter shared prefixes (a bare system prompt) are not worth a reference

    def split(self, episode_id: str, prompt: bytes) -> tuple[str | None, int]:
        """(parent call id, prefix length in tokens) for the best earlier call, or (None, 0)."""
        best: tuple[str | None, int] = (None, 0)
        for call_id, sequence in reversed(self.recent.of(episode_id)):
            shared = common_prefix_len(prompt, sequence)
            if shared > best[1]:
                best = (call_id, shared)
        return best if best[1] >= self.min_prefix else (None, 0)

    def sequences(self, episode_id: str) -> list[tuple[str, bytes]]:
        """The (call id, prompt + completion) of the episode's last few calls, oldest first."""
        return list(self.recent.of(episode_id))

    def remember(self, episode_id: str, call_id: str, sequence: bytes) -> None:
        self.recent.remember(episode_id, call_id, sequence)
