"""`tether serve`: an OpenAI-compatible HTTP server over an inference engine, with weight-update endpoints.

``make_app(engine, tokenizer, model_name=...)`` builds the FastAPI app (``app.py``; wire format in
``protocol.py``); ``tether.serve.server.serve(checkpoint, cfg, ...)`` runs it over a local engine with
uvicorn; ``ServerThread`` (``http.py``) runs an app in a background thread (tests, a co-located trainer).
"""

from tether.serve.app import make_app
from tether.serve.http import ServerThread

__all__ = ["ServerThread", "make_app"]
