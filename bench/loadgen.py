"""A small asyncio HTTP/1.1 load generator (keep-alive, raw sockets) so the client costs little next to the proxy."""

import asyncio
import json
import statistics
import time
from dataclasses import dataclass


@dataclass
class Result:
    latencies_ms: list[float]
    ttft_ms: list[float]
    seconds: float
    errors: int

    @property
    def calls_per_s(self) -> float:
        return len(self.latencies_ms) / self.seconds if self.seconds else 0.0

    def pct(self, values: list[float], q: float) -> float:
        if not values:
            return float("nan")
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    def summary(self) -> dict[str, float]:
        return {
            "p50_ms": statistics.median(self.latencies_ms) if self.latencies_ms else float("nan"),
            "p99_ms": self.pct(self.latencies_ms, 0.99),
            "ttft_p50_ms": statistics.median(self.ttft_ms) if self.ttft_ms else float("nan"),
            "calls_per_s": self.calls_per_s,
            "errors": self.errors,
        }


def request_bytes(host: str, body: dict, headers: dict[str, str] | None = None) -> bytes:
    data = json.dumps(body).encode()
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(data)}\r\n{extra}\r\n"
    )
    return head.encode() + data


async def read_response(reader: asyncio.StreamReader, started: float) -> tuple[int, float]:
    """Read one response; (status, time to the first body byte in ms)."""
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    lowered = head.lower()
    first_byte: float | None = None
    if b"transfer-encoding: chunked" in lowered:
        while True:
            size_line = await reader.readuntil(b"\r\n")
            size = int(size_line.strip().split(b";")[0], 16)
            if first_byte is None and size:
                first_byte = time.perf_counter()
            await reader.readexactly(size + 2)
            if size == 0:
                break
    else:
        length = 0
        for line in lowered.split(b"\r\n"):
            if line.startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        first_byte = time.perf_counter()
        await reader.readexactly(length)
    return status, ((first_byte or time.perf_counter()) - started) * 1000


async def _worker(host: str, port: int, payload: bytes, count: list[int], result: Result) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        while count[0] > 0:
            count[0] -= 1
            started = time.perf_counter()
            writer.write(payload)
            status, ttft = await read_response(reader, started)
            if status != 200:
                result.errors += 1
                continue
            result.latencies_ms.append((time.perf_counter() - started) * 1000)
            result.ttft_ms.append(ttft)
    finally:
        writer.close()


async def run(port: int, concurrency: int, total: int, body: dict, headers: dict[str, str] | None = None) -> Result:
    payload = request_bytes(f"127.0.0.1:{port}", body, headers)
    result = Result([], [], 0.0, 0)
    warm = Result([], [], 0.0, 0)
    await asyncio.gather(*(_worker("127.0.0.1", port, payload, [5], warm) for _ in range(concurrency)))
    count = [total]
    started = time.perf_counter()
    await asyncio.gather(*(_worker("127.0.0.1", port, payload, count, result) for _ in range(concurrency)))
    result.seconds = time.perf_counter() - started
    return result
