"""What the tests that talk to the real vLLM server share: its start-up bound and a tool-calling prompt."""

VLLM_START_TIMEOUT_S = 300.0

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
