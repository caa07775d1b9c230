"""Unmodified clients for the transparent-mode tests: no proxy settings, no base URL, only the CA trust env.

Run (as another uid, in the pod namespace): python transparent_clients.py CLIENT CONTENT OTHER_URL
CLIENT is requests | httpx-h2 | openai-sdk. Prints one JSON line: the model's reply text, the HTTP version
of the model call, and the non-model site's answer.
"""

import json
import sys

MODEL_URL = "https://api.openai.com/v1/chat/completions"


def body(content: str) -> dict:
    return {"model": "gpt-4o", "messages": [{"role": "user", "content": content}], "max_tokens": 8, "temperature": 0}


def main() -> None:
    client, content, other_url = sys.argv[1:]
    headers = {"authorization": "Bearer sk-transparent-test-key"}
    version = None
    if client == "requests":
        import requests

        reply = requests.post(MODEL_URL, json=body(content), headers=headers, timeout=60)
        reply.raise_for_status()
        text = reply.json()["choices"][0]["message"]["content"]
        other = requests.get(other_url, timeout=30).json()
    elif client == "httpx-h2":
        import httpx

        with httpx.Client(http2=True, timeout=60) as http:  # offers ALPN "http/1.1" first, then "h2"
            answer = http.post(MODEL_URL, json=body(content), headers=headers)
            answer.raise_for_status()
            text, version = answer.json()["choices"][0]["message"]["content"], answer.http_version
            other = http.get(other_url).json()  # the site speaks HTTP/1.1 only
    elif client == "openai-sdk":
        import httpx
        import openai

        sdk = openai.OpenAI(api_key="sk-transparent-test-key", max_retries=0, timeout=60)
        completion = sdk.chat.completions.create(**body(content))
        text = completion.choices[0].message.content
        other = httpx.get(other_url, timeout=30).json()
    else:
        raise SystemExit(f"unknown client {client}")
    print(json.dumps({"text": text, "http_version": version, "other": other}))


if __name__ == "__main__":
    main()
