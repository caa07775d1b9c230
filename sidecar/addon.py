"""OpenForge's mitmproxy addon: serve a harness's model calls from the policy and record them token by token.

Run by `forge sidecar` as ``mitmdump -s sidecar/addon.py``. The hooks below are the table of contents:

- ``requestheaders``: is this a model call (host, method and path)? If not, stream it through untouched,
  unrecorded. Codex's WebSocket upgrade is refused here at once (it then falls back to POST).
- ``request``: route it to the policy server, map the model name, ask for token ids and logprobs (Anthropic
  Messages are translated to Chat Completions, which return ids; see ``apis/messages.py``).
- ``responseheaders``: stream SSE answers live, one event at a time, gathering ids and hiding them.
- ``response``: hide the added fields from a whole answer; log the call record before the harness gets it.
- ``error``: a client that hung up or an upstream that reset: record what was seen, marked truncated.
- ``tls_clienthello`` (transparent mode): open TLS only for model hosts (by SNI), pass the rest through untouched;
  pick h2 for an opened one when the client offers it, as the real model host would.

Beside the hooks, each concern lives in a module named for it: ``identity`` (whose call it is), ``version`` (the
policy version around each call), ``replicas`` (which policy server serves it), ``guard`` (``PolicyGuard``, whose
hooks ``Forge``'s run after their own: mitmproxy dispatches to one addon; a policy server that cannot be reached,
or answers an error that is not JSON, gets the harness an error in its API's own format instead of mitmproxy's HTML
page; the call is recorded), ``continuation`` (tokens-in),
``apis`` (the wire formats), ``writer`` (the WAL and the store).

Recording is fail-open: any exception in our code is logged and counted, and the harness's call goes on.
"""

import asyncio
import atexit
import fnmatch
import itertools
import json
import logging
import os
import sys
import threading
import time
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from mitmproxy import ctx, http

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # mitmdump loads this file as a script

from sidecar import __version__ as SIDECAR_VERSION
from sidecar import apis, codec, harness, identity, response_store, transparent
from sidecar.admin import DEFAULT_TOKEN_FILE, AdminServer, TokenFileError, create_token_file, read_token_file
from sidecar.apis.base import Sampled, Served, StreamState, WireApi
from sidecar.apis.errors import error_body, error_headers
from sidecar.continuation import Continuations, Decision, caused_by_tokens_in, note_of
from sidecar.guard import PolicyGuard
from sidecar.metrics import Metrics
from sidecar.policy import announced_policy, policy_context
from sidecar.prefix import PrefixIndex
from sidecar.record import SAMPLING_KEYS, CallRecord, checked_row
from sidecar.redact import (
    configured_secrets,
    redacted_json,
    redacted_text,
    scrub_text,
    secrets_in_body,
    secrets_in_headers,
)
from sidecar.replicas import Replica, ReplicaSet, Route, UpstreamError, parse_upstreams
from sidecar.request_delta import RequestDelta, RequestIndex
from sidecar.response_store import NotFound, ResponseStore, input_items
from sidecar.sse import EventFramer
from sidecar.store import open_store
from sidecar.version import Asked, VersionClock, version_text
from sidecar.writer import RecordWriter, now_us, pack_floats, pack_ids

log = logging.getLogger("openforge.sidecar")
HOP_SECRETS = ("authorization", "x-api-key", "api-key")  # the policy server needs none of the harness's keys
_STRIPPED = tuple(name.encode() for name in (identity.EPISODE_HEADER, identity.TASK_HEADER, *HOP_SECRETS))
DEFAULT_MODEL_HOSTS = "api.openai.com,api.anthropic.com"
MAX_RECORDED_BODY = 4 << 20  # bodies bigger than this are recorded as a note, not copied
CONTEXT_RETRY_S = 10.0  # how often calls may ask a policy server that did not say its context (max_model_len)
VERSION_POLL_TIMEOUT_S = 5.0  # the health poll's version question (answered between two engine steps)
PROBE_TIMEOUT_S = 2.0  # a replica that does not accept a connection within this is taken as down


@dataclass
class Call:
    """One model call in flight (kept in ``flow.metadata``)."""

    call_id: str
    api: str
    episode_id: str
    task_id: str | None
    run_id: str
    seq: int
    started_at: int
    host: str = ""
    path: str = ""
    model_requested: str | None = None
    request_json: str | None = None
    secrets: list[str] = field(default_factory=list)
    policy_version: str | None = None  # the server's weight version just before the call was sent
    policy_model: str | None = None  # the policy's served name when the call was sent: its version is the policy's
    module: WireApi | None = None  # the wire API's module in sidecar.apis
    added: Served | None = None  # its Additions
    stream: StreamState | None = None  # a streamed answer's state
    framer: EventFramer | None = None
    first_token_at: int | None = None
    recorded: bool = False
    stream_failed: bool = False
    error: str | None = None
    sampling: str | None = None  # the sampling parameters sent upstream (JSON)
    bound: apis.CompletionBound | None = None  # how the completion's length was bounded
    harness: str | None = None  # which harness made the call (sidecar.harness)
    user_agent: str | None = None
    continuation: Decision | None = None  # what tokens-in continuation found (sidecar/continuation.py)
    replica: Replica | None = None  # the policy replica it was sent to (sidecar/replicas.py)
    moved_from: str | None = None  # the replica that served the episode's previous call, when it moved
    moved_why: str | None = None
    version_why: str | None = None  # why the record's version is unknown, for its note
    group: list[tuple[dict[str, Any], bool, str]] | None = None  # set: its record waits for the group commit


def moved_note(call: Call, note: str | None) -> str | None:
    """The record's note with the replica move said, when the episode moved to another replica for this call."""
    if call.moved_from is None:
        return note
    moved = f"moved from replica {call.moved_from} ({call.moved_why or 'down'})"
    return "; ".join(filter(None, [note, moved]))


class Forge:
    def __init__(self) -> None:
        self.metrics = Metrics()
        self.prefixes = PrefixIndex()
        self.requests = RequestIndex()
        self.stored_responses = ResponseStore()  # Responses answers served with store on, per episode
        self.tokens_in_mode = "off"
        self.continuations: dict[str, Continuations] = {}  # per replica URL
        self.in_flight: dict[str, tuple[http.HTTPFlow, Call]] = {}  # calls begun, not yet recorded
        self.versions: dict[str, VersionClock] = {}  # per replica URL: asks its weight version around each call
        self.writer: RecordWriter | None = None
        self.admin: AdminServer | None = None
        self.policy_version: str | None = None  # fixed by --policy-version; else asked per call
        self.policy_model: str | None = None
        self.context_asked: dict[str, float] = {}  # replica URL -> when a call last asked its context
        self.model_hosts: set[str] = set()
        self.model_map: list[tuple[str, str]] = []
        self.replicas = ReplicaSet(parse_upstreams("http://127.0.0.1:8000"))
        # Model calls routed but not yet connected, by (client connection, replica address): `server_connect` finds
        # the flows a new upstream connection is for, and moves them when their replica refuses it.
        self.connecting: dict[tuple[str, tuple[str, int]], list[http.HTTPFlow]] = {}
        self.sidecar_id = ""
        self.secrets: list[str] = []
        self.pod_episode: str | None = None  # the pod's identity (downward API), when the sidecar runs in one
        self.stop = threading.Event()
        # Call ids: a random prefix per process + a counter (uuid4 per call costs a urandom syscall).
        self.call_prefix = uuid.uuid4().hex[:16]
        self.call_numbers = itertools.count()
        # Records of whole answers waiting for their group commit: (call, row, probe, status, done).
        self.staged: list[tuple[Call, dict[str, Any], bool, str, asyncio.Future[int | None]]] = []
        # The policy guard's hooks run from these (one addon for mitmproxy to dispatch to, not two).
        self.guard = PolicyGuard(self.metrics)

    # -- options and lifecycle ------------------------------------------------------------------------------
    def load(self, loader: Any) -> None:
        add = loader.add_option
        add("forge_upstream", str, "http://127.0.0.1:8000", "The policy servers (vLLM replicas): "
            "comma-separated http(s)://HOST:PORT, or dns+http(s)://NAME:PORT for every address of NAME.")  # fmt: skip
        add("forge_upstream_refresh_seconds", str, "10", "How often dns+ upstreams are resolved again.")
        add("forge_health_seconds", str, "2", "How often each replica's model list is asked (context, up or down).")
        add("forge_store", str, "./forge-data", "Where records go: a folder or s3://bucket/prefix.")
        add("forge_s3_endpoint", str, "", "Endpoint of an S3-compatible server (e.g. http://127.0.0.1:9000).")
        add("forge_wal_dir", str, "./forge-wal", "Local write-ahead log folder (replayed at start).")
        add("forge_episode_id", str, "", "Episode id of every call (else proxy user, header, or environment).")
        add("forge_task_id", str, "", "Task id of every call.")
        add("forge_run_id", str, "", "Run id of every call.")
        add("forge_policy_model", str, "", "Served name of the policy under training (default: the one the "
            "server announces: its only LoRA adapter, else its base model).")  # fmt: skip
        add("forge_model_map", str, "*", "Comma-separated PATTERN[=MODEL]: requested names served by MODEL.")
        add("forge_policy_version", str, "", "Fixed policy version (default: polled from /weight_info).")
        add("forge_model_hosts", str, DEFAULT_MODEL_HOSTS, "Comma-separated hosts whose model paths are taken.")
        add("forge_max_completion_tokens", int, 0, "Bound every completion to this many tokens (0: as asked).")
        add("forge_admin_port", int, 0, "Loopback port of the admin endpoint (POST /reward, GET /metrics); 0: off.")
        add("forge_reward_socket", str, "", "Unix socket for POST /reward from root or the sidecar's uid only (a "
            "pod's verifier); loopback TCP then takes no reward unless a token file is given too.")  # fmt: skip
        add("forge_reward_token_file", str, "", "File holding the bearer token POST /reward needs (default: a new "
            "random one, mode 0600, in the WAL folder).")  # fmt: skip
        add("forge_trust_episode_header", bool, False, "In a pod (POD_UID or FORGE_EPISODE_ID set), let a client's "
            "x-forge-episode-id/x-forge-task-id header or proxy user name choose its episode.")  # fmt: skip
        add("forge_flush_rows", int, 2000, "Close a WAL segment after this many records.")
        add("forge_flush_bytes", int, 64 << 20, "Close a WAL segment after this many bytes.")
        add("forge_flush_seconds", str, "5.0", "Close a WAL segment after this many seconds.")
        add("forge_max_wal_bytes", int, 4 << 30, "Bound of the WAL on disk; past it new records are dropped.")
        add("forge_fsync", str, "interval", "When WAL commits reach the disk: always | interval (1 s) | never.")
        add("forge_drain_seconds", str, "20", "On SIGTERM, wait this long for calls in flight before cutting them.")
        add("forge_tokens_in", str, "auto", "Re-tokenized history: auto (serve it tokens-in from the sampled ids), "
            "observe (only record it), off.")  # fmt: skip
        add("forge_tls_passthrough", bool, False, "Open TLS only for model hosts (by SNI); pass the rest through.")

    def running(self) -> None:
        o = ctx.options
        try:
            upstreams = parse_upstreams(o.forge_upstream)
            self.replicas = ReplicaSet(upstreams, refresh_s=float(o.forge_upstream_refresh_seconds))
        except (UpstreamError, ValueError) as error:
            log.error("%s: the sidecar stops", error)
            ctx.master.shutdown()
            return
        self.model_hosts = {h.strip().lower() for h in o.forge_model_hosts.split(",") if h.strip()}
        self.model_hosts |= {u.url.split("://", 1)[1].lower() for u in upstreams}
        self.model_map = [
            (pattern.strip(), target.strip())
            for pattern, _, target in (p.partition("=") for p in o.forge_model_map.split(","))
        ]
        self.secrets = configured_secrets()
        store = open_store(o.forge_store, o.forge_s3_endpoint or None)
        self.writer = RecordWriter(
            Path(o.forge_wal_dir), store, self.metrics, max_rows=o.forge_flush_rows, max_bytes=o.forge_flush_bytes,
            max_age_s=float(o.forge_flush_seconds), max_disk_bytes=o.forge_max_wal_bytes, fsync=o.forge_fsync,
        ).start()  # fmt: skip
        self.sidecar_id = self.writer.sidecar_id
        self.policy_model = o.forge_policy_model or None
        self.tokens_in_mode = Continuations(o.forge_tokens_in).mode  # checked here: a bad mode stops the start
        self.policy_version = o.forge_policy_version or None
        threading.Thread(target=self._watch_policy, name="forge-policy", daemon=True).start()
        self.pod_episode = os.environ.get("FORGE_EPISODE_ID") or os.environ.get("POD_UID") or None
        if o.forge_admin_port or o.forge_reward_socket:
            # With a reward socket and no token file, loopback TCP takes no reward: no credential exists to find.
            token = None
            try:
                if o.forge_admin_port and (o.forge_reward_token_file or not o.forge_reward_socket):
                    token = self._reward_token(Path(o.forge_wal_dir))
            except (TokenFileError, OSError) as error:
                log.error("%s: the sidecar stops (POST /reward would take no reward)", error)
                ctx.master.shutdown()
                return
            if token is not None:
                self.secrets.append(token)  # scrubbed should a harness ever send it (it cannot read it in a pod)
            # In a pod, rewards for its own episode only (unless the operator lets clients choose episodes).
            own = (
                (o.forge_episode_id or self.pod_episode)
                if self.pod_episode and not o.forge_trust_episode_header
                else None
            )
            address = ("127.0.0.1", o.forge_admin_port) if o.forge_admin_port else None
            socket_path = Path(o.forge_reward_socket) if o.forge_reward_socket else None
            try:
                self.admin = AdminServer(address, self.writer, self.metrics, token, own, socket_path).start()
            except OSError as error:
                log.error("the admin endpoint cannot listen: %s: the sidecar stops", error)
                ctx.master.shutdown()
                return
        log.info("OpenForge sidecar %s: upstream %s, store %s", self.sidecar_id, o.forge_upstream, store.uri)

    def _reward_token(self, wal_dir: Path) -> str:
        """The token POST /reward needs: from --reward-token-file, or a new random one in the WAL folder (its path
        is logged, never its value)."""
        if ctx.options.forge_reward_token_file:
            return read_token_file(Path(ctx.options.forge_reward_token_file))
        path = wal_dir / DEFAULT_TOKEN_FILE
        token = create_token_file(path)
        log.warning("reward token (POST /reward needs Authorization: Bearer <token>) written to %s", path.resolve())
        return token

    async def done(self) -> None:
        """SIGTERM/SIGINT: wait (bounded) for calls in flight, record the ones cut, flush everything, then exit.

        mitmproxy awaits this hook with its event loop running, so calls in flight go on meanwhile. The bound
        (``--drain-seconds``, default 20 s) plus the flush (at most 5 s) fits a pod's default 30 s grace period.
        Records the store did not take stay in the WAL; the process then exits 3 and says so.
        """
        self.stop.set()
        deadline = time.monotonic() + float(ctx.options.forge_drain_seconds)
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self._commit_staged()  # records staged for a group commit go in before the WAL closes
        for flow, call in list(self.in_flight.values()):
            try:
                call.error = "cut at shutdown: the sidecar stopped before the answer was complete"
                self._record(flow, call, status="truncated", sampled=call.stream.sampled if call.stream else None)
            except Exception as error:
                self._internal_error("shutdown", error)
        if self.admin:
            self.admin.stop()
        if self.writer and not self.writer.close(timeout_s=5.0):
            log.error("%d records are still in the write-ahead log; the next start replays them",
                      self.writer.pending())  # fmt: skip
            atexit.register(os._exit, 3)  # after mitmproxy's own clean-up: a stop that leaves records is not clean
        for clock in self.versions.values():
            clock.stop()

    # -- the policy replicas --------------------------------------------------------------------------------
    def _ask_models(self, replica: Replica) -> None:
        """The policy's served name (unless given) and a replica's context, from its model list."""
        with urllib.request.urlopen(f"{replica.url}/v1/models", timeout=2) as answer:
            listed = json.load(answer)["data"]
        if not ctx.options.forge_policy_model:
            announced = announced_policy(listed, self.policy_model)
            if announced != self.policy_model:
                log.warning("the policy is served as %r (announced by %s)", announced, replica.url)
            self.policy_model = announced
        context = policy_context(listed, self.policy_model)
        if context is not None:
            replica.context = context
        if self.policy_model is not None:
            replica.serves_policy = self.policy_model in {str(model.get("id")) for model in listed}

    async def _learn_context(self, replica: Replica) -> None:
        try:
            await asyncio.to_thread(self._ask_models, replica)
        except Exception as error:  # the call goes on bounded by --max-completion-tokens only; the poller retries
            log.warning("the context of %s is not known yet (%s)", replica.url, type(error).__name__)

    def _watch_policy(self) -> None:
        """Every --health-seconds: resolve dns+ upstreams when due, and ask each replica its model list (served
        model name, context, and whether it is up). The version is asked per call."""
        interval = float(ctx.options.forge_health_seconds)
        with ThreadPoolExecutor(max_workers=8, thread_name_prefix="forge-poll") as pool:
            while not self.stop.is_set():
                try:
                    if changes := self.replicas.refresh():
                        for change in changes:
                            log.warning("policy replicas: %s", change)
                        self._forget_gone()
                    replicas = self.replicas.all()
                    for replica, failure in zip(replicas, pool.map(self._poll, replicas), strict=True):
                        self._mark(replica, failure is None, failure)
                    self._judge_step()
                    self._replica_metrics()
                except Exception as error:  # the poller never dies
                    self._internal_error("policy poll", error)
                self.stop.wait(interval)

    def _forget_gone(self) -> None:
        """Replicas DNS no longer lists: their version clients (and threads), tokens-in clients and gauges go too."""
        known = {replica.url for replica in self.replicas.all()}
        for url in [url for url in self.versions if url not in known]:
            self.versions.pop(url).stop()
        for url in [url for url in self.continuations if url not in known]:
            del self.continuations[url]
        for url in [url for url in self.context_asked if url not in known]:
            del self.context_asked[url]
        for url in self.replicas.gone:
            self.metrics.remove(f'replica_up{{replica="{url}"}}')
            self.metrics.remove(f'replica_out_of_step{{replica="{url}"}}')

    def _poll(self, replica: Replica) -> str | None:
        try:
            self._ask_models(replica)
        except Exception as error:
            return f"{type(error).__name__}: {getattr(error, 'reason', error)}"
        if len(self.replicas.all()) > 1:  # whether it is in step with the others (ReplicaSet.judge_step)
            try:
                with urllib.request.urlopen(f"{replica.url}/is_paused", timeout=VERSION_POLL_TIMEOUT_S) as answer:
                    replica.paused = bool(json.load(answer).get("is_paused"))
                with urllib.request.urlopen(f"{replica.url}/weight_info", timeout=VERSION_POLL_TIMEOUT_S) as answer:
                    replica.version = version_text(json.load(answer))
            except Exception:  # a busy engine answers late: its step is judged at a later poll
                replica.paused = True  # not judged now
        return None

    def _judge_step(self) -> None:
        """Replicas out of step (another version than the others', or not serving the policy) take no call."""
        for replica, why in self.replicas.judge_step():
            if why is None:
                log.warning("policy replica %s is in step again: it takes calls", replica.url)
            else:
                self.metrics.inc("replica_out_of_step_total")
                log.warning("policy replica %s is out of step (%s): its episodes move to the others", replica.url, why)

    def _mark(self, replica: Replica, up: bool, reason: str | None = None) -> None:
        was = replica.up
        if self.replicas.mark(replica, up, reason):
            if up and was is False:
                log.warning("policy replica %s is up again", replica.url)
            elif not up:
                self.metrics.inc("replica_down_total")
                log.warning("policy replica %s is down (%s); its episodes move to the others", replica.url, reason)
        self._replica_metrics()

    def _replica_metrics(self) -> None:
        replicas = self.replicas.all()
        for replica in replicas:
            self.metrics.set(f'replica_up{{replica="{replica.url}"}}', 1 if replica.up else 0)
            self.metrics.set(f'replica_out_of_step{{replica="{replica.url}"}}', 1 if replica.out_of_step else 0)
        self.metrics.set("upstream_up", 1 if any(r.up for r in replicas) else 0)

    def _clock(self, replica: Replica) -> VersionClock:
        if replica.url not in self.versions:
            writer = self.writer
            assert writer is not None
            self.versions[replica.url] = VersionClock(
                urlparse(replica.url), lambda rows, v: writer.complete_many(rows, {"policy_version_end": v})
            )
        return self.versions[replica.url]

    def _continuations(self, replica: Replica) -> Continuations:
        if replica.url not in self.continuations:
            self.continuations[replica.url] = Continuations(self.tokens_in_mode, replica.url)
        return self.continuations[replica.url]

    async def _choose(self, episode: str) -> tuple[Route, Asked]:
        """The replica for an episode's call, and the policy version it serves now. A replica whose version
        question finds it refusing connections is marked down at once and the next one tried."""
        tried: list[str] = []
        while True:
            route = self.replicas.route(episode, exclude=tried)
            replica = route.replica
            asked = self.context_asked.get(replica.url, -CONTEXT_RETRY_S)
            if replica.context is None and time.monotonic() - asked >= CONTEXT_RETRY_S:
                # A call before the first poll: its bound needs the context. A server that does not say it
                # (no max_model_len, not vLLM) is asked again only now and then, never by every call.
                self.context_asked[replica.url] = time.monotonic()
                await self._learn_context(replica)
            if self.policy_version:
                return route, Asked(self.policy_version)
            clock = self._clock(replica)
            version = await clock.before()
            if not clock.refused or replica.url in tried or len(self.replicas.all()) < 2:
                return route, version
            self._mark(replica, False, "connection refused")
            tried.append(replica.url)

    # -- hooks ----------------------------------------------------------------------------------------------
    def tls_clienthello(self, data: Any) -> None:
        """Transparent mode: a TLS connection whose SNI is not a model host is passed through, never decrypted."""
        if not ctx.options.forge_tls_passthrough or type(data.context.client.proxy_mode).__name__ == "ReverseMode":
            return
        address = data.context.server.address
        decision = transparent.tls_decision(data.client_hello.sni, address[1] if address else None, self.model_hosts)
        if decision == transparent.PASSTHROUGH:
            data.ignore_connection = True
            return
        # Answer ALPN like the real model host, which picks h2 when offered (mitmproxy's TlsConfig reads this).
        client = data.context.client
        if client.alpn is None:
            client.alpn = transparent.preferred_alpn(data.client_hello.alpn_protocols, ctx.options.http2)

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        try:
            api = self._model_api(flow)
        except Exception:
            api = None
        if api is None:
            flow.request.stream = True  # not a model call: straight through, never buffered or recorded
            return
        if api == "responses_socket":
            # Codex tries a WebSocket on GET /v1/responses first; a plain refusal makes it POST at once.
            self.metrics.inc("websocket_refused_total")
            flow.response = http.Response.make(
                426, json.dumps({"error": {"message": "WebSocket transport is not served here: use POST",
                                           "type": "invalid_request_error", "code": "websocket_not_supported"}}),
                {"content-type": "application/json"},
            )  # fmt: skip
            return
        flow.metadata["forge_api"] = api

    async def request(self, flow: http.HTTPFlow) -> None:
        try:
            await self._request(flow)
        finally:
            await self.guard.request(flow)

    async def _request(self, flow: http.HTTPFlow) -> None:
        api = flow.metadata.get("forge_api")
        if api is None or flow.response is not None:
            return
        try:
            if api in apis.RECORDED:
                headers = identity.header_map(flow.request.headers)  # read once: lookups cost per call
                who = self._identity(flow, headers)
                route, asked = await self._choose(who[0])
                self._begin(flow, api, who, route, headers)
                if flow.response is not None:  # answered by the sidecar (a stored response this episode lacks)
                    return
                call: Call = flow.metadata["forge_call"]
                call.policy_version, call.version_why = asked
                assert call.replica is not None
                await self._continuations(call.replica).prepare(flow, call, self.prefixes.sequences(call.episode_id))
            elif api == "responses_stored":  # a stored response read or deleted: this episode's only, never routed
                who = self._identity(flow, identity.header_map(flow.request.headers))
                status, body = response_store.answer(
                    self.stored_responses, who[0], flow.request.method, flow.request.path
                )
                flow.response = http.Response.make(status, body, {"content-type": "application/json"})
            else:  # served by the policy, not a sampled call: routed, never recorded
                self._strip_hop_secrets(flow)
                self._route(flow, self.replicas.route(None).replica)
                if api == "count_tokens":
                    self._map_model(flow)
        except LookupError as error:  # no replica known (a dns+ name that listed none yet)
            self.metrics.inc("no_replica_total")
            flow.metadata["forge_answered"] = True
            flow.response = http.Response.make(
                502, error_body(api, 502, f"The policy server is unavailable ({error}).", "policy_unavailable"),
                error_headers(api),
            )  # fmt: skip
        except Exception as error:  # fail open: the call goes on unrecorded, but to the policy, never the real host
            self._internal_error("request", error)
            if "forge_call" not in flow.metadata:
                self._route(flow, self.replicas.route(None).replica)

    async def server_connect(self, data: Any) -> None:
        """A new connection to a replica that now refuses it (it died since the last poll) is sent to the next live
        replica instead, before any byte of the call went anywhere: no call is lost to a stopped replica."""
        address = data.server.address
        flows = self.connecting.get((data.client.id, address)) if address else None
        if not flows or len(self.replicas.all()) < 2:
            return
        try:
            await self._connect_or_move(data, flows)
        except Exception as error:  # fail open: the connection is tried as it was
            self._internal_error("server_connect", error)

    async def _connect_or_move(self, data: Any, flows: list[http.HTTPFlow]) -> None:
        replica = self.replicas.by_address(*data.server.address)
        call: Call | None = next((f.metadata["forge_call"] for f in flows if "forge_call" in f.metadata), None)
        tried: list[str] = []
        while replica is not None and replica.url not in tried:
            try:
                _, writer = await asyncio.wait_for(asyncio.open_connection(replica.host, replica.port), PROBE_TIMEOUT_S)
                writer.close()
                break
            except (OSError, TimeoutError) as error:
                failed = "timed out" if isinstance(error, TimeoutError) else "refused"
                self._mark(replica, False, f"connection {failed}")
                tried.append(replica.url)
                replica = self.replicas.route(call.episode_id if call else None, exclude=tried).replica
        if not tried or replica is None or replica.url in tried:
            return  # reachable as routed, or no replica is: mitmproxy's own attempt fails and PolicyGuard answers
        data.server.address = (replica.host, replica.port)
        if replica.scheme == "https":
            data.server.sni = replica.host
        for flow in list(flows):
            self._connected(flow)
            self._route(flow, replica)
            moved: Call | None = flow.metadata.get("forge_call")
            if moved is None:
                continue
            route = self.replicas.route(moved.episode_id, exclude=tried)
            moved.replica, moved.moved_from, moved.moved_why = replica, route.moved_from, route.why
            self._bound_again(flow, moved, replica)
            if not self.policy_version:
                moved.policy_version, moved.version_why = await self._clock(replica).before()

    def _bound_again(self, flow: http.HTTPFlow, call: Call, replica: Replica) -> None:
        """A call moved to another replica is bounded by that one's context (it was by the one it left)."""
        if call.bound is None or call.bound.context == replica.context:
            return
        try:
            body = codec.loads(flow.request.content or b"")
            served_api = apis.api_for("POST", flow.request.path)  # chat for Messages, completions for tokens-in
            if not isinstance(body, dict) or served_api not in apis.MAX_TOKEN_FIELDS:
                return
            bound = apis.bound_completion(served_api, body, ctx.options.forge_max_completion_tokens, replica.context)
            content = codec.dumps(body)
        except Exception as error:  # the call goes as it is: the new replica judges its bound
            self._internal_error("bound again", error)
            return
        call.bound = apis.CompletionBound(call.bound.requested, bound.sent, replica.context)
        flow.request.content = content

    def _connected(self, flow: http.HTTPFlow) -> None:
        """The flow no longer waits for a connection to its replica."""
        key = (flow.client_conn.id, (flow.request.host, flow.request.port))
        waiting = self.connecting.get(key)
        if waiting is not None:
            if flow in waiting:
                waiting.remove(flow)
            if not waiting:
                del self.connecting[key]

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        call: Call | None = flow.metadata.get("forge_call")
        assert flow.response is not None
        if "forge_api" in flow.metadata:
            self._connected(flow)
        if call is not None and call.replica is not None:
            self.replicas.served(call.episode_id, call.replica)  # its next call sticks there
        if call is None:
            if "forge_api" not in flow.metadata:
                flow.response.stream = True
            return
        is_sse = "text/event-stream" in flow.response.headers.get("content-type", "")
        if call.added and call.added.stream and is_sse and not flow.response.headers.get("content-encoding"):
            call.stream = call.added.stream_state()
            call.framer = EventFramer()
            flow.response.stream = lambda data: self._on_stream_data(flow, call, data)

    async def response(self, flow: http.HTTPFlow) -> None:
        try:
            await self._response(flow)
        finally:
            self.guard.response(flow)

    async def _response(self, flow: http.HTTPFlow) -> None:
        call: Call | None = flow.metadata.get("forge_call")
        if "forge_api" in flow.metadata:
            self._connected(flow)
        if flow.metadata.get("forge_api") == "models" and flow.request.headers.get("anthropic-version"):
            self._anthropic_model_list(flow)
        if call is None or call.recorded:
            return
        try:
            failed = flow.response is not None and caused_by_tokens_in(flow.response.status_code)
            tokens_in = call.continuation is not None and call.continuation.state == "tokens_in"
            if (
                failed
                and tokens_in
                and call.replica
                and await self._continuations(call.replica).fall_back(self, flow, call)
            ):
                return  # served (and recorded) by the normal path instead
            call.group = []
            self._finish(flow, call)
            group, call.group = call.group, None
            if group:
                await self._commit(call, *group[0])
        except Exception as error:
            self._internal_error("response", error)

    async def _commit(self, call: Call, row: dict[str, Any], probe: bool, status: str) -> None:
        """Group commit: the records of whole answers whose hooks run in one turn of the event loop share one WAL
        transaction; each hook waits for it, so the harness gets no byte of an answer before its record is committed.
        A call alone (nothing else in flight) is committed at once, without waiting for the next turn."""
        assert self.writer is not None
        if not self.staged and not self.in_flight:  # nothing could end with it
            self._logged(call, status, probe, self.writer.append("calls", row, hold=probe))
            return
        loop = asyncio.get_running_loop()
        done: asyncio.Future[int | None] = loop.create_future()
        if not self.staged:
            loop.call_soon(self._commit_staged)
        self.staged.append((call, row, probe, status, done))
        row_id = await done
        self._logged(call, status, probe, row_id)

    def _commit_staged(self) -> None:
        """Commit every staged record in one transaction and wake their hooks (an error: each hook's own)."""
        staged, self.staged = self.staged, []
        if not staged:
            return
        try:
            assert self.writer is not None
            results = self.writer.append_many([("calls", row, probe) for _, row, probe, _, _ in staged])
        except Exception as error:
            results = [error] * len(staged)
        for (*_, done), result in zip(staged, results, strict=True):
            if not done.done():
                done.set_exception(result) if isinstance(result, Exception) else done.set_result(result)

    def error(self, flow: http.HTTPFlow) -> None:
        try:
            self._error(flow)
        finally:
            self.guard.error(flow)

    def _error(self, flow: http.HTTPFlow) -> None:
        call: Call | None = flow.metadata.get("forge_call")
        if "forge_api" in flow.metadata:
            self._connected(flow)
        if call is None or call.recorded:
            return
        try:
            reason = flow.error.msg if flow.error else "connection error"
            call.error = scrub_text(reason, call.secrets)
            status = "truncated" if call.stream is not None else "error"
            self._record(flow, call, status=status, sampled=call.stream.sampled if call.stream else None)
        except Exception as error:
            self._internal_error("error", error)

    # -- the work -------------------------------------------------------------------------------------------
    def _model_api(self, flow: http.HTTPFlow) -> str | None:
        mode = flow.client_conn.proxy_mode
        reverse = type(mode).__name__ == "ReverseMode"
        host = (flow.request.pretty_host or "").lower()
        if not reverse and host not in self.model_hosts and f"{host}:{flow.request.port}" not in self.model_hosts:
            return None
        return apis.api_for(flow.request.method, flow.request.path)

    def _identity(self, flow: http.HTTPFlow, headers: dict[str, str]) -> tuple[str, str | None, str]:
        o = ctx.options
        rules = identity.Rules(
            o.forge_episode_id, o.forge_task_id, o.forge_run_id, o.forge_trust_episode_header, self.pod_episode,
            f"{self.sidecar_id}-default",
        )  # fmt: skip
        return identity.identify(rules, headers, (flow.metadata.get("proxyauth") or (None,))[0], self.metrics)

    def _begin(
        self, flow: http.HTTPFlow, api: str, identity: tuple[str, str | None, str], route: Route,
        headers: dict[str, str],
    ) -> None:  # fmt: skip
        """Begin a model call: its record-to-be, then its upstream request, prepared whole before any of it is
        applied, so that a failure half way never sends a half-prepared call."""
        episode, task, run = identity
        assert self.writer is not None
        seq = self.writer.next_seq(episode)
        call = Call(
            call_id=f"{self.call_prefix}{next(self.call_numbers):08x}", api=api, episode_id=episode,
            task_id=task, run_id=run, seq=seq,
            started_at=int(flow.request.timestamp_start * 1e6),
            secrets=secrets_in_headers(flow.request.headers) + self.secrets,
            host=flow.request.host_header or flow.request.pretty_host, path=flow.request.path.split("?", 1)[0],
        )  # fmt: skip
        call.user_agent = headers.get("user-agent")
        call.replica, call.moved_from, call.moved_why = route.replica, route.moved_from, route.why
        flow.metadata["forge_call"] = call
        self.in_flight[call.call_id] = (flow, call)
        try:
            prepared = self._prepare(flow, call, headers, route.replica)
        except NotFound as refusal:  # a stored response or item this episode does not have: the API's own 404
            self.metrics.inc("responses_reference_refused_total")
            call.error = f"refused by the sidecar: {refusal.message}"
            flow.metadata["forge_answered"] = True
            flow.response = http.Response.make(404, refusal.body(), {"content-type": "application/json"})
            self._record(flow, call, status="error")
            return
        except Exception as error:  # our code failed on an odd request: it goes to the policy as it came (the
            # server judges it, the harness gets its answer), recorded as an error; never half-prepared
            self.metrics.inc("requests_unprepared_total")
            log.error("a model call could not be prepared (%s); sent on as it came", type(error).__name__)
            call.error = f"request not prepared ({type(error).__name__}: {scrub_text(str(error), call.secrets)})"
            prepared = None
        # Applied at once, after everything that can fail: the upstream gets the whole prepared call or the original.
        self._strip_hop_secrets(flow)
        self._route(flow, route.replica)
        if prepared is not None:
            flow.request.headers.pop("content-encoding", None)  # vLLM reads no gzip/br/zstd bodies: sent decoded
            flow.request.path, flow.request.content = prepared

    def _prepare(
        self, flow: http.HTTPFlow, call: Call, headers: dict[str, str], replica: Replica
    ) -> tuple[str, bytes] | None:  # fmt: skip
        """A model call's upstream path and body (the policy's model name, the completion bound, the ids asked),
        with what its record says of the request set on ``call``; None: it goes on as it came (not a JSON object,
        or not translatable: vLLM judges it). Reads the flow, changes none of it."""
        api = call.api
        try:
            content = flow.request.get_content(strict=True) or b""
            body = codec.loads(content)
            if not isinstance(body, dict):
                raise ValueError("the body is not a JSON object")
        except ValueError as error:  # malformed JSON, non-JSON content type, undecodable encoding
            call.error = f"request is not a JSON object ({type(error).__name__}); passed through unchanged"
            call.request_json = json.dumps(
                {"note": "unparsable request", "bytes": len(flow.request.raw_content or b"")}
            )
            call.harness = harness.detect(api, headers, None)
            return None
        call.secrets += secrets_in_body(body)
        call.harness = harness.detect(api, headers, body)
        size = len(content)
        # The record keeps the request as the harness sent it (redacted), not as the upstream got it.
        call.request_json = (
            redacted_text(content.decode("utf-8", "replace"), call.secrets)
            if size <= MAX_RECORDED_BODY
            else json.dumps({"note": "request body too large to copy", "bytes": size})
        )
        if apis.drop_internal_fields(body):
            self.metrics.inc("internal_fields_dropped_total")
        model = body.get("model")  # a harness may send any JSON here: a name that is not a string is kept as JSON
        call.model_requested = model if isinstance(model, str) or model is None else json.dumps(model)
        served = self._served_model(call.model_requested)
        if served:
            body["model"] = served
        call.policy_model = self.policy_model
        bound = apis.bound_completion(api, body, ctx.options.forge_max_completion_tokens, replica.context)
        module = apis.module_for(api)
        # previous_response_id and item_reference resolved from this episode's answers; the call it extends by id
        if api == "responses" and (continued := self.stored_responses.resolve(call.episode_id, body)):
            flow.metadata["forge_continues"] = continued  # (tokens-in: sidecar/continuation.py)
        try:
            added = module.prepare_request(api, body)
        except ValueError as error:  # a request we cannot translate goes on as it came; vLLM judges it
            call.error = f"request not translated ({error}); passed through unchanged"
            return None
        if isinstance(added, apis.responses.Additions) and body.get("store") is not False:
            sent, kept = input_items(body.get("input")), self.stored_responses
            added.keep = lambda answer: kept.keep(call.episode_id, call.call_id, sent, answer)
        prepared = (added.upstream_path or flow.request.path, codec.dumps(body))
        sampling = json.dumps({k: body[k] for k in SAMPLING_KEYS if k in body}, sort_keys=True)
        call.bound, call.module, call.added, call.sampling = bound, module, added, sampling  # last: nothing fails after
        return prepared

    def _map_model(self, flow: http.HTTPFlow) -> None:
        try:
            body = json.loads(flow.request.get_content(strict=True) or b"")
        except ValueError:
            return  # the upstream judges it
        if isinstance(body, dict) and (served := self._served_model(body.get("model"))):
            body["model"] = served
            flow.request.content = json.dumps(body, ensure_ascii=False).encode()

    def _strip_hop_secrets(self, flow: http.HTTPFlow) -> None:
        present = {name.lower() for name, _ in flow.request.headers.fields}
        for name in _STRIPPED:
            if name in present:
                flow.request.headers.pop(name.decode(), None)
        if key := os.environ.get("FORGE_UPSTREAM_API_KEY"):
            flow.request.headers["authorization"] = f"Bearer {key}"

    def _anthropic_model_list(self, flow: http.HTTPFlow) -> None:
        """vLLM lists models in OpenAI's shape; an Anthropic client gets Anthropic's."""
        assert flow.response is not None
        try:
            listed = json.loads(flow.response.get_content(strict=False) or b"")["data"]
        except (ValueError, KeyError, TypeError):
            return
        data = [
            {"type": "model", "id": m.get("id"), "display_name": m.get("id"),
             "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(m.get("created") or 0))}
            for m in listed
        ]  # fmt: skip
        flow.response.content = json.dumps(
            {"data": data, "has_more": False, "first_id": data[0]["id"] if data else None,
             "last_id": data[-1]["id"] if data else None}
        ).encode()  # fmt: skip

    def _route(self, flow: http.HTTPFlow, replica: Replica) -> None:
        flow.request.scheme = replica.scheme
        flow.request.host = replica.host
        flow.request.port = replica.port
        flow.request.headers["host"] = replica.netloc
        self.connecting.setdefault((flow.client_conn.id, (replica.host, replica.port)), []).append(flow)

    def _served_model(self, requested: str | None) -> str | None:
        for pattern, target in self.model_map:
            if fnmatch.fnmatchcase(requested or "", pattern):
                return target or self.policy_model
        return None

    def _on_stream_data(self, flow: http.HTTPFlow, call: Call, data: bytes) -> list[bytes]:
        """One piece of the upstream's SSE body in; what the harness gets now out (never held past an event)."""
        assert call.framer is not None and call.stream is not None and call.added is not None
        if call.stream_failed:  # our code broke on this stream earlier: pass the rest on untouched
            return [] if call.added.upstream_path else [data]
        pending = call.framer.buffer + data  # what the harness has not got yet, should we fail on this piece
        try:
            if data == b"":  # end of the body
                rest = call.framer.rest()
                if not call.recorded:
                    self._record(
                        flow, call, status="ok" if call.stream.done else "truncated", sampled=call.stream.sampled
                    )
                return [rest] if rest else []
            out = []
            for event in call.framer.feed(data):
                if call.first_token_at is None:
                    call.first_token_at = now_us()
                rewritten = call.stream.feed_event(event)
                if call.stream.done and not call.recorded:
                    # Logged before the final event reaches the harness: delivered means recorded.
                    self._record(flow, call, status="ok", sampled=call.stream.sampled)
                out += rewritten
            return out
        except Exception as error:  # never break the stream because recording failed
            self._internal_error("stream", error)
            call.stream_failed = True
            if not call.recorded:
                call.error = f"recording failed mid-stream ({type(error).__name__}); the rest passed on unread"
                try:
                    self._record(flow, call, status="error")
                except Exception as again:
                    self._internal_error("stream record", again)
            if call.added.upstream_path:  # a translated stream cannot go on raw: end it with the API's error
                return [call.added.error_event("the proxy failed while translating this stream")]
            return [pending]

    def _finish(self, flow: http.HTTPFlow, call: Call) -> None:
        response = flow.response
        assert response is not None
        if call.stream is not None:  # streamed: recorded at [DONE] or at the end of the body
            return
        if response.status_code >= 400:
            text = response.get_text(strict=False) or ""
            upstream = scrub_text(text[:2000], call.secrets)
            call.error = f"{call.error}; upstream said: {upstream}" if call.error else upstream
            self._record(flow, call, status="upstream_error")
            if call.api == "messages" and call.added is not None:  # the harness asked in Anthropic's format
                response.content = apis.messages.error_body(response.status_code, text)
            return
        if call.added is None:
            self._record(flow, call, status="error")
            return
        try:
            answer = codec.loads(response.get_content(strict=True) or b"")
        except ValueError:
            call.error = "the upstream's answer is not JSON"
            self._record(flow, call, status="error")
            return
        sampled, answer = call.added.finish(answer)
        call.first_token_at = int((response.timestamp_start or time.time()) * 1e6)
        data = codec.dumps(answer)
        self._record(flow, call, status="ok", sampled=sampled, response_json=redacted_text(data.decode(), call.secrets))
        response.content = data

    def _record(
        self, flow: http.HTTPFlow, call: Call, status: str, sampled: Sampled | None = None,
        response_json: str | None = None,
    ) -> None:  # fmt: skip
        call.recorded = True
        self.in_flight.pop(call.call_id, None)
        assert self.writer is not None
        if sampled is not None and sampled.upstream_error and status in ("ok", "truncated"):
            status, call.error = "upstream_error", scrub_text(sampled.upstream_error, call.secrets)
        if sampled is not None and status == "ok" and (sampled.prompt_ids is None or not sampled.completion_ids):
            status, call.error = "error", "the upstream returned no token ids"
        if status == "ok" and (gather_error := getattr(call.stream, "gather_error", None)):
            status, call.error = "error", f"ids not gathered: {gather_error}"
        if sampled is not None and (problem := sampled.problem()):  # -inf/misaligned logprobs: never silent
            status, call.error = (
                ("error", problem) if status == "ok" else (status, "; ".join(filter(None, [call.error, problem])))
            )
        if sampled is not None and sampled.n_choices > 1:
            call.error = f"n={sampled.n_choices}: only choice 0 is recorded"
        prompt = pack_ids(sampled.prompt_ids) if sampled and sampled.prompt_ids is not None else None
        completion = pack_ids(sampled.completion_ids) if sampled else None
        parent, prefix_len = (None, 0)
        if prompt is not None:
            parent, prefix_len = self.prefixes.split(call.episode_id, prompt)
            if status == "ok" and completion is not None:
                self.prefixes.remember(call.episode_id, call.call_id, prompt + completion)
        if response_json is None and call.stream is not None:
            response_json = redacted_json(call.stream.summary(), call.secrets)
        version, version_end = call.policy_version, self.policy_version or None
        served_by = sampled.model if sampled else None
        if served_by is not None and served_by != call.policy_model:  # the server-wide version is not its version
            version = version_end = None
            self.metrics.inc("calls_not_served_by_policy_total")
            call.version_why = f"served by {served_by!r}, not the policy {call.policy_model!r}"
        unknown = f"version unknown: {call.version_why}" if version is None and call.version_why else None
        if unknown and status == "ok":
            self.metrics.inc("calls_version_unknown_total")
        user_agent = call.user_agent
        request = (
            self.requests.split(call.episode_id, call.request_json)
            if call.request_json is not None
            else RequestDelta(None, 0, 0, "")
        )
        row: CallRecord = {
            "call_id": call.call_id, "episode_id": call.episode_id, "task_id": call.task_id, "run_id": call.run_id,
            "seq": call.seq, "api": call.api, "stream": bool(call.added and call.added.stream),
            "host": call.host, "path": call.path,  # as the harness called them, before routing
            "model_requested": call.model_requested, "model_served": sampled.model if sampled else None,
            "response_id": sampled.response_id if sampled else None,
            "policy_version": version, "policy_version_end": version_end,
            "started_at": call.started_at,
            "first_token_at": call.first_token_at, "finished_at": now_us(), "status": status,
            "http_status": flow.response.status_code if flow.response else None,
            "finish_reason": sampled.finish_reason if sampled else None, "error": call.error,
            "max_tokens_requested": call.bound.requested if call.bound else None,
            "sampling": call.sampling,
            "max_tokens_served": call.bound.served(len(prompt) // 4 if prompt is not None else None)
            if call.bound
            else None,
            "note": note_of(call.continuation, moved_note(call, "; ".join(
                filter(None, [sampled.note if sampled else None, unknown])) or None)),
            "continuation": call.continuation.state if call.continuation else None,
            "parent_call_id": parent, "prefix_len": prefix_len,
            "prompt_suffix_ids": prompt[prefix_len * 4 :] if prompt is not None else None,
            "prompt_len": len(prompt) // 4 if prompt is not None else None,
            "completion_token_ids": completion,
            "completion_logprobs": pack_floats(sampled.logprobs) if sampled else None,
            "n_unknown_logprobs": sum(1 for v in sampled.logprobs if v != v) if sampled else None,  # NaN != NaN
            "request_json": request.middle if call.request_json is not None else None,
            "request_parent_call_id": request.parent_call_id, "request_prefix_chars": request.prefix_chars,
            "request_suffix_chars": request.suffix_chars, "response_json": response_json,
            "usage": json.dumps(sampled.usage) if sampled and sampled.usage else None,
            "harness": call.harness,
            "replica": call.replica.url if call.replica else None, "replica_moved_from": call.moved_from,
            "user_agent": scrub_text(user_agent, call.secrets) if user_agent else None,
            "sidecar_id": self.sidecar_id, "sidecar_version": SIDECAR_VERSION,
        }  # fmt: skip
        # The version as the call ends is asked off the event loop (vLLM answers between engine steps): the row
        # is logged now and held in the WAL until the answer completes it (at most writer.HOLD_S).
        probe = version is not None and not self.policy_version and call.replica is not None
        checked = checked_row("calls", row)
        if call.group is not None:  # a whole answer: committed with the calls that end with it (``_commit``)
            call.group.append((checked, probe, status))
            return
        self._logged(call, status, probe, self.writer.append("calls", checked, hold=probe))

    def _logged(self, call: Call, status: str, probe: bool, row_id: int | None) -> None:
        """What follows a call's record in the WAL (committed, or dropped at the disk bound: None)."""
        if row_id is not None:
            if call.moved_from is not None:
                self.metrics.inc("replica_moves_total")
            if call.request_json is not None:
                self.requests.remember(call.episode_id, call.call_id, call.request_json)
            self.metrics.inc(f'calls_total{{status="{status}"}}')
            if probe and call.replica is not None:
                self._clock(call.replica).after(row_id)

    def _internal_error(self, where: str, error: Exception) -> None:
        self.metrics.inc("internal_errors_total")
        log.error("recording failed in %s (%s: %s); the call went on unrecorded", where, type(error).__name__,
                  scrub_text(str(error), self.secrets))  # fmt: skip


forge = Forge()
addons = [forge]
