"""Counters and gauges the sidecar exposes on its admin endpoint, in Prometheus' text format."""

import threading


class Metrics:
    def __init__(self) -> None:
        self._values: dict[str, float] = {}
        self._lock = threading.Lock()

    def inc(self, name: str, by: float = 1) -> None:
        with self._lock:
            self._values[name] = self._values.get(name, 0) + by

    def set(self, name: str, value: float) -> None:
        with self._lock:
            self._values[name] = value

    def remove(self, name: str) -> None:
        """Forget a series (a gauge of something that is gone)."""
        with self._lock:
            self._values.pop(name, None)

    def get(self, name: str) -> float:
        return self._values.get(name, 0)

    def render(self) -> str:
        with self._lock:
            items = sorted(self._values.items())
        return "".join(f"forge_sidecar_{name} {value:g}\n" for name, value in items)
