"""What service/api/http_limits.py, service/api/protocol.py and service/serving.py take from uvicorn's internals is
still there."""

import inspect

import uvicorn
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol, RequestResponseCycle
from uvicorn.supervisors import multiprocess

from service.api import protocol
from service.api.http_limits import LimitedHttpToolsProtocol


def test_the_parser_callbacks_overridden_keep_their_shape() -> None:
    for name, parameters in {
        "data_received": ["self", "data"],
        "on_message_begin": ["self"],
        "on_headers_complete": ["self"],
        "on_body": ["self", "body"],
        "on_message_complete": ["self"],
        "connection_lost": ["self", "exc"],
    }.items():
        assert name in vars(LimitedHttpToolsProtocol), name
        assert list(inspect.signature(getattr(HttpToolsProtocol, name)).parameters) == parameters, name


def test_the_head_is_still_collected_where_the_limits_read_it() -> None:
    source = inspect.getsource(HttpToolsProtocol)
    # on_url and on_header fill these before on_headers_complete, which measures them
    for collected in ("self.url = ", "self.headers = ", "self.headers.append", "self.loop", "self.transport"):
        assert collected in source, collected
    assert "self.parser.feed_data(data)" in inspect.getsource(HttpToolsProtocol.data_received)


def test_what_the_heartbeats_protocol_shares_with_uvicorns_is_still_where_it_reads_and_writes_it() -> None:
    source = inspect.getsource(HttpToolsProtocol)
    # the request in flight: pipelined requests wait behind it, the shutdown and a lost connection reach it
    assert "if existing_cycle is None or existing_cycle.response_complete:" in source
    assert "self.cycle.keep_alive = False" in inspect.getsource(HttpToolsProtocol.shutdown)
    lost = inspect.getsource(HttpToolsProtocol.connection_lost)
    assert "self.cycle.disconnected = True" in lost and "self.cycle.message_event.set()" in lost
    # its answer: counted, the keep-alive timer, the next pipelined request
    done = inspect.getsource(HttpToolsProtocol.on_response_complete)
    assert "total_requests += 1" in done and "self.pipeline.pop()" in done
    # the tasks the shutdown waits for, the flow control, what begins and parses a request
    assert "self.tasks.add(task)" in inspect.getsource(HttpToolsProtocol._start_asgi_task)
    for used in ("self.flow = FlowControl(", "self.expect_100_continue = True", "default_headers=self.server_state"):
        assert used in source, used
    assert "self.parser.should_keep_alive()" in inspect.getsource(HttpToolsProtocol.on_headers_complete)
    assert STATUS_LINE[201] == b"HTTP/1.1 201 Created\r\n"
    # the answer as uvicorn's cycle writes it: the default headers first, `connection: close` added when not kept
    send = inspect.getsource(RequestResponseCycle.send)
    assert 'headers = self.default_headers + list(message.get("headers", []))' in send
    assert 'content.append(b"connection: close\\r\\n")' in send
    # a failing handler's answer, which the protocol writes as uvicorn's cycle does
    failed = inspect.getsource(RequestResponseCycle.send_500_response)
    for name, value in protocol._INTERNAL_ERROR_HEAD:
        assert f'(b"{name.decode()}", b"{value.decode()}")' in failed, name
    assert f'b"{protocol._INTERNAL_ERROR_BODY.decode()}"' in failed


def test_the_server_hooks_and_state_the_drain_uses_keep_their_shape() -> None:
    assert list(inspect.signature(uvicorn.Server.handle_exit).parameters) == ["self", "sig", "frame"]
    assert list(inspect.signature(uvicorn.Server.on_tick).parameters) == ["self", "counter"]
    assert "await self.on_tick(counter)" in inspect.getsource(uvicorn.Server.main_loop)
    server = uvicorn.Server(uvicorn.Config("service.app:app_from_environment", factory=True))
    assert isinstance(server.server_state.default_headers, list)
    assert "self.lifespan = config.lifespan_class(config)" in inspect.getsource(uvicorn.Server)
    assert "self.encoded_headers = " in inspect.getsource(uvicorn.Config.load)


def test_the_supervisor_still_makes_its_workers_from_its_modules_process_class() -> None:
    assert "Process(" in inspect.getsource(multiprocess.Multiprocess)
    # a worker serves with `self.server`, a property made once from `_server`: _DrainingWorker overrides it
    assert isinstance(inspect.getattr_static(multiprocess.Process, "server"), property)
    assert "self.server.run(sockets)" in inspect.getsource(multiprocess.Process.target)
