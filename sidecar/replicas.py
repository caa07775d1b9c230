"""Several policy replicas: which one serves a call, and which are live.

``--upstream`` names one or more policy servers (comma-separated, or the option repeated):

- ``http://HOST:PORT`` (or https): one replica;
- ``dns+http://NAME:PORT`` (or dns+https): every address NAME resolves to, asked again every refresh — a
  Kubernetes headless Service's name, whose A/AAAA records are its ready pods.

An episode sticks to one replica so its prefix cache is reused across turns. Its first call goes to the live
replica with the highest rendezvous (highest-random-weight) hash of the episode id and the replica; later calls go
where the episode was last served, as long as that replica is live. When it is not (the health poll or a refused
connection marked it down, or DNS no longer lists it), only its episodes move — each to the live replica that
ranks highest for it — and the call records which replica it moved from. A replica that comes back takes new
episodes, not the ones that moved away (they now have their prefix cache where they are).

A replica out of step — up, but serving another policy version than the newest the others serve (one a publish
left out: ``left-out-v<n>``; one that came back with old weights), or not serving the policy's name — takes no call
while another replica is in step: its episodes move as from a replica that is down (``judge_step``). A paused
replica (a publish under way) is not judged: its version moves while it is.

Stdlib only: it runs inside the sidecar environment.
"""

import hashlib
import ipaddress
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

SCHEMES = ("http", "https")
DNS_PREFIX = "dns+"
DEFAULT_REFRESH_S = 10.0
MAX_REMEMBERED_EPISODES = 65536  # where each recent episode was served (one per pod in transparent mode)

Resolver = Callable[[str, int], list[str]]


class UpstreamError(ValueError):
    """An --upstream value that names no policy server."""


@dataclass(frozen=True)
class Upstream:
    """One item of --upstream: a replica's base URL, or a DNS name standing for several."""

    scheme: str  # http | https
    host: str
    port: int
    dns: bool = False

    @property
    def url(self) -> str:
        return base_url(self.scheme, self.host, self.port)


def base_url(scheme: str, host: str, port: int) -> str:
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def parse_upstreams(values: str | Iterable[str]) -> list[Upstream]:
    """``http://a:8000,http://b:8000`` (or several values, each possibly comma-separated) to upstreams, in order,
    without repeats. Raises UpstreamError with what to write instead."""
    items = [values] if isinstance(values, str) else list(values)
    found: list[Upstream] = []
    for item in (part.strip() for value in items for part in value.split(",")):
        if not item:
            continue
        try:
            parts = urlsplit(item)
            port = parts.port
        except ValueError as error:
            raise UpstreamError(f"--upstream {item!r}: {error}") from None
        dns = parts.scheme.startswith(DNS_PREFIX)
        scheme = parts.scheme.removeprefix(DNS_PREFIX)
        if scheme not in SCHEMES or not parts.hostname or parts.path.strip("/") or parts.query:
            raise UpstreamError(
                f"--upstream {item!r}: write http(s)://HOST:PORT for one policy server, or dns+http(s)://NAME:PORT "
                "for every address NAME resolves to (a headless Service)"
            )
        if dns and _is_address(parts.hostname):
            raise UpstreamError(f"--upstream {item!r}: dns+ needs a name to resolve, not an address")
        upstream = Upstream(scheme, parts.hostname, port or (443 if scheme == "https" else 80), dns)
        if upstream not in found:
            found.append(upstream)
    if not found:
        raise UpstreamError("--upstream is empty: name at least one policy server, e.g. http://127.0.0.1:8000")
    return found


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def resolve(name: str, port: int) -> list[str]:
    """The addresses a name resolves to (A and AAAA), sorted, without repeats."""
    answers = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in answers})


# -- rendezvous hashing (pure) ------------------------------------------------------------------------------------
def weight(key: str, replica: str) -> int:
    """The rendezvous weight of a replica for a key: a hash stable across processes and machines."""
    digest = hashlib.blake2b(f"{replica}\x00{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rendezvous(key: str, replicas: Sequence[str]) -> str:
    """The replica a key belongs to: the one with the highest weight (ties, improbable, to the smaller URL)."""
    if not replicas:
        raise ValueError("no replica to choose from")
    return max(replicas, key=lambda replica: (weight(key, replica), replica))


# -- the live set -------------------------------------------------------------------------------------------------
@dataclass
class Replica:
    url: str  # base URL, e.g. http://10.0.0.5:8000: what the record's `replica` column says
    scheme: str
    host: str
    port: int
    up: bool | None = None  # None: not polled yet (taken as live)
    reason: str | None = None  # why it was last marked down
    context: int | None = None  # its max_model_len (GET /v1/models)
    origin: str | None = None  # the dns+ upstream that listed it (None: named itself)
    version: str | None = None  # its weight version at the last poll (None: not known)
    paused: bool = False  # paused at the last poll (a publish under way)
    serves_policy: bool = True  # the policy's served name was in its model list at the last poll
    out_of_step: str | None = None  # why it takes no call although up (judge_step); None: in step

    @property
    def netloc(self) -> str:
        return self.url.split("://", 1)[1]


@dataclass(frozen=True)
class Route:
    replica: Replica
    moved_from: str | None = None  # the replica that served the episode's previous call, when it is another one
    why: str | None = None  # why it moved


class ReplicaSet:
    """The replicas --upstream names, which are live, and where each episode was last served. Thread-safe: the
    health poller marks replicas; the event loop routes calls."""

    def __init__(
        self, upstreams: list[Upstream], resolver: Resolver = resolve, refresh_s: float = DEFAULT_REFRESH_S
    ) -> None:
        self.upstreams = upstreams
        self.resolver = resolver
        self.refresh_s = refresh_s
        self.replicas: dict[str, Replica] = {}
        self.last: OrderedDict[str, str] = OrderedDict()  # episode -> URL of the replica that last served it
        self.gone: dict[str, str] = {}  # URL -> why, for replicas DNS no longer lists
        self.lock = threading.Lock()
        self.resolved_at = -1e18
        self.rotation = 0
        for upstream in upstreams:
            if not upstream.dns:
                self._add(upstream.scheme, upstream.host, upstream.port)
        if self.has_dns:
            self.refresh()

    @property
    def has_dns(self) -> bool:
        return any(u.dns for u in self.upstreams)

    def _add(self, scheme: str, host: str, port: int, origin: str | None = None) -> None:
        url = base_url(scheme, host, port)
        if url not in self.replicas:
            self.replicas[url] = Replica(url, scheme, host, port, origin=origin)
            self.gone.pop(url, None)

    def refresh(self, force: bool = False) -> list[str]:
        """Resolve the dns+ upstreams again (when due): new addresses join, ones no longer listed leave. A name
        that does not resolve now keeps what it had (a DNS hiccup must not empty the set). Returns what changed."""
        now = time.monotonic()
        if not self.has_dns or (not force and now - self.resolved_at < self.refresh_s):
            return []
        self.resolved_at = now
        changes = []
        for upstream in (u for u in self.upstreams if u.dns):
            try:
                addresses = self.resolver(upstream.host, upstream.port)
            except OSError as error:
                changes.append(f"{upstream.url}: not resolved ({error}); its replicas are kept")
                continue
            listed = {base_url(upstream.scheme, a, upstream.port): a for a in addresses}
            with self.lock:
                for url, address in listed.items():
                    if url not in self.replicas:
                        self._add(upstream.scheme, address, upstream.port, origin=upstream.url)
                        changes.append(f"{url} joined ({upstream.host})")
                for url in [u for u, r in self.replicas.items() if r.origin == upstream.url and u not in listed]:
                    del self.replicas[url]
                    self.gone[url] = f"no longer listed by {upstream.host}"
                    changes.append(f"{url} left ({upstream.host})")
        return changes

    def all(self) -> list[Replica]:
        with self.lock:
            return list(self.replicas.values())

    def live(self) -> list[Replica]:
        with self.lock:
            return [r for r in self.replicas.values() if r.up is not False]

    def any_up(self) -> bool:
        with self.lock:
            return any(r.up for r in self.replicas.values())

    def get(self, url: str) -> Replica | None:
        with self.lock:
            return self.replicas.get(url)

    def by_address(self, host: str, port: int) -> Replica | None:
        with self.lock:
            return next((r for r in self.replicas.values() if r.host == host and r.port == port), None)

    def mark(self, replica: Replica, up: bool, reason: str | None = None) -> bool:
        """Mark a replica up or down; True when that changed its state."""
        with self.lock:
            changed = replica.up is not up
            replica.up, replica.reason = up, (None if up else reason)
            return changed

    def route(self, episode: str | None, exclude: Iterable[str] = ()) -> Route:
        """The replica for an episode's next call (``exclude``: URLs just found unreachable). Without an episode,
        the live replicas in turn. With none live, the episode's own (the caller then finds it down)."""
        excluded = set(exclude)
        with self.lock:
            live = [r for r in self.replicas.values() if r.up is not False and r.url not in excluded]
            candidates = [r for r in live if r.out_of_step is None] or live
            if not candidates:
                candidates = [r for r in self.replicas.values() if r.url not in excluded] or list(
                    self.replicas.values()
                )
            if not candidates:
                raise LookupError("no policy replica is known (DNS listed none yet)")
            if episode is None:
                self.rotation += 1
                return Route(candidates[self.rotation % len(candidates)])
            previous = self.last.get(episode)
            by_url = {r.url: r for r in candidates}
            if previous in by_url:
                self.last.move_to_end(episode)
                return Route(by_url[previous])
            chosen = by_url[rendezvous(episode, list(by_url))]
            why = None
            if previous is not None:
                was = self.replicas.get(previous)
                if was is not None:
                    why = was.reason or was.out_of_step or ("unreachable" if previous in excluded else "down")
                else:
                    why = self.gone.get(previous, "gone")
            return Route(chosen, previous, why)

    def judge_step(self) -> list[tuple[Replica, str | None]]:
        """Mark each up, unpaused replica in or out of step with the others (at least two up): out when it does not
        serve the policy's name, or serves another version than the newest numbered one among the up replicas.
        Returns the replicas whose state changed, with why (None: back in step)."""
        changed: list[tuple[Replica, str | None]] = []
        with self.lock:
            up = [r for r in self.replicas.values() if r.up]
            numbered = [int(r.version) for r in up if r.version is not None and r.version.isdigit()]
            newest = str(max(numbered)) if numbered else None
            for replica in self.replicas.values():
                if replica.paused and replica.up:
                    continue
                why = None
                if replica.up and len(up) > 1:
                    if not replica.serves_policy:
                        why = "does not serve the policy"
                    elif newest is not None and replica.version is not None and replica.version != newest:
                        why = f"serves version {replica.version}, the others {newest}"
                if why != replica.out_of_step:
                    replica.out_of_step = why
                    changed.append((replica, why))
        return changed

    def served(self, episode: str, replica: Replica) -> None:
        """Remember where an episode's call went (its next call sticks there)."""
        with self.lock:
            self.last[episode] = replica.url
            self.last.move_to_end(episode)
            while len(self.last) > MAX_REMEMBERED_EPISODES:
                self.last.popitem(last=False)
