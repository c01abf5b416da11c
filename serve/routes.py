"""The routes beside generation: the model list and one model, ``/tokenize`` and
``/detokenize`` (vLLM's and llama-server's shapes), CORS, and the handlers that give every
error (404, 405, a failure in a handler) OpenAI's ``{"error": {...}}`` body."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from starlette.exceptions import HTTPException

from paged_decode.runtime.errors import InputError

from .body import validation_error
from .protocol import APIError, DetokenizeRequest, TokenizeRequest

log = logging.getLogger(__name__)

_STATUS_TEXT = {404: "no such route", 405: "this route does not take that method"}


def install_errors(app: FastAPI, server) -> None:
    """Every error a client can meet answers in OpenAI's shape."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return server.error_response(request, exc)

    @app.exception_handler(RequestValidationError)  # a path or query parameter
    async def _invalid(request: Request, exc: RequestValidationError):
        return server.error_response(request, validation_error(exc.errors()))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException):
        what = _STATUS_TEXT.get(exc.status_code, str(exc.detail))
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return server.error_response(request, APIError(
            exc.status_code, f"{request.method} {request.url.path}: {what} (the API: "
            "docs/serving.md)", kind=kind, headers=dict(exc.headers or {})))

    @app.exception_handler(Exception)
    async def _failed(request: Request, exc: Exception):
        log.exception("%s %s failed", request.method, request.url.path)
        return server.error_response(request, APIError(
            500, f"the server failed: {type(exc).__name__}: {exc}", kind="server_error"))


def add_cors(app: FastAPI, origins) -> None:
    """Browsers on ``origins`` may call the API (``["*"]``: any); a preflight ``OPTIONS``
    answers without the API key, as browsers send none with it."""
    if origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(origins), allow_methods=["*"],
                           allow_headers=["*"], max_age=600)


def add_routes(app: FastAPI, server) -> None:
    engine = server.engine

    @app.get("/v1/models")
    async def models(request: Request):
        server.authorize(request)
        return {"object": "list", "data": [server.model_card(n) for n in server.names]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request):
        server.authorize(request)
        if model_id not in server.names:
            raise APIError(404, f"the model '{model_id}' is not served here; this server serves "
                           f"{', '.join(map(repr, server.names))}", "model",
                           kind="not_found_error")
        return server.model_card(model_id)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        server.authorize(request)
        body = await server.parse(request, TokenizeRequest)
        server.check_model(body.model)
        ids = _tokenize(server, body)
        out = {"tokens": ids, "count": len(ids), "max_model_len": engine.artifact.max_tokens}
        tok = engine.tokenizer
        if body.with_pieces:
            out["tokens"] = [{"id": t, "piece": tok.decode([t])} for t in ids]
        if body.return_token_strs:
            out["token_strs"] = [tok.token(t) for t in ids]
        return out

    @app.post("/detokenize")
    async def detokenize(request: Request):
        server.authorize(request)
        body = await server.parse(request, DetokenizeRequest)
        server.check_model(body.model)
        vocab = engine.artifact.manifest.vocab_size
        bad = next((i for i, t in enumerate(body.tokens) if t >= vocab), None)
        if bad is not None:
            raise APIError(400, f"tokens[{bad}]: {body.tokens[bad]} is outside the vocabulary "
                           f"[0, {vocab})", f"tokens[{bad}]")
        text = engine.tokenizer.decode(body.tokens)
        return {"prompt": text, "content": text}  # vLLM's key, llama-server's key


def _tokenize(server, body: TokenizeRequest) -> list[int]:
    given = [f for f in ("prompt", "content", "messages") if getattr(body, f) is not None]
    if len(given) != 1:
        raise APIError(400, "send exactly one of prompt (vLLM), content (llama-server) or "
                       f"messages, got {given or 'none'}", given[1] if given[1:] else "prompt")
    tok = server.engine.tokenizer
    special = body.add_special_tokens if body.add_special is None else body.add_special
    try:
        if body.messages is None:
            return tok.encode(body.prompt if body.content is None else body.content,
                              add_bos=None if special else False)
        return server.chat_ids(body.messages, body.add_generation_prompt)
    except InputError as e:
        raise APIError(400, f"{given[0]}: {e}", given[0]) from e
