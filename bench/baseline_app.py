"""The floor of the HTTP benchmarks: a bare ASGI app under the uvicorn, uvloop and httptools that `serve` runs.

Per request it reads the body and answers the heartbeat's 201 (`{"data":true}`), nothing else: no auth, no store.
    python bench/baseline_app.py --port 8001
"""

import argparse

import uvicorn

CREATED = [(b"content-type", b"application/json"), (b"content-length", b"13")]


async def app(scope: dict, receive, send) -> None:  # type: ignore[no-untyped-def, type-arg]
    if scope["type"] != "http":
        return
    message = await receive()
    while message.get("more_body"):
        message = await receive()
    await send({"type": "http.response.start", "status": 201 if scope["method"] == "POST" else 200, "headers": CREATED})
    await send({"type": "http.response.body", "body": b'{"data":true}'})


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8001)
    port = parser.parse_args().port
    options = {"loop": "uvloop", "http": "httptools", "access_log": False, "server_header": False}
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", proxy_headers=True, **options)
