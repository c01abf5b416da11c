"""HTTP across the two Ray Serve deployments of serve/ray_deployment.py.

:func:`forward` runs in the ingress: it sends the request to a replica through a streaming
deployment handle and turns the replica's messages back into a response, sending the request
again to another replica when the chosen one dies before the response's first token.
:func:`call_app` runs in the replica: it calls the paged-serve ASGI app with the forwarded
request and yields what the app sends.
"""

from __future__ import annotations

import asyncio
import json
import logging

from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayError

from .ray_router import REPLICA_HEADER, Forwarded, routing_key

log = logging.getLogger(__name__)

_GONE = (ActorDiedError, ActorUnavailableError, RayActorError)
RETRY_AFTER_S = 1


async def call_app(app, req: Forwarded, extra_headers: list[tuple[bytes, bytes]]):
    """Yield ``("start", status, headers)`` and then the non-empty body chunks of ``app``'s
    answer to ``req``.  Closing the generator early (the client left) cancels the app's
    handler, which cancels its sequences in the engine."""
    queue: asyncio.Queue = asyncio.Queue()
    received = asyncio.Event()

    async def receive():
        if not received.is_set():
            received.set()
            return {"type": "http.request", "body": req.body, "more_body": False}
        await asyncio.Event().wait()  # no disconnect arrives: cancellation ends the handler
        return {"type": "http.disconnect"}

    async def send(message):
        await queue.put(message)

    async def run():
        try:
            await app(_scope(req), receive, send)
        except Exception:  # the app has sent its 500 already; the cause goes to the log
            log.exception("%s %s failed", req.method, req.path)
        finally:
            queue.put_nowait(None)

    task = asyncio.create_task(run())
    try:
        while (message := await queue.get()) is not None:
            if message["type"] == "http.response.start":
                yield ("start", message["status"],
                       list(message.get("headers", [])) + extra_headers)
            elif message["type"] == "http.response.body" and message.get("body"):
                yield bytes(message["body"])
    finally:
        task.cancel()


def _scope(req: Forwarded) -> dict:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1", "method": req.method, "scheme": "http",
            "path": req.path, "raw_path": req.path.encode(), "root_path": "",
            "query_string": req.query, "headers": list(req.headers),
            "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 80), "state": {}}


async def forward(replica, request, retries: int):
    """The response of a replica to the starlette ``request`` (see the module's doc)."""
    from starlette.responses import StreamingResponse

    body = await request.body()
    path, root = request.scope["path"], request.scope.get("root_path", "")
    if root and path.startswith(root):  # an application under a route_prefix
        path = path[len(root):] or "/"
    pin = request.headers.get(REPLICA_HEADER)
    req = Forwarded(request.method, path, request.scope.get("query_string", b""),
                    tuple(request.scope["headers"]), body, routing_key(path, body), pin)
    for attempt in range(retries + 1):
        gen = replica.options(stream=True).handle.remote(req)
        try:
            start, first, done = await _head(gen)
        except _GONE as e:
            if attempt < retries and pin is None:
                log.warning("%s %s: the replica went away before answering (%s); sending "
                            "it to another", request.method, path, type(e).__name__)
                continue
            return _error(503, f"the replica serving this request went away "
                          f"({type(e).__name__}); send it again", retry=True)
        except RayError as e:
            log.error("%s %s: %s", request.method, path, e)
            return _error(500, f"the request failed: {type(e).__name__}")
        _, status, headers = start
        response = StreamingResponse(_rest(gen, first, done, _is_sse(headers)),
                                     status_code=status)
        response.raw_headers = [(k, v) for k, v in headers]
        return response
    raise AssertionError("unreachable: the last attempt returns")


async def _head(gen):
    """The start message and the body chunks up to and including the first non-empty one
    (for a stream, its first token): what must arrive before the response is committed."""
    start = await gen.__anext__()
    first: list[bytes] = []
    try:
        first.append(await gen.__anext__())
    except StopAsyncIteration:
        return start, first, True
    return start, first, False


async def _rest(gen, first: list[bytes], done: bool, sse: bool):
    finished = done
    try:
        for chunk in first:
            yield chunk
        if done:
            return
        async for chunk in gen:
            yield chunk
        finished = True
    except RayError as e:  # the replica died mid-response: say so, then end the body
        log.warning("a replica died mid-response: %s", type(e).__name__)
        if sse:
            error = {"error": {"message": f"the replica serving this stream went away "
                               f"({type(e).__name__}); the output is incomplete",
                               "type": "server_error", "param": None, "code": 503}}
            yield f"data: {json.dumps(error)}\n\n".encode()
        finished = True
    finally:
        if not finished:  # the client left: stop the replica's work
            gen.cancel()


def _is_sse(headers) -> bool:
    return any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
               for k, v in headers)


def _error(status: int, message: str, retry: bool = False):
    from starlette.responses import JSONResponse

    body = {"error": {"message": message, "type": "server_error", "param": None,
                      "code": status}}
    headers = {"Retry-After": str(RETRY_AFTER_S)} if retry else None
    return JSONResponse(body, status_code=status, headers=headers)
