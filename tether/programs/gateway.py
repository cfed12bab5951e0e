"""An OpenAI-compatible endpoint per episode over the rollout engine, recording every call.

tether serve's app (``tether.serve.make_app``: the same chat template rendering, tool-call parsing, stops and
logprobs as ``tether serve``) over a ``RecordingEngine``, in a uvicorn thread on loopback. Episode ``sid``'s base
URL is ``http://127.0.0.1:PORT/sessions/<sid>/v1``; the router strips the prefix, refuses unknown or ended
sessions (404) and every route but chat completions, completions and models, and sets the request's session for
the engine. ``/sessions/<sid>/episode`` (GET: ``done``) and ``/episode/tools/<name>`` (POST, the arguments as the
body) are the environment for a program run as a command (``agent_loop.program_command``). A random bearer key per
gateway keeps other local processes out.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import secrets
import threading
from typing import Any

from fastapi import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from tether.engine.base import InferenceEngine
from tether.programs.recording import RecordingEngine, Session, current_session
from tether.serve.app import make_app
from tether.serve.generation import APIError
from tether.serve.http import ServerThread

MODEL_NAME = "policy"
_PATH = re.compile(r"/sessions/([A-Za-z0-9_-]+)(/v1/(?:chat/completions|completions|models(?:/[^/]+)?)"
                   r"|/episode(?:/tools/[^/]+)?)")


class _SessionRouter:
    """ASGI: ``/sessions/<sid>/v1/...`` → the app's ``/v1/...`` with ``current_session`` set for the request."""

    def __init__(self, app: ASGIApp, sessions: dict[str, Session]):
        self.app, self.sessions = app, sessions

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        found = _PATH.fullmatch(scope["path"])
        session = self.sessions.get(found.group(1)) if found else None
        if found is None or session is None or session.closed:
            what = "no such route" if found is None else "no such episode, or it has ended"
            body = json.dumps({"error": {"message": f"{what}: {scope['path']}", "type": "invalid_request_error",
                                         "param": None, "code": None}}).encode()
            await send({"type": "http.response.start", "status": 404,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": body})
            return
        token = current_session.set(session)
        try:
            path = found.group(2)
            await self.app({**scope, "path": path, "raw_path": path.encode()}, receive, send)
        finally:
            current_session.reset(token)


def _episode() -> Any:
    session = current_session.get()
    if session is None or session.episode is None:
        raise APIError(404, "no episode for this request")
    return session.episode


async def _episode_state() -> dict[str, Any]:
    return {"done": _episode().done}


async def _episode_tool(name: str, request: Request) -> dict[str, Any]:
    """One tool call of the episode, run on the rollout's event loop (where its environment lives)."""
    episode = _episode()
    try:
        arguments = await request.json()
    except ValueError:
        raise APIError(400, "the body must be the tool's arguments as a JSON object", param="body") from None
    coro = episode.acall_tool(name, arguments if isinstance(arguments, dict) else None)
    obs = await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, episode.loop))
    return dataclasses.asdict(obs)


class Gateway:
    """Episode endpoints over ``engine``; ``open(session)`` gives its base URL, ``close_session`` ends it."""

    def __init__(self, engine: InferenceEngine, tokenizer: Any, *, parser: str, extra_stop_ids: tuple[int, ...] = ()):
        self.api_key = secrets.token_urlsafe(24)
        self.sessions: dict[str, Session] = {}
        self._lock = threading.Lock()
        app = make_app(RecordingEngine(engine), tokenizer, model_name=MODEL_NAME, parser=parser,
                       extra_stop_ids=extra_stop_ids, api_key=self.api_key, max_loras=0)
        app.add_api_route("/episode", _episode_state, methods=["GET"])
        app.add_api_route("/episode/tools/{name}", _episode_tool, methods=["POST"])
        self.server = ServerThread(_SessionRouter(app, self.sessions)).start()

    def open(self, session: Session) -> str:
        with self._lock:
            self.sessions[session.ident] = session
        return f"{self.server.base_url}/sessions/{session.ident}/v1"

    def close_session(self, session: Session) -> None:
        session.close()
        with self._lock:
            self.sessions.pop(session.ident, None)

    def close(self) -> None:
        self.server.stop()
