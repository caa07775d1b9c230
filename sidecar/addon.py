"""OpenForge's mitmproxy addon: serve a harness's model calls from the policy and record them token by token.

Run by `forge sidecar` as ``mitmdump -s sidecar/addon.py``. The hooks below are the table of contents:

- ``requestheaders``: is this a model call (host, method and path)? If not, stream it through untouched,
  unrecorded. Codex's WebSocket upgrade is refused here at once (it then falls back to POST).
- ``request``: choose the policy replica (``routing``), prepare the upstream request (``prepare``: the policy's
  model name, the completion bound, token ids and logprobs asked; Anthropic Messages translated to Chat
  Completions, see ``apis/messages.py``), then tokens-in (``continuation``).
- ``server_connect``: a replica that refuses a new connection: its calls move to the next one (``routing``).
- ``responseheaders``: stream SSE answers live, one event at a time, gathering ids and hiding them (``relay``).
- ``response``: hide the added fields from a whole answer; log the call record before the harness gets it.
- ``error``: a client that hung up or an upstream that reset: record what was seen, marked truncated.
- ``tls_clienthello`` (transparent mode): open TLS only for model hosts (by SNI), pass the rest through untouched;
  pick h2 for an opened one when the client offers it, as the real model host would.

Each concern lives in a module named for it: ``call`` (the call in flight), ``identity`` (whose call it is),
``routing`` (which replica, its health, the policy's name), ``version`` (the policy version around each call),
``prepare`` (the upstream request), ``continuation`` (tokens-in), ``relay`` (answers back, records in:
``record.call_row`` builds the row), ``guard`` (``PolicyGuard``, whose hooks ``Forge``'s run after their own:
mitmproxy dispatches to one addon; a policy server that cannot be reached, or answers an error that is not JSON,
gets the harness an error in its API's own format), ``apis`` (the wire formats), ``writer`` (the WAL and the
store).

Recording is fail-open: any exception in our code is logged and counted, and the harness's call goes on.
"""

import asyncio
import atexit
import itertools
import json
import logging
import os
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from mitmproxy import ctx, exceptions, http

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # mitmdump loads this file as a script

from sidecar import apis, identity, transparent
from sidecar.admin import DEFAULT_TOKEN_FILE, AdminServer, TokenFileError, create_token_file, read_token_file
from sidecar.apis.errors import error_body, error_headers
from sidecar.call import Call
from sidecar.continuation import caused_by_tokens_in
from sidecar.dispatch import plan_dispatch
from sidecar.guard import PolicyGuard
from sidecar.keepalive import IdleUpstreams
from sidecar.metrics import Metrics
from sidecar.prepare import prepare, strip_hop_secrets
from sidecar.redact import configured_secrets, scrub_text, secrets_in_headers
from sidecar.relay import Relay
from sidecar.replicas import ReplicaSet, Route, UpstreamError, parse_upstreams
from sidecar.response_store import NotFound, ResponseStore
from sidecar.routing import Router
from sidecar.settings import OPTIONS, Settings
from sidecar.store import open_store
from sidecar.writer import RecordWriter

log = logging.getLogger("openforge.sidecar")


class Forge:
    def __init__(self) -> None:
        self.metrics = Metrics()
        self.relay = Relay(self.metrics, lambda replica, row_id: self.router.clock(replica).after(row_id))
        self.router = Router(self.metrics, self.relay.internal_error)
        self.stored_responses = ResponseStore()  # Responses answers served with store on, per episode
        self.admin: AdminServer | None = None
        self.model_hosts: set[str] = set()
        self.pod_episode: str | None = None  # the pod's identity (downward API), when the sidecar runs in one
        # Call ids: a random prefix per process + a counter (uuid4 per call costs a urandom syscall).
        self.call_prefix = uuid.uuid4().hex[:16]
        self.call_numbers = itertools.count()
        # The policy guard's hooks run from these (one addon for mitmproxy to dispatch to, not two).
        self.guard = PolicyGuard(self.metrics)
        self.idle = IdleUpstreams(self.metrics)  # kept-alive policy connections, not reused once too idle
        self.settings = Settings()  # parsed from mitmproxy's options in `configure`

    # -- options and lifecycle ------------------------------------------------------------------------------

    def load(self, loader: Any) -> None:
        plan_dispatch(loader.master.addons)  # each hook to the addons that have it, found once (sidecar/dispatch.py)
        for option in OPTIONS:  # declared once (sidecar/settings.py), shared with `forge sidecar`'s options
            loader.add_option(f"forge_{option.name}", option.mitmproxy_type, option.mitmproxy_default, option.help,
                              choices=option.choices)  # fmt: skip

    def configure(self, updated: set[str]) -> None:
        """Options parsed once into ``self.settings``; a bad value is mitmproxy's OptionsError (the start stops)."""
        if not any(name.startswith("forge_") for name in updated):
            return
        try:
            self.settings = Settings.parse(ctx.options)
        except ValueError as error:
            raise exceptions.OptionsError(str(error)) from error

    def running(self) -> None:
        o = self.settings
        try:
            upstreams = parse_upstreams(o.upstream)
            self.router.replicas = ReplicaSet(upstreams, refresh_s=o.upstream_refresh_seconds)
        except (UpstreamError, ValueError) as error:
            log.error("%s: the sidecar stops", error)
            ctx.master.shutdown()
            return
        self.model_hosts = o.model_hosts_set
        self.model_hosts |= {u.url.split("://", 1)[1].lower() for u in upstreams}
        self.router.model_map = o.model_map_rules
        self.relay.secrets = configured_secrets()
        store = open_store(o.store, o.s3_endpoint or None)
        self.relay.writer = RecordWriter(
            Path(o.wal_dir), store, self.metrics, max_rows=o.flush_rows, max_bytes=o.flush_bytes,
            max_age_s=o.flush_seconds, max_disk_bytes=o.max_wal_bytes, fsync=o.fsync,
        ).start()  # fmt: skip
        self.relay.sidecar_id = self.relay.writer.sidecar_id
        try:  # the Responses answers served with store on, read back (a restart keeps them) and written through
            if kept := self.stored_responses.persist(Path(o.wal_dir)):
                log.info("%d stored responses read back from %s", kept, o.wal_dir)
        except Exception as error:  # served from memory only: a restart forgets them
            log.error("stored responses are kept in memory only (%s: %s)", type(error).__name__, error)
        router = self.router
        router.writer = self.relay.writer
        router.policy_model = o.policy_model or None
        router.policy_model_fixed = bool(o.policy_model)
        router.tokens_in_mode = o.tokens_in
        router.policy_version = self.relay.policy_version = o.policy_version or None
        router.health_s = o.health_seconds
        self.idle.idle_s = o.upstream_idle_seconds
        router.max_completion_tokens = o.max_completion_tokens
        threading.Thread(target=router.watch, name="forge-policy", daemon=True).start()
        self.pod_episode = os.environ.get("FORGE_EPISODE_ID") or os.environ.get("POD_UID") or None
        if o.admin_port or o.reward_socket:
            # With a reward socket and no token file, loopback TCP takes no reward: no credential exists to find.
            token = None
            try:
                if o.admin_port and (o.reward_token_file or not o.reward_socket):
                    token = self._reward_token(Path(o.wal_dir))
            except (TokenFileError, OSError) as error:
                log.error("%s: the sidecar stops (POST /reward would take no reward)", error)
                ctx.master.shutdown()
                return
            if token is not None:
                self.relay.secrets.append(token)  # scrubbed should a harness ever send it (it cannot read it in a pod)
            # In a pod, rewards for its own episode only (unless the operator lets clients choose episodes).
            own = (o.episode_id or self.pod_episode) if self.pod_episode and not o.trust_episode_header else None
            address = ("127.0.0.1", o.admin_port) if o.admin_port else None
            socket_path = Path(o.reward_socket) if o.reward_socket else None
            try:
                self.admin = AdminServer(address, self.relay.writer, self.metrics, token, own, socket_path).start()
            except OSError as error:
                log.error("the admin endpoint cannot listen: %s: the sidecar stops", error)
                ctx.master.shutdown()
                return
        log.info("OpenForge sidecar %s: upstream %s, store %s", self.relay.sidecar_id, o.upstream, store.uri)

    def _reward_token(self, wal_dir: Path) -> str:
        """The token POST /reward needs: from --reward-token-file, or a new random one in the WAL folder (its path
        is logged, never its value)."""
        if self.settings.reward_token_file:
            return read_token_file(Path(self.settings.reward_token_file))
        path = wal_dir / DEFAULT_TOKEN_FILE
        token = create_token_file(path)
        log.warning("reward token (POST /reward needs Authorization: Bearer <token>) written to %s", path.resolve())
        return token

    async def done(self) -> None:
        """SIGTERM/SIGINT: wait (bounded) for calls in flight, record the ones cut, flush everything, then exit.

        mitmproxy awaits this hook with its event loop running, so calls in flight go on meanwhile. The bound
        (``--drain-seconds``, default 20 s) plus the last version question and the flush (at most 5 s together,
        6 s if the question must be given up) fits a pod's default 30 s grace period.
        Records the store did not take stay in the WAL; the process then exits 3 and says so.
        """
        self.router.stop.set()
        deadline = time.monotonic() + self.settings.drain_seconds
        while self.relay.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.relay.commit_staged()  # records staged for a group commit go in before the WAL closes
        for flow, call in list(self.relay.in_flight.values()):
            try:
                call.error = "cut at shutdown: the sidecar stopped before the answer was complete"
                self.relay.record(flow, call, status="truncated", sampled=call.stream.sampled if call.stream else None)
            except Exception as error:
                self.relay.internal_error("shutdown", error)
        if self.admin:
            self.admin.stop()
        settling = time.monotonic()
        await self.router.settle(timeout_s=2.0)  # the versions after the last calls, before the WAL closes
        flush_s = max(3.0, 5.0 - (time.monotonic() - settling))
        if self.relay.writer and not self.relay.writer.close(timeout_s=flush_s, wait_held=False):
            log.error("%d records are still in the write-ahead log; the next start replays them",
                      self.relay.writer.pending())  # fmt: skip
            atexit.register(os._exit, 3)  # after mitmproxy's own clean-up: a stop that leaves records is not clean
        self.stored_responses.close(timeout_s=2.0)  # after the records: what a restart needs most comes first
        self.router.close()

    # -- hooks ----------------------------------------------------------------------------------------------

    def tls_clienthello(self, data: Any) -> None:
        """Transparent mode: a TLS connection whose SNI is not a model host is passed through, never decrypted."""
        if not self.settings.tls_passthrough or type(data.context.client.proxy_mode).__name__ == "ReverseMode":
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
        if (refusal := apis.spec(api).refusal) is not None:  # e.g. Codex's WebSocket: it then POSTs at once
            status, body, counted = refusal
            self.metrics.inc(counted)
            flow.response = http.Response.make(status, json.dumps(body), dict(apis.spec(api).dialect.error_headers))
            return
        flow.metadata["forge_api"] = api

    async def request(self, flow: http.HTTPFlow) -> None:
        try:
            await self._request(flow)
        finally:
            await self.guard.request(flow)
            if "forge_api" in flow.metadata:  # last, after every await: mitmproxy picks the connection next
                self.idle.before_send(flow)

    async def _request(self, flow: http.HTTPFlow) -> None:
        api = flow.metadata.get("forge_api")
        if api is None or flow.response is not None:
            return
        try:
            served = apis.spec(api)
            if served.serve == apis.RECORDED:
                headers = identity.header_map(flow.request.headers)  # read once: lookups cost per call
                who = self._identity(flow, headers)
                route, asked = await self.router.choose(who[0])
                self._begin(flow, api, who, route, headers)
                if flow.response is not None:  # answered by the sidecar (a stored response this episode lacks)
                    return
                call: Call = flow.metadata["forge_call"]
                call.policy_version, call.version_why = asked
                assert call.replica is not None
                sequences = self.relay.prefixes.sequences(call.episode_id)
                await self.router.continuations_for(call.replica).prepare(flow, call, sequences)
            elif served.answer is not None:  # e.g. a stored response read or deleted: this episode's only, not routed
                who = self._identity(flow, identity.header_map(flow.request.headers))
                status, body = served.answer(self.stored_responses, who[0], flow.request.method, flow.request.path)
                flow.response = http.Response.make(status, body, {"content-type": "application/json"})
            else:  # served by the policy, not a sampled call: routed (to its own path), never recorded
                strip_hop_secrets(flow)
                flow.request.path = served.upstream_path(flow.request.path)
                self.router.route(flow, self.router.replicas.route(None).replica)
                if served.maps_model:
                    self.router.map_model(flow)
        except LookupError as error:  # no replica known (a dns+ name that listed none yet)
            self.metrics.inc("no_replica_total")
            flow.metadata["forge_answered"] = True
            flow.response = http.Response.make(
                502, error_body(api, 502, f"The policy server is unavailable ({error}).", "policy_unavailable"),
                error_headers(api),
            )  # fmt: skip
        except Exception as error:  # fail open: the call goes on unrecorded, but to the policy, never the real host
            self.relay.internal_error("request", error)
            if "forge_call" not in flow.metadata and apis.spec(api).paths:
                flow.request.path = apis.spec(api).upstream_path(flow.request.path)
                self.router.route(flow, self.router.replicas.route(None).replica)
            elif "forge_call" not in flow.metadata:  # answered by the sidecar, which failed: never the policy's
                flow.response = http.Response.make(500, error_body(api, 500, "The proxy failed on this request."),
                                                   error_headers(api))  # fmt: skip

    async def server_connect(self, data: Any) -> None:
        """A new connection to a replica that now refuses it (it died since the last poll) is sent to the next live
        replica instead, before any byte of the call went anywhere: no call is lost to a stopped replica."""
        address = data.server.address
        flows = self.router.connecting.get((data.client.id, address)) if address else None
        if not flows or len(self.router.replicas.all()) < 2:
            return
        try:
            await self.router.connect_or_move(data, flows)
        except Exception as error:  # fail open: the connection is tried as it was
            self.relay.internal_error("server_connect", error)

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        call: Call | None = flow.metadata.get("forge_call")
        assert flow.response is not None
        if "forge_api" in flow.metadata:
            self.router.connected(flow)
        if call is not None and call.replica is not None:
            self.router.replicas.served(call.episode_id, call.replica)  # its next call sticks there
        if call is None:
            if "forge_api" not in flow.metadata:
                flow.response.stream = True
            return
        is_sse = "text/event-stream" in flow.response.headers.get("content-type", "")
        if call.added and call.added.stream and is_sse and not flow.response.headers.get("content-encoding"):
            self.relay.stream(flow, call)

    async def response(self, flow: http.HTTPFlow) -> None:
        if "forge_api" in flow.metadata:  # the answer is read whole: the connection idles from now
            self.idle.call_ended(flow)
        try:
            await self._response(flow)
        finally:
            self.guard.response(flow)

    async def _response(self, flow: http.HTTPFlow) -> None:
        call: Call | None = flow.metadata.get("forge_call")
        if "forge_api" in flow.metadata:
            self.router.connected(flow)
        if (api := flow.metadata.get("forge_api")) is not None and apis.spec(api).lists_models:
            self._model_list(flow)
        if call is None or call.recorded:
            return
        try:
            failed = flow.response is not None and caused_by_tokens_in(flow.response.status_code)
            tokens_in = call.continuation is not None and call.continuation.state == "tokens_in"
            if (
                failed
                and tokens_in
                and call.replica
                and await self.router.continuations_for(call.replica).fall_back(self.relay, flow, call)
            ):
                return  # served (and recorded) by the normal path instead
            await self.relay.answer(flow, call)
        except Exception as error:
            self.relay.internal_error("response", error)

    def error(self, flow: http.HTTPFlow) -> None:
        try:
            self._error(flow)
        finally:
            self.guard.error(flow)
            if "forge_api" in flow.metadata:
                self.idle.call_ended(flow)

    def client_disconnected(self, client: Any) -> None:
        self.idle.client_gone(client.id)

    def _error(self, flow: http.HTTPFlow) -> None:
        call: Call | None = flow.metadata.get("forge_call")
        if "forge_api" in flow.metadata:
            self.router.connected(flow)
        if call is None or call.recorded:
            return
        try:
            reason = flow.error.msg if flow.error else "connection error"
            call.error = scrub_text(reason, call.secrets)
            status = "truncated" if call.stream is not None else "error"
            self.relay.record(flow, call, status=status, sampled=call.stream.sampled if call.stream else None)
        except Exception as error:
            self.relay.internal_error("error", error)

    def _model_list(self, flow: http.HTTPFlow) -> None:
        """vLLM lists models in OpenAI's shape; a client that speaks another dialect (its header says so) gets
        that dialect's."""
        assert flow.response is not None
        for dialect in {api.dialect.name: api.dialect for api in apis.REGISTRY.values()}.values():
            if dialect.model_list and dialect.header and flow.request.headers.get(dialect.header):
                if (listed := dialect.model_list(flow.response.get_content(strict=False) or b"")) is not None:
                    flow.response.content = listed
                return

    # -- the call's beginning --------------------------------------------------------------------------------

    def _model_api(self, flow: http.HTTPFlow) -> str | None:
        if type(flow.client_conn.proxy_mode).__name__ != "ReverseMode":  # reverse mode: every call is to the model
            host = (flow.request.pretty_host or "").lower()
            if host not in self.model_hosts and f"{host}:{flow.request.port}" not in self.model_hosts:
                return None
        return apis.api_for(flow.request.method, flow.request.path)

    def _identity(self, flow: http.HTTPFlow, headers: dict[str, str]) -> tuple[str, str | None, str]:
        o = self.settings
        rules = identity.Rules(
            o.episode_id, o.task_id, o.run_id, o.trust_episode_header, self.pod_episode,
            f"{self.relay.sidecar_id}-default",
        )  # fmt: skip
        return identity.identify(rules, headers, (flow.metadata.get("proxyauth") or (None,))[0], self.metrics)

    def _begin(
        self, flow: http.HTTPFlow, api: str, identity: tuple[str, str | None, str], route: Route,
        headers: dict[str, str],
    ) -> None:  # fmt: skip
        """Begin a model call: its record-to-be, then its upstream request, prepared whole before any of it is
        applied, so that a failure half way never sends a half-prepared call."""
        episode, task, run = identity
        assert self.relay.writer is not None
        seq = self.relay.writer.next_seq(episode)
        call = Call(
            call_id=f"{self.call_prefix}{next(self.call_numbers):08x}", api=api, episode_id=episode,
            task_id=task, run_id=run, seq=seq,
            started_at=int(flow.request.timestamp_start * 1e6),
            secrets=secrets_in_headers(flow.request.headers) + self.relay.secrets,
            host=flow.request.host_header or flow.request.pretty_host, path=flow.request.path.split("?", 1)[0],
        )  # fmt: skip
        call.user_agent = headers.get("user-agent")
        call.replica, call.moved_from, call.moved_why = route.replica, route.moved_from, route.why
        flow.metadata["forge_call"] = call
        self.relay.in_flight[call.call_id] = (flow, call)
        try:
            prepared = prepare(flow, call, headers, route.replica, self.router, self.stored_responses, self.metrics)
        except NotFound as refusal:  # a stored response or item this episode does not have: the API's own 404
            self.metrics.inc("responses_reference_refused_total")
            call.error = f"refused by the sidecar: {refusal.message}"
            flow.metadata["forge_answered"] = True
            flow.response = http.Response.make(404, refusal.body(), {"content-type": "application/json"})
            self.relay.record(flow, call, status="error")
            return
        except Exception as error:  # our code failed on an odd request: it goes to the policy as it came (the
            # server judges it, the harness gets its answer), recorded as an error; never half-prepared
            self.metrics.inc("requests_unprepared_total")
            log.error("a model call could not be prepared (%s); sent on as it came", type(error).__name__)
            call.error = f"request not prepared ({type(error).__name__}: {scrub_text(str(error), call.secrets)})"
            prepared = None
        # Applied at once, after everything that can fail: the upstream gets the whole prepared call or the original
        # (its body as it came, to the API's own path: never to another route of the policy server).
        strip_hop_secrets(flow)
        self.router.route(flow, route.replica)
        if prepared is not None:
            flow.request.headers.pop("content-encoding", None)  # vLLM reads no gzip/br/zstd bodies: sent decoded
            flow.request.path, flow.request.content = prepared
        else:
            flow.request.path = apis.spec(api).upstream_path(flow.request.path)


forge = Forge()
addons = [forge]
