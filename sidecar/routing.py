"""Which policy replica serves a call: the replicas' health (a poller asking each its model list, context, version
and paused state), an episode's sticky route, a call moved off a replica that refuses its connection, the policy's
served name and the requested-name map, and the per-replica clients (the version clock, tokens-in)."""

import asyncio
import contextlib
import fnmatch
import json
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlparse

from mitmproxy import http

from sidecar import apis, codec
from sidecar.call import Call
from sidecar.continuation import Continuations
from sidecar.metrics import Metrics
from sidecar.policy import PolicyServerClient, announced_policy, policy_context, upstream_headers
from sidecar.replicas import Replica, ReplicaSet, Route, parse_upstreams
from sidecar.version import Asked, VersionClock, version_text
from sidecar.writer import RecordWriter

log = logging.getLogger("openforge.sidecar")
CONTEXT_RETRY_S = 10.0  # how often calls may ask a policy server that did not say its context (max_model_len)
MODELS_TIMEOUT_S = 2.0  # the model list (served name, context): a replica that does not answer it is down
VERSION_POLL_TIMEOUT_S = 5.0  # the health poll's version question (answered between two engine steps)
PROBE_TIMEOUT_S = 2.0  # a replica that does not accept a connection within this is taken as down


class Router:
    """The policy replicas a sidecar sends its calls to, and what it knows of each."""

    def __init__(self, metrics: Metrics, on_error: Callable[[str, Exception], None]) -> None:
        self.metrics = metrics
        self.on_error = on_error  # our own failure: logged and counted, the call goes on
        self.replicas = ReplicaSet(parse_upstreams("http://127.0.0.1:8000"))
        self.writer: RecordWriter | None = None  # the version clocks complete its rows
        self.policy_model: str | None = None  # the policy's served name: given, or announced by the replicas
        self.policy_model_fixed = False  # given (--policy-model): never taken from an announcement
        self.policy_version: str | None = None  # fixed by --policy-version; else asked per call
        self.model_map: list[tuple[str, str]] = []
        self.tokens_in_mode = "off"
        self.health_s = 2.0
        self.max_completion_tokens = 0
        self.continuations: dict[str, Continuations] = {}  # per replica URL
        self.versions: dict[str, VersionClock] = {}  # per replica URL: asks its weight version around each call
        self.forgotten: list[VersionClock] = []  # of replicas DNS no longer lists (``settle`` waits for them too)
        self.context_asked: dict[str, float] = {}  # replica URL -> when a call last asked its context
        # Model calls routed but not yet connected, by (client connection, replica address): `server_connect` finds
        # the flows a new upstream connection is for, and moves them when their replica refuses it.
        self.connecting: dict[tuple[str, tuple[str, int]], list[http.HTTPFlow]] = {}
        self.stop = threading.Event()

    async def settle(self, timeout_s: float) -> None:
        """Shutdown: every replica's question after its last calls answered (together at most ``timeout_s``), the
        replicas DNS no longer lists included (their calls' rows wait in the WAL too)."""
        clocks = list(self.versions.values()) + list(self.forgotten)  # the poller thread may change them meanwhile
        await asyncio.gather(*(clock.settle(timeout_s) for clock in clocks))

    def close(self) -> None:
        self.stop.set()
        for clock in self.versions.values():
            clock.stop()
        for continuations in self.continuations.values():
            continuations.close()

    @staticmethod
    def client_for(replica: Replica) -> PolicyServerClient:
        """A client for one round of questions to a replica, on a connection of its own, closed after: the poll asks
        whether the replica takes *new* connections, as each harness call needs one, not whether a kept-alive one
        still works (a replica taken out of a Service keeps its open connections for a while)."""
        return PolicyServerClient(replica.url, MODELS_TIMEOUT_S, MODELS_TIMEOUT_S, headers=upstream_headers())

    def ask_models(self, replica: Replica, client: PolicyServerClient) -> None:
        """The policy's served name (unless given) and a replica's context, from its model list."""
        listed = client.get("/v1/models", MODELS_TIMEOUT_S)["data"]
        if not self.policy_model_fixed:
            announced = announced_policy(listed, self.policy_model)
            if announced != self.policy_model:
                log.warning("the policy is served as %r (announced by %s)", announced, replica.url)
            self.policy_model = announced
        context = policy_context(listed, self.policy_model)
        if context is not None:
            replica.context = context
        if self.policy_model is not None:
            replica.serves_policy = self.policy_model in {str(model.get("id")) for model in listed}

    async def learn_context(self, replica: Replica) -> None:
        try:
            with contextlib.closing(self.client_for(replica)) as client:
                await asyncio.to_thread(self.ask_models, replica, client)
        except Exception as error:  # the call goes on bounded by --max-completion-tokens only; the poller retries
            log.warning("the context of %s is not known yet (%s)", replica.url, type(error).__name__)

    def watch(self) -> None:
        """Every --health-seconds: resolve dns+ upstreams when due, and ask each replica its model list (served
        model name, context, and whether it is up). The version is asked per call."""
        interval = float(self.health_s)
        with ThreadPoolExecutor(max_workers=8, thread_name_prefix="forge-poll") as pool:
            while not self.stop.is_set():
                try:
                    if changes := self.replicas.refresh():
                        for change in changes:
                            log.warning("policy replicas: %s", change)
                        self.forget_gone()
                    replicas = self.replicas.all()
                    for replica, failure in zip(replicas, pool.map(self.poll, replicas), strict=True):
                        self.mark(replica, failure is None, failure)
                    self.judge_step()
                    self.replica_metrics()
                except Exception as error:  # the poller never dies
                    self.on_error("policy poll", error)
                self.stop.wait(interval)

    def forget_gone(self) -> None:
        """Replicas DNS no longer lists: their version clocks, tokens-in clients and gauges go too."""
        known = {replica.url for replica in self.replicas.all()}
        for url in [url for url in self.versions if url not in known]:
            clock = self.versions.pop(url)
            clock.stop()
            self.forgotten.append(clock)  # a question after its last calls may still be out: ``settle`` waits
        self.forgotten = [clock for clock in self.forgotten if clock.after_task is not None or clock.waiting]
        for url in [url for url in self.continuations if url not in known]:
            self.continuations.pop(url).close()
        for url in [url for url in self.context_asked if url not in known]:
            del self.context_asked[url]
        for url in self.replicas.gone:
            self.metrics.remove(f'replica_up{{replica="{url}"}}')
            self.metrics.remove(f'replica_out_of_step{{replica="{url}"}}')

    def poll(self, replica: Replica) -> str | None:
        with contextlib.closing(self.client_for(replica)) as client:
            try:
                self.ask_models(replica, client)
            except Exception as error:  # unreachable, timed out: what the client met; an HTTP error: its own
                cause = error.__cause__ if isinstance(error.__cause__, OSError) else error
                return f"{type(cause).__name__}: {cause}"
            if len(self.replicas.all()) > 1:  # whether it is in step with the others (ReplicaSet.judge_step)
                try:
                    replica.paused = bool(client.get("/is_paused", VERSION_POLL_TIMEOUT_S).get("is_paused"))
                    replica.version = version_text(client.get("/weight_info", VERSION_POLL_TIMEOUT_S))
                except Exception:  # a busy engine answers late: its step is judged at a later poll
                    replica.paused = True  # not judged now
        return None

    def judge_step(self) -> None:
        """Replicas out of step (another version than the others', or not serving the policy) take no call."""
        for replica, why in self.replicas.judge_step():
            if why is None:
                log.warning("policy replica %s is in step again: it takes calls", replica.url)
            else:
                self.metrics.inc("replica_out_of_step_total")
                log.warning("policy replica %s is out of step (%s): its episodes move to the others", replica.url, why)

    def mark(self, replica: Replica, up: bool, reason: str | None = None) -> None:
        was = replica.up
        if self.replicas.mark(replica, up, reason):
            if up and was is False:
                log.warning("policy replica %s is up again", replica.url)
            elif not up:
                self.metrics.inc("replica_down_total")
                log.warning("policy replica %s is down (%s); its episodes move to the others", replica.url, reason)
        self.replica_metrics()

    def replica_metrics(self) -> None:
        replicas = self.replicas.all()
        for replica in replicas:
            self.metrics.set(f'replica_up{{replica="{replica.url}"}}', 1 if replica.up else 0)
            self.metrics.set(f'replica_out_of_step{{replica="{replica.url}"}}', 1 if replica.out_of_step else 0)
        self.metrics.set("upstream_up", 1 if any(r.up for r in replicas) else 0)

    def clock(self, replica: Replica) -> VersionClock:
        if replica.url not in self.versions:
            writer = self.writer
            assert writer is not None
            self.versions[replica.url] = VersionClock(
                urlparse(replica.url), lambda rows, v: writer.complete_many(rows, {"policy_version_end": v})
            )
        return self.versions[replica.url]

    def continuations_for(self, replica: Replica) -> Continuations:
        if replica.url not in self.continuations:
            self.continuations[replica.url] = Continuations(self.tokens_in_mode, replica.url)
        return self.continuations[replica.url]

    async def choose(self, episode: str) -> tuple[Route, Asked]:
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
                await self.learn_context(replica)
            if self.policy_version:
                return route, Asked(self.policy_version)
            clock = self.clock(replica)
            version = await clock.before()
            if not clock.refused or replica.url in tried or len(self.replicas.all()) < 2:
                return route, version
            self.mark(replica, False, "connection refused")
            tried.append(replica.url)

    def route(self, flow: http.HTTPFlow, replica: Replica) -> None:
        request = flow.request
        if (request.scheme, request.host, request.port) != (replica.scheme, replica.host, replica.port):
            request.scheme, request.host, request.port = replica.scheme, replica.host, replica.port
        request.headers["host"] = replica.netloc
        self.connecting.setdefault((flow.client_conn.id, (replica.host, replica.port)), []).append(flow)

    def connected(self, flow: http.HTTPFlow) -> None:
        """The flow no longer waits for a connection to its replica."""
        key = (flow.client_conn.id, (flow.request.host, flow.request.port))
        waiting = self.connecting.get(key)
        if waiting is not None:
            if flow in waiting:
                waiting.remove(flow)
            if not waiting:
                del self.connecting[key]

    async def connect_or_move(self, data: Any, flows: list[http.HTTPFlow]) -> None:
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
                self.mark(replica, False, f"connection {failed}")
                tried.append(replica.url)
                replica = self.replicas.route(call.episode_id if call else None, exclude=tried).replica
        if not tried or replica is None or replica.url in tried:
            return  # reachable as routed, or no replica is: mitmproxy's own attempt fails and PolicyGuard answers
        data.server.address = (replica.host, replica.port)
        if replica.scheme == "https":
            data.server.sni = replica.host
        for flow in list(flows):
            self.connected(flow)
            self.route(flow, replica)
            moved: Call | None = flow.metadata.get("forge_call")
            if moved is None:
                continue
            route = self.replicas.route(moved.episode_id, exclude=tried)
            moved.replica, moved.moved_from, moved.moved_why = replica, route.moved_from, route.why
            self.bound_again(flow, moved, replica)
            if not self.policy_version:
                moved.policy_version, moved.version_why = await self.clock(replica).before()

    def bound_again(self, flow: http.HTTPFlow, call: Call, replica: Replica) -> None:
        """A call moved to another replica is bounded by that one's context (it was by the one it left)."""
        if call.bound is None or call.bound.context == replica.context:
            return
        try:
            body = codec.loads(flow.request.content or b"")
            served_api = apis.api_for("POST", flow.request.path)  # chat for Messages
            if not isinstance(body, dict) or served_api is None or not apis.spec(served_api).max_token_fields:
                return
            bound = apis.bound_completion(served_api, body, self.max_completion_tokens, replica.context)
            content = codec.dumps(body)
        except Exception as error:  # the call goes as it is: the new replica judges its bound
            self.on_error("bound again", error)
            return
        call.bound = apis.CompletionBound(call.bound.requested, bound.sent, replica.context)
        flow.request.content = content

    def served_model(self, requested: str | None) -> str | None:
        for pattern, target in self.model_map:
            if fnmatch.fnmatchcase(requested or "", pattern):
                return target or self.policy_model
        return None

    def map_model(self, flow: http.HTTPFlow) -> None:
        try:
            body = json.loads(flow.request.get_content(strict=True) or b"")
        except ValueError:
            return  # the upstream judges it
        if isinstance(body, dict) and (served := self.served_model(body.get("model"))):
            body["model"] = served
            flow.request.content = json.dumps(body, ensure_ascii=False).encode()
