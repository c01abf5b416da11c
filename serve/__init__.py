"""``paged-serve``: an OpenAI-compatible HTTP server over the batching engine (runtime only: a
deploy box needs no compiler once the artifact exists)."""

from __future__ import annotations

import ipaddress
import logging
import os
import signal
from pathlib import Path

from paged_decode.runtime.errors import ConfigError

log = logging.getLogger(__name__)

DEFAULT_KV_FRACTION = 0.25  # of physical memory, the default KV pool's ceiling


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, api_key: str | None, allow_remote: bool) -> None:
    """A server reachable from other machines needs an API key, or an explicit opt-out."""
    if not is_loopback(host) and api_key is None and not allow_remote:
        raise ConfigError(f"--host {host} is reachable from other machines and no --api-key is "
                          "set: give --api-key KEY (or PAGED_DECODE_API_KEY), or --allow-remote "
                          "to serve without one")


def default_num_blocks(m, max_running: int) -> int:
    """Blocks for ``max_running`` full-length sequences of an artifact (its ``Manifest``), at
    most DEFAULT_KV_FRACTION of the machine's memory (and never fewer than one full-length
    sequence)."""
    from paged_decode.runtime.kv_pool import block_bytes

    per_block = block_bytes(m.n_layers, m.n_kv_heads, m.head_dim, m.block_size, m.cache_dtype)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    ceiling = int(memory * DEFAULT_KV_FRACTION) // per_block
    want = m.max_blocks_cap * max_running
    blocks = max(min(want, ceiling), m.max_blocks_cap)
    if blocks < want:
        log.warning("KV pool: %d blocks (%.2f GB), room for %.1f full-length sequences of %d "
                    "running; set --kv-cache-gb to change it", blocks, blocks * per_block / 1e9,
                    blocks / m.max_blocks_cap, max_running)
    return blocks


def load_engine(artifact_dir: Path, weights_dir: Path, *, kv_cache_gb: float | None,
                max_running: int | None, max_waiting: int, prefill_budget: int,
                chat_template: str | None, speculative=None):
    """The batching engine for a server (pool sized as :func:`default_num_blocks` says, unless
    ``kv_cache_gb``), with the chat template replaced when one is given (``chat_template``:
    its source, as :func:`read_chat_template` returns it)."""
    from paged_decode.runtime.artifact import read_manifest
    from paged_decode.runtime.batch_engine import BatchEngine

    from paged_decode.runtime.kv_pool import PoolConfigError

    manifest, _ = read_manifest(artifact_dir)  # BatchEngine.load loads the library itself
    running = max_running or max(manifest.batch_buckets, default=1)
    pool = ({"memory_budget_bytes": int(kv_cache_gb * 1e9)} if kv_cache_gb is not None
            else {"num_blocks": default_num_blocks(manifest, running)})
    try:
        engine = BatchEngine.load(artifact_dir, weights_dir, max_running=running,
                                  max_waiting=max_waiting, prefill_budget=prefill_budget,
                                  speculative=speculative, **pool)
    except PoolConfigError as e:
        if kv_cache_gb is None:
            raise
        raise PoolConfigError(f"--kv-cache-gb {kv_cache_gb:g} is too small: {e} (paged-serve "
                              "--block-size)") from e
    held = engine.pool.num_blocks * engine.pool.block_size
    if held < engine.artifact.max_tokens:
        log.warning("--kv-cache-gb %g holds %d tokens, less than one sequence of this model's "
                    "context (%d): a request gets at most that many, prompt and output",
                    kv_cache_gb, held, engine.artifact.max_tokens)
    if chat_template is not None:
        engine.tokenizer.set_chat_template(chat_template)
    return engine


def read_chat_template(path) -> str:
    """The Jinja chat template in the file ``path``, checked to parse (``ConfigError`` naming
    the file otherwise), before anything is compiled or loaded."""
    from paged_decode.runtime.errors import InputError
    from paged_decode.runtime.tokenizer import check_chat_template

    try:
        source = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--chat-template {path}: cannot read it ({e})") from e
    try:
        check_chat_template(source)
    except InputError as e:
        raise ConfigError(f"--chat-template {path}: {e}") from e
    return source


def build_app(artifact_dir, weights_dir, model_name: str, *, api_key: str | None = None,
              kv_cache_gb: float | None = None, max_running: int | None = None,
              max_waiting: int = 64, prefill_budget: int = 512,
              chat_template: str | None = None, speculative=None):
    """The ASGI app of one replica over a compiled artifact (what ``paged-serve`` runs), for
    hosting it elsewhere: ``uvicorn``'s factory mode, or a Ray Serve ingress builder.
    ``speculative``: a :class:`~paged_decode.runtime.speculative.SpeculativeConfig`."""
    from .app import create_app

    template = None if chat_template is None else read_chat_template(chat_template)
    engine = load_engine(Path(artifact_dir), Path(weights_dir), kv_cache_gb=kv_cache_gb,
                         max_running=max_running, max_waiting=max_waiting,
                         prefill_budget=prefill_budget, chat_template=template,
                         speculative=speculative)
    return create_app(engine, model_name, api_key=api_key, owns_engine=True)


# after the shutdown timeout the requests left are aborted (each response still completes with
# finish_reason "abort" and, streaming, data: [DONE]); uvicorn cuts connections only this much
# later, for a handler that has not finished by then
ABORT_GRACE_S = 5.0


def draining_server(config, abort_all, shutdown_timeout: float):
    """A ``uvicorn.Server`` whose shutdown lets running requests finish for
    ``shutdown_timeout`` seconds, then calls ``abort_all()`` and lets the handlers write their
    ends; ``config.timeout_graceful_shutdown`` is set ``ABORT_GRACE_S`` past it."""
    import asyncio

    import uvicorn

    config.timeout_graceful_shutdown = shutdown_timeout + ABORT_GRACE_S

    class _Draining(uvicorn.Server):
        async def shutdown(self, sockets=None):
            timer = asyncio.get_running_loop().call_later(shutdown_timeout, abort_all)
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()

    return _Draining(config)


def bind_socket(host: str, port: int):
    """A listening TCP socket on ``host:port``, bound now (the server answers "loading" on it
    while the model loads); a port in use or an address this machine lacks is a
    :class:`ConfigError` naming it."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ConfigError(f"--host {host}: cannot resolve it ({e.strerror})") from e
    family, kind, proto, _name, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port} ({e.strerror or e}); is another "
                          "server using the port? choose another with --port") from e
    sock.set_inheritable(True)
    return sock


class LoadingApp:
    """The ASGI app a server runs while its model loads: ``/health`` answers 503
    ``{"status": "loading"}`` (llama-server's convention, so an orchestrator tells loading
    from dead), every other path 503 in OpenAI's error shape with ``Retry-After``; once
    :meth:`ready` hands it the real app, every request goes there."""

    def __init__(self):
        self.app = None

    def ready(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if self.app is not None:
            return await self.app(scope, receive, send)
        if scope["type"] == "lifespan":
            return await self._lifespan(receive, send)
        if scope["type"] != "http":
            return None
        import json

        body = ({"status": "loading"} if scope["path"] == "/health" else
                {"error": {"message": "the model is loading; retry shortly", "type":
                           "unavailable", "param": None, "code": 503}})
        data = json.dumps(body).encode()
        await send({"type": "http.response.start", "status": 503,
                    "headers": [(b"content-type", b"application/json"),
                                (b"retry-after", b"1"),
                                (b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data})
        return None

    async def _lifespan(self, receive, send):
        """Startup at once (the model loads meanwhile); whoever made the engine closes it."""
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return


def serve_while_loading(load, host: str, port: int, *, shutdown_timeout: float,
                        log_level: str = "info", on_ready=None, on_bound=None) -> None:
    """Bind ``host:port`` now, answer "loading" (:class:`LoadingApp`) while ``load()`` builds
    the app on a thread of its own, then serve it until SIGINT / SIGTERM (as
    :func:`run_server`).  ``on_bound(port)`` runs once the port is bound, ``on_ready(app,
    port)`` once the app serves.  An error of ``load()`` stops the server and is raised here."""
    import threading

    import uvicorn

    sock = bind_socket(host, port)
    if on_bound is not None:
        on_bound(sock.getsockname()[1])
    loading = LoadingApp()
    config = uvicorn.Config(loading, log_level=log_level, lifespan="on")
    server = draining_server(config, lambda: loading.app and loading.app.state.server.abort_all(),
                             shutdown_timeout)

    failed: list[BaseException] = []

    def build() -> None:
        try:
            app = load()
        except BaseException as e:  # handed to the main thread, which raises it
            failed.append(e)
            server.should_exit = True
            return
        loading.ready(app)
        if on_ready is not None:
            on_ready(app, sock.getsockname()[1])

    thread = threading.Thread(target=build, name="paged-serve-load", daemon=True)
    thread.start()
    try:
        _run(server, [sock])
    finally:
        sock.close()
    if thread.is_alive():  # stopped while loading: nothing serves yet, nothing to drain
        log.info("stopped before the model finished loading")
        return
    if failed:
        raise failed[0]


def _run(server, sockets=None) -> None:
    # uvicorn raises the signal it caught again once it has shut down; a no-op handler in
    # place of the default makes that a normal return (exit status 0) instead of a kill
    previous = {sig: signal.signal(sig, lambda *_: None)
                for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run(sockets=sockets)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_server(app, host: str, port: int, *, shutdown_timeout: float,
               log_level: str = "info") -> None:
    """Serve until SIGINT / SIGTERM: stop accepting, let running requests finish for up to
    ``shutdown_timeout`` seconds, abort the rest (finish_reason "abort"), close the engine,
    return."""
    import uvicorn

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on")
    _run(draining_server(config, app.state.server.abort_all, shutdown_timeout))
