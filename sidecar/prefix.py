"""Prompts stored linearly: each call's prompt as a reference to an earlier call of its episode plus a suffix.

An agent's n-th prompt is usually its (n-1)-th prompt + completion + a little more. Keeping, per episode, the
token sequence (prompt + completion) of its last few calls lets a prompt be stored as (parent call, how many of
the parent's tokens it starts with, the rest), so an episode's storage grows with its unique tokens, not with
the square of its turns. Sequences are packed int32 bytes: comparing them is a memcmp, not a Python loop.
"""

from collections import OrderedDict, deque


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


class PrefixIndex:
    """Per episode, the sequences of its last few calls; bounded in episodes and in bytes (least recent go)."""

    def __init__(
        self, max_episodes: int = 4096, calls_per_episode: int = 4, min_prefix: int = 16, max_bytes: int = 256 << 20
    ) -> None:
        self.episodes: OrderedDict[str, deque[tuple[str, bytes]]] = OrderedDict()
        self.max_episodes = max_episodes
        self.max_bytes = max_bytes
        self.bytes = 0
        self.calls_per_episode = calls_per_episode
        self.min_prefix = min_prefix  # shorter shared prefixes (a bare system prompt) are not worth a reference

    def split(self, episode_id: str, prompt: bytes) -> tuple[str | None, int]:
        """(parent call id, prefix length in tokens) for the best earlier call, or (None, 0)."""
        best: tuple[str | None, int] = (None, 0)
        for call_id, sequence in reversed(self.episodes.get(episode_id, ())):
            shared = common_prefix_len(prompt, sequence)
            if shared > best[1]:
                best = (call_id, shared)
        return best if best[1] >= self.min_prefix else (None, 0)

    def sequences(self, episode_id: str) -> list[tuple[str, bytes]]:
        """The (call id, prompt + completion) of the episode's last few calls, oldest first."""
        return list(self.episodes.get(episode_id, ()))

    def remember(self, episode_id: str, call_id: str, sequence: bytes) -> None:
        calls = self.episodes.get(episode_id)
        if calls is None:
            calls = self.episodes[episode_id] = deque()
        else:
            self.episodes.move_to_end(episode_id)
        calls.append((call_id, sequence))
        self.bytes += len(sequence)
        if len(calls) > self.calls_per_episode:
            self.bytes -= len(calls.popleft()[1])
        while self.episodes and (len(self.episodes) > self.max_episodes or self.bytes > self.max_bytes):
            _, evicted = self.episodes.popitem(last=False)
            self.bytes -= sum(len(sequence) for _, sequence in evicted)
