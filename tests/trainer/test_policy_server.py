"""The real vLLM server (CPU build) with SmolLM2-135M-Instruct: the token-level behaviour OpenForge relies on.

Nothing here hard-codes generated text (greedy output changes with dtype); the checks compare the server with
itself and with the prepared tokenizer.
"""

import json
import math
from pathlib import Path

import httpx
import pytest

from tests.support.policy_server import TOOL_PROMPT, WEATHER_TOOL
from trainer.serve import PolicyServer

pytestmark = pytest.mark.integration

QUESTION = [{"role": "user", "content": "Name three colours of the rainbow."}]
# A 9.4k-token prefill on one CPU core: 125 s in fp32, 384 s in emulated bf16 (measured on this machine).
LONG_PREFILL_TIMEOUT_S = 900.0


def chat(vllm: httpx.Client, server: PolicyServer, **body) -> dict:
    answer = vllm.post("/v1/chat/completions", json={"model": server.name, "temperature": 0, **body})
    assert answer.status_code == 200, answer.text
    return answer.json()


def sse_events(vllm: httpx.Client, path: str, body: dict) -> list[dict]:
    events = []
    with vllm.stream("POST", path, json=body) as answer:
        assert answer.status_code == 200
        for line in answer.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: ") :]))
    return events


def test_chat_returns_the_sampled_ids_their_text_and_one_logprob_each(vllm, policy_server, tokenizer):
    reply = chat(vllm, policy_server, messages=QUESTION, max_tokens=24, return_token_ids=True, logprobs=True)
    choice = reply["choices"][0]
    ids = choice["token_ids"]
    assert ids and all(isinstance(i, int) for i in ids)
    assert reply["prompt_token_ids"] == tokenizer.apply_chat_template(
        QUESTION, add_generation_prompt=True, return_dict=False
    )
    # The ids are the sampled tokens: decoding them gives exactly the text the client received.
    assert tokenizer.decode(ids, skip_special_tokens=True) == choice["message"]["content"]
    assert len(choice["logprobs"]["content"]) == len(ids)
    assert all(entry["logprob"] <= 0.0 for entry in choice["logprobs"]["content"])
    assert reply["usage"]["completion_tokens"] == len(ids)


def test_streamed_ids_add_up_to_the_non_streamed_ids(vllm, policy_server):
    body = {"model": policy_server.name, "messages": QUESTION, "max_tokens": 24, "temperature": 0,
            "return_token_ids": True, "logprobs": True}  # fmt: skip
    whole = chat(vllm, policy_server, **{k: v for k, v in body.items() if k != "model"})
    events = sse_events(vllm, "/v1/chat/completions", {**body, "stream": True})
    streamed_ids: list[int] = []
    streamed_logprobs: list[dict] = []
    text = ""
    for event in events:
        for choice in event["choices"]:
            streamed_ids += choice.get("token_ids") or []
            streamed_logprobs += (choice.get("logprobs") or {}).get("content") or []
            text += choice["delta"].get("content") or ""
    assert events[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    assert streamed_ids == whole["choices"][0]["token_ids"]
    assert len(streamed_logprobs) == len(streamed_ids)
    assert text == whole["choices"][0]["message"]["content"]


def test_completions_take_a_token_id_prompt(vllm, policy_server, tokenizer):
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, return_dict=False)
    answer = vllm.post("/v1/completions", json={
        "model": policy_server.name, "prompt": prompt, "max_tokens": 16, "temperature": 0,
        "return_token_ids": True, "logprobs": 0,
    })  # fmt: skip
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    assert choice["prompt_token_ids"] == prompt
    assert choice["token_ids"] and len(choice["logprobs"]["token_logprobs"]) == len(choice["token_ids"])
    assert tokenizer.decode(choice["token_ids"], skip_special_tokens=True) == choice["text"]
    # The same prompt as chat gives the same greedy tokens: token prompts are not re-tokenized.
    as_chat = chat(vllm, policy_server, messages=QUESTION, max_tokens=16, return_token_ids=True)
    assert as_chat["choices"][0]["token_ids"][:16] == choice["token_ids"]


def test_a_tool_call_is_parsed_by_the_hermes_parser(vllm, policy_server, tokenizer):
    reply = chat(vllm, policy_server, messages=TOOL_PROMPT, tools=[WEATHER_TOOL], max_tokens=60,
                 return_token_ids=True)  # fmt: skip
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert set(json.loads(call["function"]["arguments"])) == {"city"}
    # The sampled ids still hold the raw tool-call text the parser read.
    raw = tokenizer.decode(choice["token_ids"], skip_special_tokens=True)
    assert "<tool_call>" in raw and "get_weather" in raw


def test_reload_weights_from_the_served_checkpoint_keeps_serving(vllm, policy_server):
    before = chat(vllm, policy_server, messages=QUESTION, max_tokens=8, return_token_ids=True)
    answer = vllm.post("/collective_rpc", json={
        "method": "reload_weights", "kwargs": {"weights_path": str(policy_server.model)},
    })  # fmt: skip
    assert answer.status_code == 200, answer.text
    version = vllm.post("/update_weight_version", json={"new_version": "7"})
    assert version.status_code == 200, version.text
    assert vllm.get("/weight_info").json()["weight_version"] == "7"
    after = chat(vllm, policy_server, messages=QUESTION, max_tokens=8, return_token_ids=True)
    # Same weights reloaded: the greedy tokens are unchanged.
    assert after["choices"][0]["token_ids"] == before["choices"][0]["token_ids"]


@pytest.fixture(scope="module")
def lora_adapter(prepared_model, tmp_path_factory) -> Path:
    """A rank-8 LoRA adapter with random (non-zero) weights, so it visibly changes the model."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(prepared_model.train_dir, local_files_only=True)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    out = tmp_path_factory.mktemp("lora") / "adapter"
    get_peft_model(base, config).save_pretrained(out)
    return out


def test_a_lora_adapter_loads_serves_and_unloads(vllm, policy_server, lora_adapter):
    body = {"messages": QUESTION, "max_tokens": 8, "return_token_ids": True, "logprobs": True}
    base = chat(vllm, policy_server, **body)
    loaded = vllm.post("/v1/load_lora_adapter", json={"lora_name": "policy-lora", "lora_path": str(lora_adapter)})
    assert loaded.status_code == 200, loaded.text
    with_lora = vllm.post("/v1/chat/completions", json={"model": "policy-lora", "temperature": 0, **body})
    assert with_lora.status_code == 200, with_lora.text
    first_logprob = [r["choices"][0]["logprobs"]["content"][0]["logprob"] for r in (base, with_lora.json())]
    assert first_logprob[0] != first_logprob[1], "the adapter did not change the model"
    reloaded = vllm.post("/v1/load_lora_adapter", json={
        "lora_name": "policy-lora", "lora_path": str(lora_adapter), "load_inplace": True,
    })  # fmt: skip
    assert reloaded.status_code == 200, reloaded.text
    unloaded = vllm.post("/v1/unload_lora_adapter", json={"lora_name": "policy-lora"})
    assert unloaded.status_code == 200, unloaded.text
    gone = vllm.post("/v1/chat/completions", json={"model": "policy-lora", **body})
    assert gone.status_code == 404


def test_a_prompt_past_the_native_context_leaves_the_server_sound(vllm, policy_server):
    """Harness prompts (Claude Code: ~9k tokens) run past SmolLM2's 8192; the server must answer them and every
    later call must keep finite logprobs (an undersized rotary table once turned them all to -inf)."""

    def short_logprobs() -> list[float]:
        body = {"model": policy_server.name, "prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0,
                "logprobs": 0}  # fmt: skip
        answer = vllm.post("/v1/completions", json=body)
        assert answer.status_code == 200, answer.text  # vLLM refuses to serialise -inf: a 400 here
        return answer.json()["choices"][0]["logprobs"]["token_logprobs"]

    before = short_logprobs()
    long = vllm.post("/v1/completions", timeout=LONG_PREFILL_TIMEOUT_S, json={
        "model": policy_server.name, "prompt": [1] + [253, 5356] * 4700, "max_tokens": 2, "logprobs": 0,
    })  # fmt: skip
    assert long.status_code == 200, long.text
    assert long.json()["usage"]["prompt_tokens"] > 9000
    assert all(math.isfinite(x) for x in long.json()["choices"][0]["logprobs"]["token_logprobs"])
    assert short_logprobs() == pytest.approx(before, abs=1e-3)
