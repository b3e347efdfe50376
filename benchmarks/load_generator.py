"""A cheap HTTP/1.1 load generator, run as its own process by `api.py`: open loop or flat out.

It shares the machine's cores with the server it measures, so it does as little as it can: one
request's bytes are built once and written as they are, over keep-alive connections opened before
the clock starts (reopened only when the server closes one); an answer is read as its status line,
its headers up to `content-length` and that many body bytes, never parsed further. No HTTP client
library, no JSON.

- open loop: request `i` is due at `start + i / rate` whether or not earlier ones have answered; it
  goes out on the first idle connection (waiting for one if all `--connections` are busy), and its
  latency is counted from the time it was due, so a server that falls behind cannot hide its queue;
- flat out: each connection sends its next request as soon as the last one answered.

Prints one JSON object: the latencies (s), the status counts (0: no answer within the timeout, or
the connection failed), the ids 201 answers named (`"id": N` found in the body, nothing parsed),
the elapsed time and this process's own CPU time, so the caller can say what the generator itself
cost.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections import Counter
from urllib.parse import urlsplit


class Connection:
    """One keep-alive connection; `exchange` sends the request and reads one whole answer."""

    def __init__(self, host: str, port: int, request: bytes, timeout_s: float) -> None:
        self.host, self.port, self.request, self.timeout_s = host, port, request, timeout_s
        self.created: list[int] = []
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None

    async def exchange(self) -> int:
        """The answer's status code; 0 when none came within the timeout or the connection broke.
        A 201's `"id"` is kept in `created` (the caller checks the store has every one)."""
        try:
            async with asyncio.timeout(self.timeout_s):  # no extra task per request, as wait_for makes
                return await self._exchange()
        except (TimeoutError, OSError, asyncio.IncompleteReadError, ValueError):
            self.close()  # a half-read answer would desynchronise the next one
            return 0

    async def _exchange(self) -> int:
        if self.writer is None:
            await self.open()
        assert self.reader is not None and self.writer is not None
        self.writer.write(self.request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        length = 0
        keep_alive = True
        for line in head.lower().split(b"\r\n")[1:]:
            if line.startswith(b"content-length:"):
                length = int(line[15:])
            elif line.startswith(b"connection:") and b"close" in line:
                keep_alive = False
        body = await self.reader.readexactly(length) if length else b""
        if status == 201:
            start = body.find(b'"id":') + 5
            self.created.append(int(body[start : body.index(b",", start)]))
        if not keep_alive:
            self.close()
        return status


def request_bytes(url: str, body: bytes, headers: list[str]) -> tuple[str, int, bytes]:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    lines = [
        f"POST {parts.path or '/'} HTTP/1.1",
        f"Host: {host}:{port}",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        *headers,
    ]
    return host, port, ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


async def open_loop(
    connections: list[Connection], rate: float, seconds: float
) -> tuple[list[float], Counter[int]]:
    latencies: list[float] = []
    statuses: Counter[int] = Counter()
    idle: asyncio.Queue[Connection] = asyncio.Queue()
    for connection in connections:
        idle.put_nowait(connection)
    start = time.perf_counter() + 0.05

    async def one(due: float) -> None:
        connection = await idle.get()
        status = await connection.exchange()
        idle.put_nowait(connection)
        latencies.append(time.perf_counter() - due)
        statuses[status] += 1

    tasks = []
    for index in range(int(rate * seconds)):
        due = start + index / rate
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(due)))
    await asyncio.gather(*tasks)
    return latencies, statuses


async def flat_out(connections: list[Connection], seconds: float) -> tuple[list[float], Counter[int]]:
    latencies: list[float] = []
    statuses: Counter[int] = Counter()
    deadline = time.perf_counter() + seconds

    async def client(connection: Connection) -> None:
        while time.perf_counter() < deadline:
            sent = time.perf_counter()
            statuses[await connection.exchange()] += 1
            latencies.append(time.perf_counter() - sent)

    await asyncio.gather(*(client(connection) for connection in connections))
    return latencies, statuses


async def generate(args: argparse.Namespace) -> dict[str, object]:
    host, port, request = request_bytes(args.url, args.body.encode(), args.header)
    connections = [Connection(host, port, request, args.timeout) for _ in range(args.connections)]
    for connection in connections:
        with contextlib.suppress(OSError):
            await connection.open()
    cpu, started = time.process_time(), time.perf_counter()
    if args.rate:
        latencies, statuses = await open_loop(connections, args.rate, args.seconds)
    else:
        latencies, statuses = await flat_out(connections, args.seconds)
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    for connection in connections:
        connection.close()
    return {
        "latencies": latencies,
        "statuses": dict(statuses),
        "elapsed": elapsed,
        "cpu_s": cpu,
        "created": sorted(i for connection in connections for i in connection.created),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("url")
    parser.add_argument("--body", required=True, help="the JSON body every request sends")
    parser.add_argument("--header", action="append", default=[], help="an extra header line (repeatable)")
    parser.add_argument("--rate", type=float, default=0.0, help="requests per second offered; 0: flat out")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--connections", type=int, default=64, help="the most requests in flight at once")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds an answer may take")
    args = parser.parse_args()
    json.dump(asyncio.run(generate(args)), sys.stdout)


if __name__ == "__main__":
    main()
