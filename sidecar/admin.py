"""The sidecar's admin endpoint, on loopback only: ``POST /reward``, ``GET /metrics``, ``GET /healthz``."""

import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from sidecar.metrics import Metrics
from sidecar.writer import RecordWriter, now_us


class RewardError(ValueError):
    pass


def reward_row(payload: Any, source: str) -> dict[str, Any]:
    """A reward record from a JSON payload; RewardError says what is wrong with it."""
    if not isinstance(payload, dict):
        raise RewardError("the body must be a JSON object")
    episode = payload.get("episode_id")
    if not isinstance(episode, str) or not episode:
        raise RewardError("episode_id (a non-empty string) is required")
    value = payload.get("reward")
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise RewardError("reward (a finite number) is required")
    components = payload.get("components") or {}
    if not isinstance(components, dict) or not all(
        isinstance(k, str) and isinstance(v, int | float) and not isinstance(v, bool) for k, v in components.items()
    ):
        raise RewardError("components must map names to numbers")
    call_id = payload.get("call_id")
    if call_id is not None and not isinstance(call_id, str):
        raise RewardError("call_id must be a string")
    return {
        "episode_id": episode, "call_id": call_id, "reward": float(value),
        "components": {k: float(v) for k, v in components.items()}, "source": str(payload.get("source") or source),
        "at": now_us(),
    }  # fmt: skip


class AdminServer:
    def __init__(self, address: tuple[str, int], writer: RecordWriter, metrics: Metrics) -> None:
        admin = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # no access log: bodies and headers stay out of logs
                pass

            def reply(self, code: int, body: str, content_type: str = "application/json") -> None:
                data = body.encode()
                self.send_response(code)
                self.send_header("content-type", content_type)
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path == "/metrics":
                    self.reply(200, metrics.render(), "text/plain; version=0.0.4")
                elif self.path == "/healthz":
                    self.reply(200, json.dumps({"ok": True}))
                else:
                    self.reply(404, json.dumps({"error": f"no such endpoint: GET {self.path}"}))

            def do_POST(self) -> None:
                if self.path != "/reward":
                    self.reply(404, json.dumps({"error": f"no such endpoint: POST {self.path}"}))
                    return
                try:
                    length = int(self.headers.get("content-length") or 0)
                    if length > 1 << 20:
                        raise RewardError("body too large")
                    row = reward_row(json.loads(self.rfile.read(length) or b"null"), source="admin")
                except (RewardError, ValueError) as error:
                    self.reply(400, json.dumps({"error": str(error)}))
                    return
                if not admin.writer.append("rewards", row):
                    self.reply(503, json.dumps({"error": "the write-ahead log is full; reward not recorded"}))
                    return
                self.reply(200, json.dumps({"ok": True}))

        self.writer = writer
        self.server = ThreadingHTTPServer(address, Handler)
        self.server.daemon_threads = True

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    def start(self) -> "AdminServer":
        threading.Thread(target=self.server.serve_forever, name="forge-admin", daemon=True).start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
