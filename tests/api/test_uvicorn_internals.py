"""What service/api/http_limits.py takes from uvicorn's httptools protocol is still there, as it expects."""

import inspect

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

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
