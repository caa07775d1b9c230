"""Records written by the real sidecar (mitmproxy) from the real vLLM, for a linear chat driven by the openai SDK,
assemble into one segment: the last prompt + completion, with the mask exactly on the ids vLLM sampled."""

import itertools

import openai
import pytest

from collector.collect import collect
from tests.support.sidecar import read_calls, wait_for

pytestmark = pytest.mark.integration

QUESTIONS = ["Name a colour.", "Name another one.", "And a third?", "Which of them is the darkest?"]


def test_a_linear_chat_through_the_sidecar_is_one_segment_masked_on_the_sampled_ids(
    start_sidecar,
    policy_server,
    tmp_path,
):
    sidecar = start_sidecar(policy_server.base_url, episode_id="chat-1", extra=("--task-id", "colours"))
    sdk = openai.OpenAI(base_url=f"{sidecar.url}/v1", api_key="sk-test", max_retries=0, timeout=120)
    messages: list[dict] = [{"role": "system", "content": "You are terse."}]
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        reply = sdk.chat.completions.create(model="gpt-4o", messages=messages, max_tokens=24, temperature=0)  # type: ignore[arg-type]
        messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})

    def all_recorded() -> list[dict] | None:
        calls = read_calls(sidecar.store)
        return calls if len(calls) == len(QUESTIONS) else None

    calls = wait_for(all_recorded, what="four call records")
    assert [c["status"] for c in calls] == ["ok"] * len(QUESTIONS)
    # The sidecar's references say each prompt extends the whole previous sequence: the no-comparison path.
    for previous, call in itertools.pairwise(calls):
        assert call["parent_call_id"] == previous["call_id"]
        assert call["prefix_len"] == previous["prompt_len"] + len(previous["completion_token_ids"])

    collection = collect(sidecar.store, state_dir=tmp_path / "state")
    (segment,) = collection.segments.to_pylist()
    last = calls[-1]
    assert segment["input_ids"] == last["prompt_token_ids"] + last["completion_token_ids"]
    expected_mask = [0] * len(segment["input_ids"])
    expected_logprobs = [0.0] * len(segment["input_ids"])
    for call in calls:
        start = call["prompt_len"]
        for offset, (token, logprob) in enumerate(zip(call["completion_token_ids"], call["completion_logprobs"],
                                                      strict=True)):  # fmt: skip
            assert segment["input_ids"][start + offset] == token
            expected_mask[start + offset] = 1
            expected_logprobs[start + offset] = logprob
    assert segment["loss_mask"] == expected_mask
    assert segment["behaviour_logprobs"] == pytest.approx(expected_logprobs)
    assert segment["call_ids"] == [c["call_id"] for c in calls] and segment["fork_reason"] == "start"
    (episode,) = collection.episodes.to_pylist()
    assert (episode["episode_id"], episode["task_id"], episode["n_merged"], episode["n_segments"]) == (
        "chat-1", "colours", len(QUESTIONS) - 1, 1,
    )  # fmt: skip
    assert episode["status"] == "unfinished"  # no reward yet, and just now
    assert episode["harness"] == "openai-python"
