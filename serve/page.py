"""The chat page at ``/`` (as llama-server's web UI): plain HTML and one script, both served
from the package, and a Content-Security-Policy that keeps the browser from loading anything
from another host.  The page talks to this server's own ``/v1/chat/completions``."""

from __future__ import annotations

import functools
import html
from importlib import resources

from fastapi.responses import HTMLResponse, Response

# the page and its script come from this server only; the API calls go back to it
_CSP = ("default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
        "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'")


@functools.lru_cache(maxsize=2)
def _static(name: str) -> str:
    return resources.files("paged_decode.serve").joinpath("static", name).read_text("utf-8")


def add_chat_page(app, model_name: str) -> None:
    """``GET /`` (the page, titled with ``model_name``) and ``GET /chat.js`` on ``app``."""
    headers = {"Content-Security-Policy": _CSP, "Cache-Control": "no-cache"}

    @app.get("/", include_in_schema=False)
    async def page():
        body = _static("index.html").replace("{{MODEL}}", html.escape(model_name, quote=True))
        return HTMLResponse(body, headers=headers)

    @app.get("/chat.js", include_in_schema=False)
    async def script():
        return Response(_static("chat.js"), media_type="text/javascript; charset=utf-8",
                        headers=headers)
