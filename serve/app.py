"""The OpenAI-compatible HTTP API over one :class:`~paged_decode.runtime.batch_engine.BatchEngine`.

The model runs on the engine's own thread; a handler submits its request (``submit_n``) and
reads the pieces back through an ``asyncio.Queue`` that the engine's thread fills with
``call_soon_threadsafe``, so the event loop never waits for a decode step.  A client that goes
away cancels its request (its KV blocks are freed at the next step).  The server holds no state
beyond the engine: any number of replicas can stand behind a load balancer (docs/serving.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import threading
import time
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from paged_decode.runtime.errors import (CapacityError, EngineStoppedError, InputError,
                                         PagedDecodeError, QueueFullError)

from .metrics import Metrics
from .body import parse_json, read_body, validate
from .controls import build_grammar, grammar_spec, sampling_params
from .protocol import APIError, ChatRequest, CompletionRequest, SamplingBody
from .page import add_chat_page
from .render import Choice, render_chunk, render_events, render_response
from .routes import add_cors, add_routes, install_errors
from .tools import prompt_ids as tool_prompt_ids, tool_plan

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1
_DISCONNECT_POLL_S = 0.5


def create_app(engine, model_name: str | list[str], *, api_key: str | None = None,
               owns_engine: bool = False, tool_parser: str | None = None,
               allowed_origins: list[str] | None = None) -> FastAPI:
    """The app serving ``engine`` as the model ``model_name`` (or a list of names: the first,
    then its aliases).  With ``api_key`` every /v1 route and /tokenize, /detokenize need
    ``Authorization: Bearer <api_key>``; /health and /metrics stay open.  ``allowed_origins``:
    the browser origins CORS lets in (``["*"]`` for any).  With
    ``owns_engine`` the app closes the engine when it shuts down.  ``tool_parser``: the tool-call
    syntax (serve/tool_format.py) instead of the one the chat template shows."""

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        if owns_engine:
            engine.close()

    app = FastAPI(title="paged-decode", version="1", lifespan=lifespan)
    names = [model_name] if isinstance(model_name, str) else list(model_name)
    server = _Server(engine, names, api_key)
    model_name = names[0]
    app.state.server = server
    install_errors(app, server)
    add_cors(app, allowed_origins)

    add_chat_page(app, model_name)

    @app.get("/health")
    async def health():
        alive = engine.alive
        return JSONResponse({"status": "ok" if alive else "stopped"},
                            status_code=200 if alive else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type="text/plain; version=0.0.4")

    add_routes(app, server)

    @app.post("/v1/completions")
    async def completions(request: Request):
        server.authorize(request)  # before the body is read: no key, no parsing
        body = await server.parse(request, CompletionRequest)
        prompts = server.completion_prompts(body)
        return await server.generate(request, body, prompts, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        server.authorize(request)
        body = await server.parse(request, ChatRequest)
        plan = tool_plan(body, engine.tokenizer, tool_parser)  # None: no tools (serve/tools.py)
        prompts = [server.chat_prompt(body, plan)]
        return await server.generate(request, body, prompts, chat=True, tools=plan)

    return app


class _Server:
    """What the routes share: the engine, the served name, the metrics."""

    def __init__(self, engine, names: list[str], api_key: str | None):
        self.engine, self.names, self.api_key = engine, names, api_key
        self.model_name = names[0]
        self.structured: str | None = None  # why structured output is unavailable, if it is
        self._structured_decided = False  # whether probe_structured_output has run
        self._probe_lock = threading.Lock()
        self.metrics = Metrics(engine)
        self.started = int(time.time())
        self.aborting = False  # past the shutdown timeout: new submissions are refused

    # -- checks -------------------------------------------------------------------------------
    def authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                           kind="authentication_error")

    async def parse(self, request: Request, model):
        """The request's body as ``model`` (body.py: bounded, strict)."""
        return validate(model, parse_json(await read_body(request),
                                          request.headers.get("content-type")))

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.names:
            raise APIError(400, f"the model '{name}' is not served here; this server serves "
                           f"{', '.join(map(repr, self.names))} (GET /v1/models)", "model")

    def model_card(self, name: str) -> dict:
        self.probe_structured_output()
        return {"id": name, "object": "model", "created": self.started,
                "owned_by": "paged-decode", "max_model_len": self.engine.artifact.max_tokens,
                "structured_output": {"available": self.structured is None,
                                      "reason": self.structured}}

    def probe_structured_output(self) -> None:
        """Decide, once, whether structured output is available for this tokenizer: build the
        grammar index (llguidance's index of the vocabulary) and log the answer.  It runs at
        the first request that needs a grammar (or the first model card), not at start: on
        SmolLM2's 49k vocabulary the index takes 0.3 s, holding the GIL, and 50 MiB, which a
        server that never constrains its output need not pay before it answers."""
        from paged_decode.runtime.grammar import GrammarUnavailableError

        with self._probe_lock:
            if self._structured_decided:
                return
            try:
                self.engine.grammars
            except GrammarUnavailableError as e:
                self.structured = str(e)
                log.warning("structured output (response_format, guided_*) is unavailable: %s",
                            e)
            else:
                log.info("structured output (response_format, guided_*): available (llguidance)")
            self._structured_decided = True

    def check_common(self, body: SamplingBody) -> None:
        self.check_model(body.model)
        bad = body.unsupported()
        if bad:
            raise APIError(400, f"{bad[0]} is not supported by this server; leave it out",
                           bad[0])

    def completion_prompts(self, body: CompletionRequest) -> list[list[int]]:
        self.check_common(body)
        p = body.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            p = [p]
        if not p:
            raise APIError(400, "prompt is empty: pass a string or token ids", "prompt")
        tok = self.engine.tokenizer
        try:
            out = [tok.encode(x) if isinstance(x, str) else list(x) for x in p]
        except InputError as e:
            raise APIError(400, f"prompt: {e}", "prompt") from e
        if any(not ids for ids in out):
            raise APIError(400, "prompt: an empty prompt, and this model adds no BOS token to "
                           "start from; pass some text", "prompt")
        return out

    def chat_prompt(self, body: ChatRequest, plan=None) -> list[int]:
        self.check_common(body)
        tok = self.engine.tokenizer
        if tok.chat_template is None:
            raise APIError(400, "this model has no chat template: use /v1/completions, or "
                           "start the server with --chat-template FILE", "messages")
        ids = tool_prompt_ids(tok, body, plan)
        if ids is not None:  # tools offered, or calls and results in the history
            return ids
        return self.chat_ids(body.messages)

    def chat_ids(self, messages, generation_prompt: bool = True) -> list[int]:
        """Plain messages (no tools) through the chat template, encoded without a second
        BOS; a message's ``name`` reaches the template as the message's ``name``."""
        tok = self.engine.tokenizer
        if tok.chat_template is None:
            raise APIError(400, "this model has no chat template: use /v1/completions, or "
                           "start the server with --chat-template FILE", "messages")
        rows = [{"role": m.role, "content": m.text()} | ({"name": m.name} if m.name else {})
                for m in messages]
        try:
            return tok.encode(tok.apply_chat_template(rows, generation_prompt), add_bos=False)
        except InputError as e:
            raise APIError(400, f"messages: {e}", "messages") from e

    # -- one request --------------------------------------------------------------------------
    async def generate(self, request: Request, body: SamplingBody, prompts: list[list[int]],
                       chat: bool, tools=None):
        job = await self._job(body, prompts, chat, tools)
        queue: asyncio.Queue = asyncio.Queue()
        streams = self._submit(job, queue)
        count = self.metrics.requests.labels(request.url.path, "200").inc
        self.metrics.prompt_tokens.inc(sum(len(p) for p in prompts))
        choices = [Choice(i) for i in range(len(streams))]
        ids = {id(s): i for i, s in enumerate(streams)}
        if body.stream:  # the status is sent with the first event, whatever follows
            count()
            return StreamingResponse(
                self._sse(job, streams, ids, choices, queue),
                media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        await self._collect(request, streams, ids, choices, queue)
        failed = next((s.error for s in streams if s.error is not None), None)
        if failed is not None:
            raise APIError(500, f"the generation failed: {type(failed).__name__}: {failed}",
                           kind="server_error")
        count()
        return _with_cached(render_response(job, choices, self.engine.tokenizer), job, streams)

    async def _job(self, body: SamplingBody, prompts: list[list[int]], chat: bool,
                   tools=None) -> dict:
        field = "max_tokens"
        if isinstance(body, ChatRequest):
            if body.max_completion_tokens is not None:
                field = "max_completion_tokens"
            max_tokens = body.max_completion_tokens or body.max_tokens
            if body.top_logprobs is not None and not body.logprobs:
                raise APIError(400, "top_logprobs: needs \"logprobs\": true", "top_logprobs")
            top = (body.top_logprobs or 0) if body.logprobs else None
        else:
            max_tokens, top = body.max_tokens, body.logprobs
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if any(not s for s in stop):
            raise APIError(400, "stop: every stop string must be non-empty", "stop")
        limits = [self._max_tokens(p, max_tokens, field, chat) for p in prompts]
        sampling = sampling_params(body, self.engine.artifact.manifest.vocab_size, limits)
        return {"chat": chat, "model": body.model, "n": body.n, "prompts": prompts,
                "max_tokens": limits, "sampling": sampling, "stop": stop,
                "stop_ids": self._stop_ids(body), "top_logprobs": top,
                "grammar": await self._constraint(body, tools),
                "tools": tools,
                "include_usage": bool(body.stream_options and body.stream_options.include_usage),
                "id": ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12),
                "created": int(time.time())}

    async def _constraint(self, body: SamplingBody, tools):
        """The request's grammar (None: unconstrained); the first request that needs one
        decides whether this tokenizer can have one (:meth:`probe_structured_output`)."""
        spec = grammar_spec(body) if tools is None else None  # a bad field: 400 before the index
        if tools is None and spec is None:
            return None
        await asyncio.to_thread(self.probe_structured_output)
        return (await build_grammar(self.engine, spec) if tools is None
                else await tools.constraint(self.engine))

    def _stop_ids(self, body: SamplingBody) -> list[int]:
        vocab = self.engine.artifact.manifest.vocab_size
        ids = body.stop_token_ids or []
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"stop_token_ids: {bad[0]} is not a token id of this model "
                           f"(0 to {vocab - 1})", "stop_token_ids")
        return ids

    def _max_tokens(self, prompt: list[int], asked: int | None, field: str, chat: bool) -> int:
        """The request's max_tokens: what it asked, or all that fits when it did not; a
        sequence fits both the model's context and the KV pool (``--kv-cache-gb`` may hold
        less than one full-length sequence)."""
        pool = self.engine.pool
        context = self.engine.artifact.max_tokens
        cap = min(context, pool.num_blocks * pool.block_size)
        holder = (f"this model's context is {cap}" if cap == context else
                  f"this server's KV cache holds {cap} (--kv-cache-gb)")
        where = "messages" if chat else "prompt"
        if len(prompt) > cap:
            raise APIError(400, f"{where}: {len(prompt)} tokens, and {holder} tokens; shorten "
                           "it", where)
        room = cap - len(prompt) + 1  # the last generated token needs no KV slot
        if asked is None:
            return room
        if asked > room:
            raise APIError(400, f"{field}: {asked} new tokens after a prompt of {len(prompt)} "
                           f"tokens do not fit: {holder} tokens (the last new token takes no "
                           f"KV slot), so at most {room}; lower {field}", field)
        return asked

    def _submit(self, job: dict, queue: asyncio.Queue) -> list:
        # on the event loop's thread, as abort_all: no submission slips in after the abort
        if self.aborting:
            raise APIError(503, "the server is shutting down; send the request again to "
                           "another replica or once it is back", kind="server_error",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        loop = asyncio.get_running_loop()

        def listener(stream, delta):
            try:
                loop.call_soon_threadsafe(queue.put_nowait, (stream, delta))
            except RuntimeError:  # the loop closed under a request cut by shutdown
                pass

        total, cap = len(job["prompts"]) * job["n"], self.engine.capacity
        if cap is not None and total > cap:  # refused whole: no retry could admit it
            param = "n" if job["n"] > 1 else "prompt"
            raise APIError(400, f"{param}: {len(job['prompts'])} prompt(s) x n={job['n']} = "
                           f"{total} sequences, and this server holds at most {cap} at once "
                           "(--max-running + --max-waiting); send fewer", param)
        grammar = job["grammar"]  # copied before the first submission can advance it
        grammars = [grammar] + [None if grammar is None else grammar.copy()
                                for _ in job["prompts"][1:]]
        streams: list = []
        try:
            for i, ids in enumerate(job["prompts"]):
                streams += self.engine.submit_n(
                    ids, job["n"], max_new_tokens=job["max_tokens"][i],
                    sampling=job["sampling"], stop=job["stop"], stop_token_ids=job["stop_ids"],
                    top_logprobs=job["top_logprobs"], constraint=grammars[i],
                    listener=listener)
        except QueueFullError as e:
            self._cancel(streams)
            raise APIError(429, str(e), kind="rate_limit_error",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from e
        except CapacityError as e:
            self._cancel(streams)
            raise APIError(400, str(e), "max_tokens") from e
        except EngineStoppedError as e:  # closing, or its thread failed: /health says 503 too
            self._cancel(streams)
            raise APIError(503, str(e), kind="server_error") from e
        except PagedDecodeError as e:  # a token id outside the vocabulary, say
            self._cancel(streams)
            raise APIError(400, str(e), "messages" if job["chat"] else "prompt") from e
        return streams

    def abort_all(self) -> None:
        """End every request now (finish_reason "abort"): each response still completes, with
        its text so far (a shutdown past its grace period); requests not yet submitted are
        refused with a 503.  Called on the event loop's thread."""
        self.aborting = True
        self.engine.cancel_all()

    @staticmethod
    def _cancel(streams) -> None:
        for s in streams:
            if s.finish_reason is None:
                s.cancel()

    def _ended(self, stream) -> None:
        self.metrics.observe(stream.request)

    async def _collect(self, request: Request, streams, ids, choices, queue) -> None:
        """Wait for every stream of a non-streaming request; a client gone cancels them (looked
        for every ``_DISCONNECT_POLL_S``, tokens flowing or not)."""
        open_, checked = len(streams), time.monotonic()
        try:
            while open_:
                try:
                    stream, delta = await asyncio.wait_for(queue.get(), _DISCONNECT_POLL_S)
                except TimeoutError:
                    stream = delta = None
                if time.monotonic() - checked >= _DISCONNECT_POLL_S:
                    if await request.is_disconnected():
                        return
                    checked = time.monotonic()
                if stream is None:
                    continue
                choices[ids[id(stream)]].add(stream, delta)
                if delta is None:
                    open_ -= 1
                    self._ended(stream)
        finally:
            self._cancel(streams)

    async def _sse(self, job, streams, ids, choices, queue) -> AsyncIterator[str]:
        """Server-sent events: a role chunk (chat), content chunks, a finish chunk per choice,
        the usage chunk if asked, ``data: [DONE]``."""
        tok = self.engine.tokenizer
        open_ = len(streams)
        try:
            if job["chat"]:
                for c in choices:
                    yield _event(render_chunk(job, c, role=True, tokenizer=tok))
            while open_:
                stream, delta = await queue.get()
                choice = choices[ids[id(stream)]]
                choice.add(stream, delta)
                if delta is None:
                    open_ -= 1
                    self._ended(stream)
                    if stream.error is not None:
                        yield _event(APIError(500, f"the generation failed: "
                                              f"{type(stream.error).__name__}: {stream.error}",
                                              kind="server_error").body())
                        continue
                for obj in render_events(job, choice, delta=delta, tokenizer=tok):
                    yield _event(obj)
            if job["include_usage"]:
                usage = render_chunk(job, None, usage_of=choices, tokenizer=tok)
                yield _event(_with_cached(usage, job, streams))
            yield "data: [DONE]\n\n"
        finally:
            self._cancel(streams)

    def error_response(self, request: Request, exc: APIError) -> JSONResponse:
        route = request.scope.get("route")  # a route's template: no label per unknown path
        if route is not None and request.url.path.startswith("/v1/"):
            self.metrics.requests.labels(route.path, str(exc.status)).inc()
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def _with_cached(out: dict, job: dict, streams) -> dict:
    """``usage.prompt_tokens_details.cached_tokens``: the prompt tokens the prefix cache
    held, counted once per prompt (its first continuation prefilled it)."""
    heads = streams[::job["n"]]
    cached = sum(s.request.cached_tokens for s in heads)
    out["usage"]["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
