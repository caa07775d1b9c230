"""Several policy replicas (sidecar/replicas.py): the rendezvous hash, the live set, and — with two real vLLM
servers behind the real sidecar — an episode that sticks to one replica and moves, recorded, when it stops."""

import json
import time
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar.policy import PolicyServerClient
from sidecar.replicas import ReplicaSet, UpstreamError, parse_upstreams, rendezvous
from tests.support.policy_server import started_policy_server
from tests.support.sidecar import call_table, read_calls, wait_for
from trainer.model import PreparedModel
from trainer.serve import PolicyServer

REPLICA_URLS = st.lists(
    st.builds("http://10.0.{}.{}:8000".format, st.integers(0, 255), st.integers(1, 254)), min_size=1, max_size=8,
    unique=True,
)  # fmt: skip
EPISODES = st.text(min_size=1, max_size=40)


# -- the hash -----------------------------------------------------------------------------------------------------
@given(EPISODES, REPLICA_URLS, st.randoms())
def test_an_episode_gets_the_same_replica_whatever_the_order_of_the_list(episode, urls, rng):
    shuffled = list(urls)
    rng.shuffle(shuffled)
    assert rendezvous(episode, urls) == rendezvous(episode, shuffled) in urls


@given(st.lists(EPISODES, min_size=1, max_size=50, unique=True), REPLICA_URLS.filter(lambda u: len(u) > 1), st.data())
def test_a_replica_going_away_moves_only_its_own_episodes(episodes, urls, data):
    gone = data.draw(st.sampled_from(urls))
    rest = [u for u in urls if u != gone]
    for episode in episodes:
        before, after = rendezvous(episode, urls), rendezvous(episode, rest)
        assert after == before if before != gone else after in rest


@given(st.lists(EPISODES, min_size=1, max_size=50, unique=True), REPLICA_URLS, st.data())
def test_a_new_replica_takes_episodes_only_for_itself(episodes, urls, data):
    new = data.draw(st.sampled_from([f"http://10.1.0.{i}:8000" for i in range(1, 20)]))
    for episode in episodes:
        assert rendezvous(episode, [*urls, new]) in (rendezvous(episode, urls), new)


def test_episodes_spread_evenly_over_the_replicas():
    urls = [f"http://10.0.0.{i}:8000" for i in range(1, 5)]
    counts = Counter(rendezvous(f"episode-{n}", urls) for n in range(8000))
    assert set(counts) == set(urls) and all(1700 < c < 2300 for c in counts.values()), counts


def test_the_hash_is_the_same_in_every_process():
    # Fixed by blake2b, not Python's salted hash(): sidecars on different machines agree, and so do restarts.
    assert rendezvous("episode-1", ["http://a:1", "http://b:1", "http://c:1"]) == "http://c:1"


# -- --upstream ---------------------------------------------------------------------------------------------------
def test_upstreams_are_given_by_comma_or_repeated_without_repeats():
    parsed = parse_upstreams(["http://a:8000, http://b:9000", "http://a:8000", "https://c", "dns+http://svc.ns:8000"])
    assert [(u.url, u.dns) for u in parsed] == [
        ("http://a:8000", False), ("http://b:9000", False), ("https://c:443", False), ("http://svc.ns:8000", True),
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("value", "says"),
    [("", "empty"), ("ftp://a:1", "http(s)://HOST:PORT"), ("http://a:1/v1", "http(s)://HOST:PORT"),
     ("http://a:99999", "out of range"), ("dns+http://10.0.0.1:8000", "needs a name"), ("a:8000", "HOST:PORT")],
)  # fmt: skip
def test_a_bad_upstream_says_what_to_write(value, says):
    with pytest.raises(UpstreamError, match=says.replace("(", r"\(").replace(")", r"\)")):
        parse_upstreams(value)


# -- the live set -------------------------------------------------------------------------------------------------
def two_replicas() -> ReplicaSet:
    return ReplicaSet(parse_upstreams("http://127.0.0.1:1001,http://127.0.0.1:1002"))


def test_an_episode_sticks_where_it_was_served_and_moves_only_when_that_replica_is_down():
    replicas = two_replicas()
    first = replicas.route("ep")
    assert first.moved_from is None and first.replica.url == rendezvous("ep", [r.url for r in replicas.all()])
    replicas.served("ep", first.replica)
    replicas.mark(first.replica, False, "connection refused")
    moved = replicas.route("ep")
    assert moved.replica is not first.replica
    assert (moved.moved_from, moved.why) == (first.replica.url, "connection refused")
    replicas.served("ep", moved.replica)
    replicas.mark(first.replica, True)  # back: the episode stays where its prefix cache now is
    assert replicas.route("ep") == type(moved)(moved.replica)


def test_an_unreachable_replica_is_skipped_for_the_call_and_said_so():
    replicas = two_replicas()
    home = replicas.route("ep").replica
    replicas.served("ep", home)
    other = replicas.route("ep", exclude=[home.url])
    assert other.replica is not home and (other.moved_from, other.why) == (home.url, "unreachable")
    replicas.mark(home, False, "connection refused")
    assert replicas.route("ep", exclude=[home.url]).why == "connection refused"


def test_a_first_call_whose_replica_is_down_is_no_move():
    replicas = two_replicas()
    home = replicas.route("ep").replica
    replicas.mark(home, False, "connection refused")
    route = replicas.route("ep")
    assert route.replica is not home and route.moved_from is None


def test_with_every_replica_down_the_episode_keeps_its_own():
    replicas = two_replicas()
    home = replicas.route("ep").replica
    for replica in replicas.all():
        replicas.mark(replica, False, "down")
    assert replicas.route("ep").replica is home


def polled(replicas: ReplicaSet, *states: tuple[str | None, bool, bool]) -> None:
    """What a health poll found: (version, paused, serves the policy) per replica, in order; all up."""
    for replica, (version, paused, serves) in zip(replicas.all(), states, strict=True):
        replicas.mark(replica, True)
        replica.version, replica.paused, replica.serves_policy = version, paused, serves


def test_a_replica_out_of_step_takes_no_call_while_another_is_in_step():
    replicas = two_replicas()
    a, b = replicas.all()
    episode = next(e for e in (f"ep-{n}" for n in range(100)) if rendezvous(e, [a.url, b.url]) == b.url)
    replicas.served(episode, b)
    polled(replicas, ("3", False, True), ("left-out-v3", False, True))  # the publish of v3 left b out
    assert replicas.judge_step() == [(b, "serves version left-out-v3, the others 3")]
    route = replicas.route(episode)
    assert (route.replica, route.moved_from, route.why) == (a, b.url, "serves version left-out-v3, the others 3")
    assert {replicas.route(None).replica.url for _ in range(4)} == {a.url}
    polled(replicas, ("3", False, True), ("2", False, True))  # back after a restart, an older version: still out
    assert replicas.judge_step() == [(b, "serves version 2, the others 3")]
    polled(replicas, ("3", False, True), ("3", False, False))  # the policy's name missing
    assert replicas.judge_step() == [(b, "does not serve the policy")]
    polled(replicas, ("4", False, True), ("4", False, True))  # the next publish landed on both
    assert replicas.judge_step() == [(b, None)] and replicas.route("new-episode").replica.out_of_step is None


def test_a_paused_replica_is_not_judged_and_a_lone_or_unnumbered_one_never_out_of_step():
    replicas = two_replicas()
    a, b = replicas.all()
    polled(replicas, ("4", False, True), ("3", True, True))  # a publish under way: b is paused, not yet at v4
    assert replicas.judge_step() == [] and b.out_of_step is None
    polled(replicas, ("default", False, True), ("default", False, True))  # no trainer yet: no numbered version
    assert replicas.judge_step() == []
    replicas.mark(a, False, "connection refused")  # b alone up: nothing to be out of step with
    polled(replicas, ("3", False, True), ("left-out-v3", False, True))
    replicas.mark(a, False, "connection refused")
    assert replicas.judge_step() == [] and replicas.route("ep").replica is b


def test_calls_without_an_episode_take_the_live_replicas_in_turn():
    replicas = ReplicaSet(parse_upstreams("http://127.0.0.1:1001,http://127.0.0.1:1002,http://127.0.0.1:1003"))
    replicas.mark(replicas.all()[0], False, "down")
    assert Counter(replicas.route(None).replica.url for _ in range(10)) == {
        "http://127.0.0.1:1002": 5, "http://127.0.0.1:1003": 5,
    }  # fmt: skip


def test_a_dns_name_stands_for_every_address_it_resolves_to_asked_again_on_refresh():
    # A stand-in for a headless Service's records: a resolver whose answers the test sets.
    answers = {"policy.ns": ["10.0.0.1", "10.0.0.2"]}
    replicas = ReplicaSet(
        parse_upstreams("dns+http://policy.ns:8000,http://127.0.0.1:9000"), resolver=lambda name, port: answers[name],
        refresh_s=0,
    )  # fmt: skip
    urls = {r.url for r in replicas.all()}
    assert urls == {"http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://127.0.0.1:9000"}
    episode = next(f"ep-{n}" for n in range(100) if rendezvous(f"ep-{n}", sorted(urls)) == "http://10.0.0.2:8000")
    replicas.served(episode, replicas.route(episode).replica)
    answers["policy.ns"] = ["10.0.0.1", "10.0.0.3"]  # a pod replaced: .2 left, .3 joined
    assert replicas.refresh() == ["http://10.0.0.3:8000 joined (policy.ns)", "http://10.0.0.2:8000 left (policy.ns)"]
    route = replicas.route(episode)
    assert route.moved_from == "http://10.0.0.2:8000" and route.why == "no longer listed by policy.ns"
    del answers["policy.ns"]  # resolution fails: what it had is kept

    def failing(name: str, port: int) -> list[str]:
        raise OSError("temporary failure in name resolution")

    replicas.resolver = failing
    assert "not resolved" in replicas.refresh()[0] and len(replicas.all()) == 3


def test_a_real_name_resolves():
    replicas = ReplicaSet(parse_upstreams("dns+http://localhost:8000"))  # localhost: a stand-in for a Service name
    assert "http://127.0.0.1:8000" in {r.url for r in replicas.all()}


# -- the real sidecar, no policy server needed ---------------------------------------------------------------------
def test_a_bad_upstream_stops_forge_sidecar_with_one_line():
    from click.testing import CliRunner

    from forge.cli import cli

    result = CliRunner().invoke(cli, ["sidecar", "--upstream", "http://a:1", "--upstream", "ftp://b:2"])
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert "--upstream 'ftp://b:2': write http(s)://HOST:PORT" in result.output


@pytest.mark.integration
def test_a_name_that_lists_no_replica_gets_the_harness_a_json_error(start_sidecar):
    sidecar = start_sidecar("dns+http://nothing.invalid:8000", mode="reverse:http://127.0.0.1:9", episode_id="ep")
    answer = httpx.post(f"{sidecar.url}/v1/chat/completions", timeout=30,
                        json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
    assert answer.status_code == 502 and answer.json()["error"]["code"] == "policy_unavailable", answer.text
    assert sidecar.metrics()["no_replica_total"] == 1 and sidecar.metrics()["upstream_up"] == 0


# -- two real vLLM replicas behind the real sidecar ---------------------------------------------------------------
@pytest.fixture(scope="module")
def second_replica(prepared_model: PreparedModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PolicyServer]:
    """A second real vLLM (the first is the session's policy server): the one this module stops. A shorter context
    than the first's, as replicas may differ."""
    with started_policy_server(tmp_path_factory.mktemp("vllm-b"), 4096, "the second vLLM server") as server:
        yield server


class Conversation:
    """One episode's multi-turn chat through a sidecar: each call resends the history (as harnesses do), so the
    replica that serves it can reuse its prefix cache."""

    def __init__(self, sidecar_url: str, episode: str) -> None:
        self.client = httpx.Client(base_url=sidecar_url, timeout=120, headers={"x-forge-episode-id": episode})
        self.episode = episode
        self.messages: list[dict] = []
        self.answered = 0

    def turn(self, stream: bool = False) -> str:
        self.messages.append({"role": "user", "content": f"Name a colour, turn {len(self.messages) // 2 + 1}."})
        body = {"model": "gpt-4o", "messages": self.messages, "max_tokens": 8, "temperature": 0, "stream": stream}
        answer = self.client.post("/v1/chat/completions", json=body)
        assert answer.status_code == 200, f"{self.episode}: a call failed: {answer.status_code} {answer.text[:500]}"
        if stream:
            assert answer.text.rstrip().endswith("data: [DONE]"), answer.text[-300:]
            chunks = [json.loads(line[6:]) for line in answer.text.splitlines() if line.startswith("data: {")]
            text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
        else:
            text = answer.json()["choices"][0]["message"]["content"] or ""
        self.messages.append({"role": "assistant", "content": text})
        self.answered += 1
        return text


def episode_on(replica: str, replicas: list[str], name: str) -> str:
    """An episode id whose rendezvous hash puts it on the given replica."""
    return next(e for e in (f"{name}-{n}" for n in range(1000)) if rendezvous(e, replicas) == replica)


@pytest.mark.integration
def test_an_episode_sticks_to_one_replica_and_moves_without_losing_a_call_when_it_stops(
    policy_server, second_replica, start_sidecar
):
    a, b = policy_server.base_url, second_replica.base_url  # b is the one stopped (a may be a shared server)
    version_a = PolicyServerClient(a, timeout=30).get("/weight_info")["weight_version"]
    # b's own label, so each record shows which replica served it — unless a (a shared server) already serves a
    # published version: a replica serving another than the newest published one is out of step and takes no call
    version_b = version_a if version_a is not None and str(version_a).isdigit() else "b-1"
    PolicyServerClient(b, timeout=30).post("/update_weight_version", {"new_version": version_b})
    upstream = f"{a},{b}"
    # Two sidecars over the same replicas, whose health poll would come too late to notice the stop: one asks each
    # call's version of its replica (the stopped replica is found by that question), the other has a fixed version
    # (found when the new connection to it is refused).
    polls = ("--health-seconds", "600")
    asked = start_sidecar(upstream, mode=f"reverse:{a}", episode_id=None, extra=polls)
    fixed = start_sidecar(upstream, mode=f"reverse:{a}", episode_id=None, extra=(*polls, "--policy-version", "fixed-7"))
    moving = Conversation(asked.url, episode_on(b, [a, b], "moving"))
    moving_fixed = Conversation(fixed.url, episode_on(b, [a, b], "moving-fixed"))
    staying = Conversation(asked.url, episode_on(a, [a, b], "staying"))
    for stream in (False, True, False):
        moving.turn(stream)
    moving_fixed.turn()
    moving_fixed.turn(stream=True)
    staying.turn()

    second_replica.stop()  # no call in flight
    stopped_at = time.monotonic()
    moving.turn()
    moving_fixed.turn()
    moved_within_s = time.monotonic() - stopped_at
    moving.turn(stream=True)
    moving_fixed.turn()
    staying.turn(stream=True)

    conversations = (moving, moving_fixed, staying)
    expected = sum(c.answered for c in conversations)
    calls = wait_for(lambda: (rows := read_calls(asked.store)) and len(rows) == expected and rows, timeout=30,
                     what=f"{expected} call records")  # fmt: skip
    print(call_table(calls))
    by_episode = {c.episode: [r for r in calls if r["episode_id"] == c.episode] for c in conversations}
    assert all(r["status"] == "ok" for r in calls), call_table(calls)  # no call lost
    assert {e: [r["seq"] for r in rows] for e, rows in by_episode.items()} == {
        moving.episode: [0, 1, 2, 3, 4], moving_fixed.episode: [0, 1, 2, 3], staying.episode: [0, 1],
    }  # fmt: skip

    def served(episode: str) -> list[tuple[str, str | None, str | None]]:
        return [(r["replica"], r["replica_moved_from"], r["policy_version"]) for r in by_episode[episode]]

    assert served(moving.episode) == [(b, None, version_b)] * 3 + [(a, b, version_a), (a, None, version_a)]
    assert served(moving_fixed.episode) == [(b, None, "fixed-7")] * 2 + [(a, b, "fixed-7"), (a, None, "fixed-7")]
    assert served(staying.episode) == [(a, None, version_a)] * 2  # the other replica's episodes never move
    for row in (by_episode[moving.episode][3], by_episode[moving_fixed.episode][2]):
        assert f"moved from replica {b} (connection refused)" in (row["note"] or ""), row["note"]
    for sidecar in (asked, fixed):
        metrics = wait_for(lambda s=sidecar: (m := s.metrics()).get(f'replica_up{{replica="{b}"}}') == 0 and m,
                           what="the stopped replica reported down")  # fmt: skip
        assert metrics[f'replica_up{{replica="{a}"}}'] == 1 and metrics["upstream_up"] == 1
        assert metrics["replica_moves_total"] == 1
    from collector.report import fidelity
    from collector.sql import connect

    columns, rows = fidelity(connect(asked.store, episodes=True, idle_seconds=0))
    (run,) = [dict(zip(columns, r, strict=True)) for r in rows if r[0] == "run"]
    assert run["replica_moves"] == 2 and run["calls"] == expected  # `forge report` counts the moves
    ms = [(r["finished_at"] - r["started_at"]).total_seconds() * 1e3 for r in by_episode[moving.episode]]
    print(
        f"call durations (ms) of the moving episode: {[round(m) for m in ms]}; the moved one is call 3; the first"
        f" two calls after the stop took {moved_within_s:.2f} s together"
    )
