"""What the tests that talk to the real vLLM server share: how one is started and a tool-calling prompt."""

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from forge.errors import ForgeError
from trainer.serve import PolicyServer, default_checkpoint, free_port

VLLM_START_TIMEOUT_S = 300.0


@contextmanager
def started_policy_server(run_dir: Path, max_model_len: int, what: str = "the vLLM server") -> Iterator[PolicyServer]:
    """A real vLLM (CPU build) server with SmolLM2-135M-Instruct on a free loopback port, as `forge serve` starts
    it, stopped at the end; one that does not start fails the test, with its log."""
    server = PolicyServer(
        model=default_checkpoint(), port=free_port(), max_model_len=max_model_len, run_dir=run_dir,
        start_timeout=VLLM_START_TIMEOUT_S,
    )  # fmt: skip
    try:
        server.start()
    except ForgeError as error:
        pytest.fail(f"{what} did not start: {error}")
    try:
        yield server
    finally:
        server.stop()


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}}  # fmt: skip
# SmolLM2's chat template does not render tools, so the prompt spells the tool and the hermes format out.
TOOL_PROMPT = [
    {"role": "system", "content": 'You can call one tool: get_weather(city). To call it, answer with exactly '
     '<tool_call>{"name": "get_weather", "arguments": {"city": CITY}}</tool_call> and nothing else.'},
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant",
     "content": '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'},
    {"role": "tool", "content": "sunny"},
    {"role": "user", "content": "What is the weather in Berlin?"},
]  # fmt: skip
