"""Session servers of the deploy tests: a private CA for TLS, and a real PgBouncer from Debian's packages."""

import datetime
import ipaddress
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from service.dev.embedded import _die_with_parent, free_port
from tests import debian
from tests.helpers import PgBouncer, Servers, Tls

PGBOUNCER_INSTALL_TIMEOUT_S = 300


@pytest.fixture(scope="session")
def shared_dir() -> Iterator[Path]:
    """Readable by the unprivileged user PgBouncer runs as (pytest's own temp dirs are root-only)."""
    path = Path(tempfile.mkdtemp(prefix="progress-deploy-tests-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    path.chmod(0o644)
    return path


@pytest.fixture(scope="session")
def tls(shared_dir: Path) -> Tls:
    """A CA and a server certificate for 127.0.0.1, as a private CA would issue them."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name("progress test CA"))
        .issuer_name(_name("progress test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("127.0.0.1"))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]),
            critical=False,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return Tls(
        ca=_write(shared_dir / "ca.pem", ca.public_bytes(serialization.Encoding.PEM)),
        cert=_write(shared_dir / "server.pem", cert.public_bytes(serialization.Encoding.PEM)),
        key=_write(
            shared_dir / "server.key",
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            ),
        ),
    )


def _pgbouncer_binary() -> str:
    """PgBouncer from Debian's packages; installed here if missing, as CI runs on a fresh machine as root."""
    found = shutil.which("pgbouncer") or shutil.which("pgbouncer", path="/usr/sbin")
    if found:
        return found
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.fail("pgbouncer is not installed and cannot be installed here: run `apt-get install -y pgbouncer`")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "pgbouncer"]
    deadline = time.monotonic() + PGBOUNCER_INSTALL_TIMEOUT_S
    for command in (install, ["apt-get", "update", "-q"], install):
        # the first install works when the package lists are fresh; otherwise update, then again
        done = subprocess.run(
            command, env=env, capture_output=True, text=True, check=False, timeout=max(deadline - time.monotonic(), 1)
        )
        found = shutil.which("pgbouncer") or shutil.which("pgbouncer", path="/usr/sbin")
        if found:
            return found
    pytest.fail(f"apt-get could not install pgbouncer:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")


def _unprivileged() -> tuple[int, int] | None:
    """PgBouncer refuses to run as root: as root, run it as `nobody`."""
    if os.geteuid() != 0:
        return None
    nobody = pwd.getpwnam("nobody")
    return nobody.pw_uid, nobody.pw_gid


@pytest.fixture(scope="session")
def pgbouncer(servers: Servers, migrated: str, shared_dir: Path, tls: Tls) -> Iterator[PgBouncer]:
    """PgBouncer in transaction pooling mode in front of the session's Postgres, TLS required of clients,
    with 2 server connections for any number of clients."""
    binary = _pgbouncer_binary()
    target = urlsplit(servers.database_url)
    database = target.path.lstrip("/")
    server = f"host={target.hostname} port={target.port or 5432} dbname={database} user={target.username or 'postgres'}"
    if target.password:
        server += f" password={target.password}"
    port = free_port()
    config = shared_dir / "pgbouncer.ini"
    _write(
        config,
        f"""
[databases]
{database} = {server} pool_size=2

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {port}
unix_socket_dir =
auth_type = any
pool_mode = transaction
max_client_conn = 100
client_tls_sslmode = require
client_tls_cert_file = {tls.cert}
client_tls_key_file = {tls.key}
""".encode(),
    )
    uid, gid = _unprivileged() or (None, None)
    log_path = shared_dir / "pgbouncer.log"
    with open(log_path, "wb") as log:
        # as the embedded servers: unprivileged, and stopped by the kernel if this process dies
        process = subprocess.Popen(
            [binary, str(config)],
            stdout=log,
            stderr=log,
            stdin=subprocess.DEVNULL,
            preexec_fn=_die_with_parent(signal.SIGTERM, uid=uid, gid=gid),
        )
    try:
        deadline = time.monotonic() + 15
        while not _listening(port):
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"pgbouncer did not start:\n{log_path.read_text()[-2000:]}")
            time.sleep(0.05)
        yield PgBouncer(port, database)
    finally:
        process.send_signal(signal.SIGINT)  # safe shutdown: let the clients' transactions finish
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


@pytest.fixture(scope="session")
def prometheus_bin() -> Path:
    """The directory holding Debian's `prometheus` and `promtool`, fetched into .cache/ on first use."""
    try:
        promtool = debian.program(debian.PROMETHEUS, "promtool")
        server = debian.program(debian.PROMETHEUS, "prometheus")
    except debian.Unavailable as exc:
        pytest.fail(f"no Prometheus for the tests: {exc} (or `apt-get install -y prometheus`)")
    assert promtool.parent == server.parent, f"{promtool} and {server} come from two installs"
    return server.parent
