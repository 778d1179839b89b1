"""The load of the fault runs (tests/faults/suite.py, tests/faults/nemesis.py): users who listen, read, burst, sync
and play rounds through the pods, and the ledger of every request they sent, with its answer and its times.

Runs as its own process (`python -m tests.faults.load ...`), so the pods share nothing with it but the network, and a
busy checker does not slow its clock. Each (content, user) is used by one user only, and its positions are unique: the
row in Postgres, or a read's answer, tells which request it holds. The users:

- steady: one content at a time, a heartbeat every 0.4-1 s to either pod (some to the end, some rewinding after it),
  reading it back now and then, one id or all of them (?ids=); its positions: an integer part that moves as a
  listener's would, plus the request's number on that key / 10,000;
- burst: 40 heartbeats of one content back to back on one connection, far above the app's rhythm: each is
  answered like any heartbeat, and the last one answered 201 must be the one stored;
- sync: every second three of them send 10 offline syncs at once to one pod, each with one item of every type (an app
  back online with its queue): each sync reads every type's tables, so any locked table holds all of them;
- crowd: at given times, each sends one lesson heartbeat (a notification brings thousands to one screen at once):
  a lesson backlog far above a batch, which must not hold the other types;
- rounds (the fault suite's and the fleet's load, alone): every (lesson, user) key of `Rounds` sends `position(key,
  r)` in round r, as fast as `connections` keep-alive connections go; rounds are sequential, so a key's heartbeats
  arrive in round order, and each position is unique to its round. Half way, `crossing` keys cross the completion
  margin together, then rewind and reach the end again. SIGTERM ends the load after the round in hand.

Every action of a user waits for the one before (a storm's ten syncs go together, but name their items' times), so
a key's requests reach the pods in the order they were sent, and a sync item is ordered by its `listened_at`.
"""

import argparse
import asyncio
import itertools
import json
import random
import signal
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime

import uvloop

from service.auth import make_token
from service.config import Settings
from service.progress.content import CONTENT_KINDS

DURATION_S = 1000  # every seeded lesson; completion from 990 s with the default margin


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


KIND = {kind.name: kind for kind in CONTENT_KINDS}
STEADY_WEIGHTS = (4, 2, 2, 2)  # lessons are the common case
COMPLETES_AT = DURATION_S - 5  # above duration - the 10 s margin: completes
STORM_SYNCS = 10
# with 18 sync users each storms every 6 s: 10 syncs at once against SYNC_CONNECTIONS (2) per process, the rest shed
# as 503 with Retry-After
STORMERS = 3


@dataclass(frozen=True)
class Rounds:
    """The rounds role: every (lesson, user) key sends once a round (module docstring)."""

    users: int
    lessons: int
    rounds: int
    crossing: int  # keys that cross the margin together in crossing_round
    crossing_round: int
    min_round_s: float = 0.0
    connections: int = 48


@dataclass(frozen=True)
class Load:
    seconds: float
    contents: int  # ids 1..contents of every type
    steady_users: int
    burst_users: int
    sync_users: int  # STORMERS of them storm every second, in turn
    crowd_users: int  # each sends one lesson heartbeat within crowd_spread_s of each crowd_at_s
    crowd_at_s: tuple[float, ...]
    crowd_spread_s: float = 2.0
    burst_length: int = 40
    client_timeout_s: float = 15.0  # far above every bound: a request this slow has failed its bound anyway
    rounds: Rounds | None = None  # the rounds role, alone: every other role's count is 0

    @property
    def users(self) -> int:
        rounds = self.rounds.users if self.rounds else 0
        return self.steady_users + self.burst_users + self.sync_users + self.crowd_users + rounds

    def ids(self, role: str) -> range:
        """The user ids of a role: steady, burst, sync, crowd, in that order from 1."""
        first = 1
        for name, count in (
            ("steady", self.steady_users),
            ("burst", self.burst_users),
            ("sync", self.sync_users),
            ("crowd", self.crowd_users),
            ("rounds", self.rounds.users if self.rounds else 0),
        ):
            if name == role:
                return range(first, first + count)
            first += count
        raise ValueError(role)


Key = tuple[str, int, int]  # content type, content id, user id


class Ledger:
    """Every request as it went: one dict each, in the order they were answered."""

    def __init__(self) -> None:
        self.requests: list[dict[str, object]] = []
        self._seq: dict[Key, int] = {}
        self._base: dict[Key, int] = {}

    def position(self, key: Key, rng: random.Random, step: str) -> float:
        """The key's next position: `play` moves on, `end` reaches the completion, `rewind` goes back."""
        base = self._base.get(key, 0)
        if step == "end":
            base = COMPLETES_AT
        elif step == "rewind":
            base = 100
        else:
            base = min(base + rng.randint(5, 40), COMPLETES_AT - 20)
        self._base[key] = base
        seq = self._seq.get(key, 0) + 1
        self._seq[key] = seq
        assert seq < 10_000, f"{key}: too many requests to tell them apart"
        return base + seq / 10_000

    def add(self, request: dict[str, object], t0: float, answer: Answer, pod: int) -> Answer:
        request.update(t0=t0, t1=time.time(), status=answer.status, pod=pod)
        request["retry_after"] = b"retry-after" in answer.headers
        self.requests.append(request)
        return answer


class Users:
    def __init__(self, load: Load, ports: list[int], secret: str, seed: int) -> None:
        self.load = load
        self.ports = ports
        self.seed = seed
        self.ledger = Ledger()
        signer = Settings(jwt_secret=secret)
        self.tokens = {user: make_token(signer, user, ttl_s=3600) for user in range(1, load.users + 1)}
        self.started = time.monotonic()
        self._out_until = [0.0] * len(ports)
        self.stopped = False  # SIGTERM, or the rounds are over
        self.rounds_sent = 0
        self.crossing: set[tuple[int, int]] = set()

    def pod(self, preferred: int) -> int:
        """A load balancer's passive check: a pod that did not answer gets nothing for a second (nginx's max_fails=1,
        fail_timeout=1s), unless no pod is left."""
        now = time.monotonic()
        if self._out_until[preferred] <= now:
            return preferred
        return next((pod for pod, until in enumerate(self._out_until) if until <= now), preferred)

    def add(self, request: dict[str, object], t0: float, answer: Answer, pod: int) -> Answer:
        if answer.status == 0:
            self._out_until[pod] = time.monotonic() + 1.0
        return self.ledger.add(request, t0, answer, pod)

    def running(self) -> bool:
        return not self.stopped and time.monotonic() - self.started < self.load.seconds

    def client(self) -> Client:
        return Client(self.ports, self.load.client_timeout_s)

    def rng(self, user: int) -> random.Random:
        return random.Random(self.seed * 1_000_003 + user)

    async def heartbeat(
        self, client: Client, key: Key, pod: int, role: str, position: float, **extra: object
    ) -> Answer:
        kind = KIND[key[0]]
        body = json.dumps({kind.id_column: key[1], "position": position}).encode()
        t0 = time.time()
        answer = await client.request(self.ports[pod], b"POST", kind.path.encode(), self.tokens[key[2]], body)
        request = {"op": "heartbeat", "key": key, "position": position, "role": role, **extra}
        return self.add(request, t0, answer, pod)

    async def read(self, client: Client, user: int, content_type: str, ids: list[int], pod: int) -> None:
        one = len(ids) == 1
        path = (
            f"/progress/{content_type}/{ids[0]}" if one else f"/progress/{content_type}?ids={','.join(map(str, ids))}"
        )
        t0 = time.time()
        answer = await client.request(self.ports[pod], b"GET", path.encode(), self.tokens[user])
        found: dict[int, float] = {}
        if answer.status == 200:
            entries = [json.loads(answer.body)] if one else json.loads(answer.body)["data"]
            found = {entry["content_id"]: entry["position"] for entry in entries}
        request = {"op": "read", "user": user, "content_type": content_type, "ids": ids, "found": list(found.items())}
        self.add(request, t0, answer, pod)

    async def sync(self, client: Client, user: int, items: list[tuple[str, int, float, float]], pod: int) -> None:
        body = json.dumps(
            {
                "items": [
                    {
                        "content_type": content_type,
                        "content_id": content_id,
                        "position": position,
                        "listened_at": datetime.fromtimestamp(listened_at, UTC).isoformat(),
                    }
                    for content_type, content_id, position, listened_at in items
                ]
            }
        ).encode()
        t0 = time.time()
        answer = await client.request(self.ports[pod], b"POST", b"/progress/sync", self.tokens[user], body)
        applied = [item["applied"] for item in json.loads(answer.body)["items"]] if answer.status == 200 else None
        request = {"op": "sync", "user": user, "items": items, "applied": applied}
        self.add(request, t0, answer, pod)

    # --- the users ---

    async def steady(self, user: int) -> None:
        rng, client = self.rng(user), self.client()
        while self.running():
            content_type = rng.choices(list(KIND), STEADY_WEIGHTS)[0]
            key = (content_type, rng.randint(1, self.load.contents), user)
            steps = ["play"] * rng.randint(3, 8)
            if rng.random() < 0.3:
                steps.append("end")
                if rng.random() < 0.3:
                    steps.append("rewind")  # completed_at stays, and no second event
            for step in steps:
                if not self.running():
                    return
                await self.heartbeat(
                    client,
                    key,
                    self.pod(rng.randrange(len(self.ports))),
                    "steady",
                    self.ledger.position(key, rng, step),
                )
                if rng.random() < 0.25:
                    await self.read(client, user, content_type, [key[1]], self.pod(rng.randrange(len(self.ports))))
                elif rng.random() < 0.08:
                    everything = list(range(1, self.load.contents + 1))
                    await self.read(client, user, content_type, everything, self.pod(rng.randrange(len(self.ports))))
                await asyncio.sleep(rng.uniform(0.4, 1.0))

    async def burst(self, user: int) -> None:
        rng, client = self.rng(user), self.client()
        await asyncio.sleep(rng.uniform(0, 3))
        while self.running():
            key = (rng.choice(list(KIND)), rng.randint(1, self.load.contents), user)
            pod = self.pod(rng.randrange(len(self.ports)))  # one connection: one pod takes the whole burst
            ends = rng.random() < 0.4
            answer = Answer(0)
            for i in range(self.load.burst_length):
                step = "end" if ends and i == self.load.burst_length - 1 else "play"
                answer = await self.heartbeat(client, key, pod, "burst", self.ledger.position(key, rng, step))
            retry_after_s = int(answer.headers.get(b"retry-after", b"1"))
            await asyncio.sleep(retry_after_s + rng.uniform(2, 4))

    async def storms(self) -> None:
        """Every second, STORMERS sync users in turn each send STORM_SYNCS syncs at once, all to one pod."""
        if not self.load.sync_users:
            return
        rng = self.rng(0)
        clients = {user: [self.client() for _ in range(STORM_SYNCS)] for user in self.load.ids("sync")}
        users = itertools.cycle(self.load.ids("sync"))
        tick = time.monotonic()
        storms: set[asyncio.Task[None]] = set()
        while self.running():
            pod = self.pod(rng.randrange(len(self.ports)))
            for _ in range(min(STORMERS, self.load.sync_users)):
                user = next(users)
                task = asyncio.create_task(self.storm(clients[user], user, pod, random.Random(rng.random())))
                storms.add(task)
                task.add_done_callback(storms.discard)
            tick += 1.0
            await asyncio.sleep(max(0.0, tick - time.monotonic()))
        await asyncio.gather(*storms)

    async def storm(self, clients: list[Client], user: int, pod: int, rng: random.Random) -> None:
        content_id = rng.randint(1, self.load.contents)
        keys = [(content_type, content_id, user) for content_type in KIND]
        # a storm's items are heard just now: after everything the user's earlier storms said, whenever those ended
        listened_at = time.time() - 0.3
        ends = rng.random() < 0.2
        syncs = []
        for i in range(STORM_SYNCS):
            step = "end" if ends and i == STORM_SYNCS - 1 else "play"
            at = listened_at + i / 1000  # request order is listening order; the pods may receive them in any
            syncs.append([(k[0], k[1], self.ledger.position(k, rng, step), at) for k in keys])
        await asyncio.gather(
            *(self.sync(client, user, items, pod) for client, items in zip(clients, syncs, strict=True))
        )

    async def crowd(self) -> None:
        users = list(self.load.ids("crowd"))
        lanes = 32
        for at_s in self.load.crowd_at_s:
            await asyncio.sleep(max(0.0, self.started + at_s - time.monotonic()))
            if not self.running():
                return
            pause_s = self.load.crowd_spread_s * lanes / max(1, len(users))
            await asyncio.gather(*(self.crowd_lane(users[lane::lanes], pause_s) for lane in range(lanes)))

    async def crowd_lane(self, users: list[int], pause_s: float) -> None:
        client = self.client()
        for user in users:
            rng = self.rng(user)
            key = ("lesson", rng.randint(1, self.load.contents), user)
            pod = self.pod(user % len(self.ports))
            await self.heartbeat(client, key, pod, "crowd", self.ledger.position(key, rng, "play"))
            await asyncio.sleep(pause_s)

    async def rounds(self, spec: Rounds) -> None:
        keys = [(lesson, user) for user in self.load.ids("rounds") for lesson in range(1, spec.lessons + 1)]
        self.crossing = set(random.Random(7).sample(keys, min(spec.crossing, len(keys))))
        queue: asyncio.Queue[tuple[tuple[int, int], int, int]] = asyncio.Queue()

        async def connection() -> None:
            client = self.client()
            while True:
                key, round_, i = await queue.get()
                crossing = key in self.crossing
                at = position(key, round_, crossing=crossing, crossing_round=spec.crossing_round)
                await self.heartbeat(client, ("lesson", *key), i % len(self.ports), "rounds", at, round=round_)
                queue.task_done()

        connections = [asyncio.create_task(connection()) for _ in range(spec.connections)]
        i = 0
        for round_ in range(spec.rounds):
            if not self.running():
                break
            self.rounds_sent += 1
            round_started = time.monotonic()
            # the crossing keys go first and together, spread over every process
            for key in sorted(keys, key=lambda k: k not in self.crossing):
                queue.put_nowait((key, round_, i))
                i += 1
            await queue.join()
            await asyncio.sleep(max(0.0, spec.min_round_s - (time.monotonic() - round_started)))
            print(json.dumps({"round": round_, "requests": len(self.ledger.requests)}), flush=True)
        for task in connections:
            task.cancel()

    async def run(self) -> dict[str, object]:
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, lambda: setattr(self, "stopped", True))
        lag = asyncio.create_task(_loop_lag(self.running))
        if self.load.rounds is not None:
            await self.rounds(self.load.rounds)
        else:
            await asyncio.gather(
                *(self.steady(user) for user in self.load.ids("steady")),
                *(self.burst(user) for user in self.load.ids("burst")),
                self.storms(),
                self.crowd(),
            )
        self.stopped = True
        return {
            "requests": self.ledger.requests,
            "loop_lag_max_s": await lag,
            "rounds": self.rounds_sent,
            "crossing": sorted(self.crossing),
        }


async def _loop_lag(running: Callable[[], bool]) -> float:
    """The worst lateness of this process's event loop: what the ledger's latencies may owe to the load itself."""
    worst = 0.0
    while running():
        before = time.monotonic()
        await asyncio.sleep(0.1)
        worst = max(worst, time.monotonic() - before - 0.1)
    return worst


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ports", required=True)
    parser.add_argument("--load", required=True, help="the Load, as JSON")
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--secret", required=True)
    parser.add_argument("--ledger", required=True)
    args = parser.parse_args()
    fields = json.loads(args.load)
    rounds = Rounds(**fields["rounds"]) if fields["rounds"] else None
    load = Load(**{**fields, "crowd_at_s": tuple(fields["crowd_at_s"]), "rounds": rounds})
    users = Users(load, [int(p) for p in args.ports.split(",")], args.secret, args.seed)
    result = uvloop.run(users.run())
    with open(args.ledger, "w") as out:
        json.dump({"load": asdict(load), **result}, out)


if __name__ == "__main__":
    main()
