"""Stateful OpenAI Responses (``store`` on, ``previous_response_id``, ``item_reference``, GET/DELETE of a stored
response) through the real sidecar to the real vLLM, driven by the official ``openai`` SDK (sidecar/response_store.py).

vLLM keeps no responses (0.32: ``store`` ignored, ``item_reference`` refused), so before the sidecar resolved them a
tool loop with the SDK's defaults died after its first step. How a test knows a reference was resolved right: the
same loop sent with ``store: false`` and its whole history in every request (in another episode) is recorded with
exactly the same prompt and completion ids.
"""

import itertools
from typing import Any

import httpx
import openai
import pytest

from tests.support.sidecar import read_calls, wait_for

pytestmark = pytest.mark.integration

SYSTEM = (
    "You can call one tool: get_weather(city). To call it, answer with exactly "
    '<tool_call>{"name": "get_weather", "arguments": {"city": CITY}}</tool_call> and nothing else.'
)
CITY_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS: list[Any] = [{"type": "function", "name": "get_weather", "description": "Weather", "parameters": CITY_SCHEMA}]
CALLED_BEFORE = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
FIRST: list[Any] = [  # an example call in the history: the 135M model then calls the tool itself
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": CALLED_BEFORE},
    {"role": "user", "content": "sunny. What is the weather in Berlin?"},
]
STEPS = 3
SECRET_OF_A = "the-password-of-episode-a-is-swordfish"


def client(sidecar, episode: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{sidecar.url}/v1", api_key="sk-test-not-real", max_retries=0, timeout=120,
        default_headers={"x-forge-episode-id": episode},
    )  # fmt: skip


def create(sdk: openai.OpenAI, stream: bool, **body: Any) -> Any:
    """One Responses call (the SDK's defaults: ``store`` unset, which the API reads as true)."""
    body = {"model": "gpt-5", "instructions": SYSTEM, "tools": TOOLS, "max_output_tokens": 40, "temperature": 0, **body}
    if not stream:
        return sdk.responses.create(**body)
    events = list(sdk.responses.create(stream=True, **body))
    assert events[-1].type in ("response.completed", "response.incomplete")
    return events[-1].response


def answer_to(response: Any, step: int) -> list[Any]:
    """What the harness says next: each tool call's output, or a new question when the model called none."""
    calls = [item for item in response.output if item.type == "function_call"]
    if calls:
        return [
            {"type": "function_call_output", "call_id": c.call_id, "output": f"sunny, {20 + step} C"} for c in calls
        ]
    return [{"role": "user", "content": f"Thanks. And the weather in city number {step}?"}]


def episode_calls(store: str, episode: str, n: int) -> list[dict]:
    return wait_for(
        lambda: (calls := read_calls(store, f"episode_id = '{episode}'")) and len(calls) == n and calls,
        what=f"{n} call records of {episode}",
    )


def assert_one_segment(calls: list[dict]) -> None:
    """Every call ok, each prompt extending the previous call's prompt and completion: one segment."""
    assert [c["status"] for c in calls] == ["ok"] * len(calls), [(c["status"], c["error"]) for c in calls]
    for before, after in itertools.pairwise(calls):
        previous = list(before["prompt_token_ids"]) + list(before["completion_token_ids"])
        assert list(after["prompt_token_ids"][: len(previous)]) == previous
        assert after["parent_call_id"] == before["call_id"] and after["prefix_len"] == len(previous)


def stored_loop(sdk: openai.OpenAI, how: str, streams: list[bool]) -> list[Any]:
    """A tool loop as the SDKs run it with ``store`` on: earlier answers by ``previous_response_id``, or by
    ``item_reference`` to their output items; the answers."""
    sent: list[Any] = list(FIRST)
    replies: list[Any] = []
    for step, stream in enumerate(streams):
        previous = {"previous_response_id": replies[-1].id} if replies and how == "previous_response_id" else {}
        reply = create(sdk, stream, input=sent, **previous)
        assert reply.output and reply.status in ("completed", "incomplete")
        replies.append(reply)
        following = answer_to(reply, step)
        if how == "previous_response_id":
            sent = following
        else:
            sent = sent + [{"type": "item_reference", "id": item.id} for item in reply.output] + following
    return replies


def stateless_loop(sdk: openai.OpenAI, streams: list[bool]) -> list[Any]:
    """The same loop with ``store: false``: the whole history in every request."""
    history: list[Any] = list(FIRST)
    replies: list[Any] = []
    for step, stream in enumerate(streams):
        reply = create(sdk, stream, input=history, store=False)
        replies.append(reply)
        history += [item.model_dump(exclude_none=True) for item in reply.output] + answer_to(reply, step)
    return replies


def outputs(replies: list[Any]) -> list[Any]:
    return [[(i.type, getattr(i, "content", None), getattr(i, "arguments", None)) for i in r.output] for r in replies]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("how", ["previous_response_id", "item_reference"])
def test_a_stored_tool_loop_sends_vllm_the_whole_history(start_sidecar, policy_server, stream, how):
    """Tokens-in off: the policy is sent exactly what the stateless loop sends, so the records are the same."""
    sidecar = start_sidecar(policy_server.base_url, episode_id=None, extra=("--tokens-in", "off"))
    stored = stored_loop(client(sidecar, "stored"), how, [stream] * STEPS)
    plain = stateless_loop(client(sidecar, "plain"), [stream] * STEPS)
    assert outputs(stored) == outputs(plain)
    assert any(i.type == "function_call" for r in stored for i in r.output)  # a tool loop, not only text
    recorded = episode_calls(sidecar.store, "stored", STEPS)
    exact = episode_calls(sidecar.store, "plain", STEPS)
    assert [c["status"] for c in recorded + exact] == ["ok"] * 2 * STEPS, [c["error"] for c in recorded + exact]
    assert [c["response_id"] for c in recorded] == [r.id for r in stored]  # the ids referred to: the recorded ones
    for mine, theirs in zip(recorded, exact, strict=True):
        assert list(mine["prompt_token_ids"]) == list(theirs["prompt_token_ids"])
        assert list(mine["completion_token_ids"]) == list(theirs["completion_token_ids"])


@pytest.mark.parametrize("how", ["previous_response_id", "item_reference"])
def test_a_stored_tool_loop_is_one_segment(start_sidecar, policy_server, how):
    """The default (tokens-in auto): each call continues the answer it names by id with its sampled ids (this
    model's template renders no tool call; the stateless loop forks there), whole and streamed alike. Then the
    stored answers are read back and deleted as at OpenAI."""
    sidecar = start_sidecar(policy_server.base_url, episode_id=None)
    sdk = client(sidecar, "stored")
    replies = stored_loop(sdk, how, [False, True, False, True])
    calls = episode_calls(sidecar.store, "stored", 4)
    assert_one_segment(calls)
    assert [c["response_id"] for c in calls] == [r.id for r in replies]
    assert all(c["continuation"] in (None, "tokens_in") for c in calls), [c["note"] for c in calls]
    assert any(c["continuation"] == "tokens_in" and calls[0]["call_id"] in c["note"] for c in calls[1:])

    kept = sdk.responses.retrieve(replies[0].id)
    assert kept.id == replies[0].id and outputs([kept]) == outputs(replies[:1])
    listed = httpx.get(f"{sidecar.url}/v1/responses/{replies[0].id}/input_items",
                       headers={"x-forge-episode-id": "stored"}, timeout=30).json()  # fmt: skip
    assert listed["object"] == "list" and [i.get("content") for i in listed["data"]] == [i["content"] for i in FIRST]
    sdk.responses.delete(replies[-1].id)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(replies[-1].id)
    with pytest.raises(openai.NotFoundError):
        create(sdk, False, input="and?", previous_response_id=replies[-1].id)


def test_another_episodes_responses_cannot_be_read_or_spliced(start_sidecar, policy_server):
    """An agent that learns another episode's response or item id (a shared log, a guess) gets the API's own 404
    for each use of it, exactly as for an id that never existed; nothing of the other episode reaches its prompt."""
    sidecar = start_sidecar(policy_server.base_url, episode_id=None)
    a, b = client(sidecar, "episode-a"), client(sidecar, "episode-b")
    theirs = create(a, False, input=[{"role": "user", "content": f"Remember this: {SECRET_OF_A}. Say ok."}])
    item = theirs.output[0].id

    def refused(call, param: str, code: str | None) -> dict:
        with pytest.raises(openai.NotFoundError) as caught:
            call()
        error = caught.value.body
        assert isinstance(error, dict)
        assert caught.value.status_code == 404 and error["type"] == "invalid_request_error", error
        assert (error["param"], error["code"]) == (param, code), error
        return error

    unknown = refused(lambda: create(b, False, input="hi", previous_response_id="resp_never"),
                      "previous_response_id", "previous_response_not_found")  # fmt: skip
    other = refused(lambda: create(b, False, input="hi", previous_response_id=theirs.id),
                    "previous_response_id", "previous_response_not_found")  # fmt: skip
    assert unknown["message"] == "Previous response with id 'resp_never' not found."
    assert other["message"] == f"Previous response with id '{theirs.id}' not found."
    refused(lambda: create(b, False, input=[{"type": "item_reference", "id": item}]), "input", None)
    refused(lambda: create(b, True, input=[{"type": "item_reference", "id": item}]), "input", None)
    for path in (f"/v1/responses/{theirs.id}", f"/v1/responses/{theirs.id}/input_items"):
        answer = httpx.get(sidecar.url + path, headers={"x-forge-episode-id": "episode-b"}, timeout=30)
        assert answer.status_code == 404 and answer.json()["error"]["message"] == (
            f"Response with id '{theirs.id}' not found."
        )
    answer = httpx.delete(sidecar.url + f"/v1/responses/{theirs.id}", headers={"x-forge-episode-id": "episode-b"})
    assert answer.status_code == 404
    assert a.responses.retrieve(theirs.id).output_text == theirs.output_text  # still there for its own episode

    refusals = episode_calls(sidecar.store, "episode-b", 4)
    assert all(c["status"] == "error" and c["http_status"] == 404 for c in refusals)
    assert all(c["prompt_token_ids"] is None and "refused by the sidecar" in c["error"] for c in refusals)
    assert not any(SECRET_OF_A in (c["response_json"] or "") for c in refusals)
    assert sidecar.metrics()["responses_reference_refused_total"] == 4


def test_store_false_keeps_nothing(start_sidecar, policy_server):
    """``store: false`` is today's behaviour: the answer is served and recorded, and kept nowhere; beside it an
    answer with the default ``store`` is kept."""
    sidecar = start_sidecar(policy_server.base_url, episode_id=None)
    sdk = client(sidecar, "episode-1")
    kept = create(sdk, False, input=FIRST)
    unkept = create(sdk, False, input=FIRST, store=False)
    assert create(sdk, False, input="and?", previous_response_id=kept.id).output
    with pytest.raises(openai.NotFoundError):
        create(sdk, False, input="and?", previous_response_id=unkept.id)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(unkept.id)
    assert sdk.responses.retrieve(kept.id).id == kept.id


def test_a_stored_tool_loop_goes_on_across_a_sidecar_restart(start_sidecar, policy_server, tmp_path):
    """Step 1 is served by one sidecar, which then stops (SIGTERM, as a pod's restart does); a new one on the same
    WAL folder serves the next steps, which name the earlier answers by ``previous_response_id``: each is resolved
    from what the first one kept, so the policy is sent what the stateless loop sends (tokens-in off) and the
    records are the same. Before the answers were kept on disk the second step was a 404."""
    wal = tmp_path / "wal-restarted"
    first = start_sidecar(policy_server.base_url, episode_id=None, wal_dir=wal, extra=("--tokens-in", "off"))
    sent: list[Any] = list(FIRST)
    replies = [create(client(first, "stored"), False, input=sent)]
    assert first.stop() == 0
    second = start_sidecar(policy_server.base_url, episode_id=None, wal_dir=wal, store=first.store,
                           extra=("--tokens-in", "off"))  # fmt: skip
    sdk = client(second, "stored")
    for step in range(1, STEPS):
        following = answer_to(replies[-1], step - 1)
        replies.append(create(sdk, False, input=following, previous_response_id=replies[-1].id))
    plain = stateless_loop(client(second, "plain"), [False] * STEPS)
    assert outputs(replies) == outputs(plain)
    recorded = episode_calls(second.store, "stored", STEPS)
    exact = episode_calls(second.store, "plain", STEPS)
    assert [c["status"] for c in recorded + exact] == ["ok"] * 2 * STEPS, [c["error"] for c in recorded + exact]
    for mine, theirs in zip(recorded, exact, strict=True):
        assert list(mine["prompt_token_ids"]) == list(theirs["prompt_token_ids"])
        assert list(mine["completion_token_ids"]) == list(theirs["completion_token_ids"])
    other = client(second, "another-episode")  # the walls hold after the restart too
    with pytest.raises(openai.NotFoundError):
        create(other, False, input=[{"role": "user", "content": "hi"}], previous_response_id=replies[0].id)
