"""The embedded servers of `dev` and the tests are the service's own, or none."""

import socket
from pathlib import Path

import pytest

from service.dev import database, embedded


@pytest.mark.regression
@pytest.mark.parametrize("server", [embedded.EmbeddedRedis, database.EmbeddedPostgres])
def test_a_port_another_server_holds_is_refused_not_silently_shared(server: type, tmp_path: Path) -> None:
    """Found by an outside attack: `dev` printed "ready" on top of a foreign Valkey that held its port."""
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        with pytest.raises(embedded.EmbeddedServerError, match=f"port {port} is already in use"):
            server(tmp_path / "data", port).start()


@pytest.mark.parametrize("server", [embedded.EmbeddedRedis, database.EmbeddedPostgres])
def test_a_server_that_exits_at_start_says_why(server: type, tmp_path: Path) -> None:
    """Its port bound by another socket that does not listen (one closing, one starting): the check before the start
    finds nobody there, the server's own bind fails, and the error shows the server's words, not just its log's path."""
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        with pytest.raises(embedded.EmbeddedServerError, match=r"exited at start(.|\n)*[Aa]ddress already in use"):
            server(tmp_path / "data", other.getsockname()[1]).start()
