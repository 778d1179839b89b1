"""HTTP load with a ledger: every heartbeat sent, and which ones were answered 201.

Runs as its own process (`python -m tests.faults.loadgen ...`) so the service processes under test
share nothing with it but the network. Keys are (lesson, user); in round r every key sends
position(key, r). Rounds are sequential, so a key's heartbeats arrive in round order, and each
position is unique to its round: the final row tells which heartbeat it holds. SIGTERM ends the load
after the round in hand; the ledger says how many rounds were sent.
"""

import argparse
import asyncio
import json
import random
import signal
import statistics
import time
from dataclasses import dataclass, field

from service.auth import make_token
from service.config import Settings

DURATION_S = 1000  # every seeded lesson; completion from 990 s with the default margin
PATH = b"/engagements/progress/lesson"


def position(key: tuple[int, int], round_: int, *, crossing: bool, crossing_round: int) -> float:
    """Below the margin, except crossing keys from crossing_round on: at the end, then rewinds and ends again."""
    tag = round_ / 1000  # makes each round's position unique
    if not crossing or round_ < crossing_round:
        return round_ * 40 + tag
    if round_ == crossing_round or (round_ + key[1]) % 2:
        return 995 + tag
    return 100 + tag


@dataclass(frozen=True, slots=True)
class Answer:
    status: int  # 0: no answer (refused, reset, timed out): not acknowledged
    headers: dict[bytes, bytes] = field(default_factory=dict)  # names lower-cased
    body: bytes = b""


class Client:
    """A keep-alive HTTP/1.1 connection per port; reconnects after any error, or after a `Connection: close`."""

    def __init__(self, ports: list[int], timeout_s: float = 10.0) -> None:
        self.ports = ports
        self.timeout_s = timeout_s
        self.streams: dict[int, tuple[asyncio.StreamReader, asyncio.StreamWriter]] = {}

    async def request(self, port: int, method: bytes, path: bytes, token: str, body: bytes = b"") -> Answer:
        """One request and its answer. A kept-alive connection the server closed while it was idle (no byte of an
        answer) is replaced and the request sent again on a new one, as HTTP clients do."""
        for attempt in (1, 2):
            if port in self.streams and self.streams[port][1].is_closing():
                self._drop(port)  # the server closed it while it was idle: a new one, as HTTP clients do
            reused = port in self.streams
            try:
                if not reused:
                    self.streams[port] = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 2)
                reader, writer = self.streams[port]
                writer.write(
                    method
                    + b" "
                    + path
                    + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
                    + token.encode()
                    + b"\r\nContent-Type: application/json\r\nContent-Length: "
                    + str(len(body)).encode()
                    + b"\r\n\r\n"
                    + body
                )
                async with asyncio.timeout(self.timeout_s):
                    status_line = await reader.readline()
                    if not status_line and reused and attempt == 1:
                        self._drop(port)
                        continue
                    status = int(status_line.split()[1])
                    headers = {}
                    while (line := await reader.readline()) not in (b"\r\n", b""):
                        name, _, value = line.partition(b":")
                        headers[name.strip().lower()] = value.strip()
                    answer = Answer(status, headers, await reader.readexactly(int(headers.get(b"content-length", 0))))
                if headers.get(b"connection") == b"close":
                    self._drop(port)
                return answer
            # RuntimeError: uvloop's write on a transport the peer closed under it
            except (OSError, TimeoutError, IndexError, ValueError, RuntimeError, asyncio.IncompleteReadError):
                self._drop(port)
                return Answer(0)
        return Answer(0)

    def _drop(self, port: int) -> None:
        dropped = self.streams.pop(port, None)
        if dropped is not None:
            dropped[1].close()


async def run(args: argparse.Namespace) -> dict[str, object]:
    keys = [(lesson, user) for user in range(1, args.users + 1) for lesson in range(1, args.lessons + 1)]
    crossing = set(random.Random(7).sample(keys, min(args.crossing, len(keys))))
    signer = Settings(jwt_secret=args.secret)
    tokens = {user: make_token(signer, user, ttl_s=3600) for user in range(1, args.users + 1)}
    ports = [int(p) for p in args.ports.split(",")]
    last_acked: dict[tuple[int, int], int] = {}
    counts = {"sent": 0, "acknowledged": 0, "refused_503": 0, "no_answer": 0, "other": 0}
    latencies_ms: list[float] = []
    started = time.monotonic()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)

    async def worker(queue: asyncio.Queue[tuple[tuple[int, int], int, int]]) -> None:
        client = Client(ports)
        while True:
            key, round_, i = await queue.get()
            body = json.dumps(
                {
                    "lesson_id": key[0],
                    "position": position(key, round_, crossing=key in crossing, crossing_round=args.crossing_round),
                }
            ).encode()
            sent_at = time.perf_counter()
            status = (await client.request(ports[i % len(ports)], b"POST", PATH, tokens[key[1]], body)).status
            latencies_ms.append((time.perf_counter() - sent_at) * 1000)
            counts["sent"] += 1
            if status == 201:
                counts["acknowledged"] += 1
                last_acked[key] = round_
            elif status == 503:
                counts["refused_503"] += 1
            elif status == 0:
                counts["no_answer"] += 1
            else:
                counts["other"] += 1
            queue.task_done()

    queue: asyncio.Queue[tuple[tuple[int, int], int, int]] = asyncio.Queue()
    workers = [asyncio.create_task(worker(queue)) for _ in range(args.connections)]
    i = rounds = 0
    for round_ in range(args.rounds):
        if stop.is_set():
            break
        rounds += 1
        round_started = time.monotonic()
        # the crossing keys go first and together, spread over every process
        for key in sorted(keys, key=lambda k: k not in crossing):
            queue.put_nowait((key, round_, i))
            i += 1
        await queue.join()
        await asyncio.sleep(max(0.0, args.min_round_s - (time.monotonic() - round_started)))
        print(json.dumps({"round": round_, "elapsed_s": round(time.monotonic() - started, 1), **counts}), flush=True)
    for task in workers:
        task.cancel()
    latencies_ms.sort()
    return {
        **counts,
        "rounds": rounds,
        "elapsed_s": round(time.monotonic() - started, 1),
        "latency_ms": {
            "p50": round(statistics.median(latencies_ms), 2),
            "p99": round(latencies_ms[int(len(latencies_ms) * 0.99)], 2),
            "max": round(latencies_ms[-1], 2),
        },
        "crossing": sorted(crossing),
        "last_acked": [[k[0], k[1], r] for k, r in last_acked.items()],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ports", required=True)
    parser.add_argument("--users", type=int, required=True)
    parser.add_argument("--lessons", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--crossing", type=int, default=500)
    parser.add_argument("--crossing-round", type=int, default=10)
    parser.add_argument("--connections", type=int, default=48)
    parser.add_argument("--min-round-s", type=float, default=0.0)
    parser.add_argument("--secret", required=True)
    parser.add_argument("--ledger", required=True)
    args = parser.parse_args()
    result = asyncio.run(run(args))
    with open(args.ledger, "w") as out:
        json.dump(result, out)


if __name__ == "__main__":
    main()
