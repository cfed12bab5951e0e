"""Running the app: ``serve`` (the ``tether serve`` command, blocking) over a local engine of a checkpoint
(``build``), with its start-up checks (chat template, exposure warning). The socket is bound before uvicorn starts
(``tether.serve.http``), so port 0 picks a free port and ``serve`` prints the actual address.
"""

from __future__ import annotations

import ctypes
import ipaddress
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jinja2
import uvicorn
from fastapi import FastAPI

from tether import heap
from tether.config import RunConfig
from tether.config.plan import Plan
from tether.learner.model import load_model_and_tokenizer
from tether.runtime import local_engine
from tether.serve.app import make_app
from tether.serve.http import bind, uvicorn_config

_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)


def fixed_mmap_threshold(nbytes: int = 4 << 20) -> bool:
    """Make glibc serve every allocation of ``nbytes`` or more with its own mmap, returned to the system when freed.

    By default glibc raises that threshold to the size of the largest block freed so far (up to 32 MiB), and a
    worker thread's arena then keeps up to twice it for good: after a few 20 MB request bodies, parsed in worker
    threads, the server stayed ~40 MB per thread above where it started (benchmarks/serve_load.py). Fixing the
    threshold turns that adjustment off. False where the C library is not glibc (nothing changed)."""
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, nbytes))
    except (OSError, AttributeError):
        return False


def read_chat_template(path: str | Path) -> str:
    """The text of a chat template file (``--chat-template``); ValueError naming the file when it cannot be read,
    is empty or is not valid Jinja (checked at start, not at the first request)."""

    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--chat-template {path}: cannot read it ({e})") from None
    if not text.strip():
        raise ValueError(f"--chat-template {path}: the file is empty")
    try:
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template {path}: not a valid Jinja template (line {e.lineno}: {e.message})") from None
    return text


LATENCY_ROWS = 4  # ``--latency-rows``' default (benchmarks/serve_load.py)


def build(checkpoint: str | Path, cfg: RunConfig, *, model_name: str, api_key: str | None,
          chat_template: str | None = None, max_loras: int = 4, weight_updates: bool = False,
          weights_root: str | Path | None = None, max_request_bytes: int | None = None,
          stream_interval: int | None = None, latency_rows: int = LATENCY_ROWS) -> tuple[FastAPI, Any]:
    """The app over a local engine of ``checkpoint`` (the config's model dtype, engine, rollout and tool-parser
    settings) and the engine, which the caller closes. ``chat_template``: a Jinja chat template that replaces the
    checkpoint's own for rendering chat requests (``tether serve --chat-template``). ``max_loras``: LoRA adapters
    loaded at once (``/v1/load_lora_adapter``), each on a local engine of the same settings over a copy of the
    served weights (``tether.serve.adapters``). ``weight_updates``, ``weights_root`` (default: the checkpoint's
    parent folder), ``max_request_bytes``, ``stream_interval``: ``make_app``'s. ``latency_rows``: the engines'
    latency cap (``LocalEngine``'s, ``tether.engine.fair_share``)."""
    model, tokenizer = load_model_and_tokenizer(checkpoint, cfg.model.dtype)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    # the server *is* the local engine, whatever engine.type the training config rolls out with
    plan = Plan.of(cfg)
    engine = local_engine(model, plan, cfg.engine, cfg.rollout.partial_rollout, latency_rows=latency_rows)
    del model  # the engine has its own copy

    def adapter_engine() -> Any:  # local_engine copies the served weights (already in the served dtype)
        return local_engine(engine.model, plan, cfg.engine, cfg.rollout.partial_rollout, engine.version, latency_rows)

    app = make_app(engine, tokenizer, model_name=model_name, parser=cfg.tool_parser.name,
                   extra_stop_ids=tuple(cfg.tool_parser.stop_token_ids), api_key=api_key, max_loras=max_loras,
                   adapter_engine=adapter_engine, weight_updates=weight_updates,
                   weights_root=Path(checkpoint).resolve().parent if weights_root is None else weights_root,
                   max_request_bytes=max_request_bytes, stream_interval=stream_interval)
    return app, engine


def exposure_warning(host: str, api_key: str | None, weight_updates: bool) -> str | None:
    """The warning ``serve`` prints for a host other machines may reach without a key (None when there is none)."""
    if api_key is not None or is_loopback(host):
        return None
    return (f"warning: listening on {host}, which other machines may reach, without an API key: anyone who can "
            f"connect can generate{' and replace the weights (--enable-weight-updates)' if weight_updates else ''}; "
            f"require a key with --api-key-env VAR")


def is_loopback(host: str) -> bool:
    """Whether ``host`` only accepts connections from this machine (``localhost``, 127.0.0.0/8, ``::1``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: whatever it resolves to may be reachable from elsewhere
        return False


def serve(checkpoint: str | Path, cfg: RunConfig, *, host: str = "127.0.0.1", port: int = 8000,
          model_name: str | None = None, api_key: str | None = None, api_key_env: str | None = None,
          chat_template: str | None = None, max_loras: int = 4, weight_updates: bool = False,
          weights_root: str | Path | None = None, max_request_bytes: int | None = None,
          stream_interval: int | None = None, latency_rows: int = LATENCY_ROWS,
          log: Callable[[str], None] | None = None) -> None:
    """Serve ``checkpoint`` until SIGINT / SIGTERM. The socket is bound before the model loads (a taken port
    fails at once, OSError); ``api_key_env`` only names the key's variable in the start message; ``max_loras``,
    ``weight_updates``, ``weights_root``, ``max_request_bytes``, ``stream_interval``, ``latency_rows``: ``build``'s.
    Warns when a host other than loopback is bound without a key: anyone who reaches it can generate (and, with
    ``weight_updates``, replace the weights)."""

    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    fixed_mmap_threshold()
    sock = bind(host, port)
    warning = exposure_warning(host, api_key, weight_updates)
    if warning is not None:
        log(warning)
    name = model_name or Path(checkpoint).name
    app, engine = build(checkpoint, cfg, model_name=name, api_key=api_key, chat_template=chat_template,
                        max_loras=max_loras, weight_updates=weight_updates, weights_root=weights_root,
                        max_request_bytes=max_request_bytes, stream_interval=stream_interval,
                        latency_rows=latency_rows)
    try:
        actual = sock.getsockname()[1]
        shown = f"[{host}]" if ":" in host else host
        auth = f"; bearer key from ${api_key_env} required" if api_key_env else "; no key required"
        log(f"serving model {name!r} ({checkpoint}, weight version {engine.version}) on "
            f"http://{shown}:{actual}/v1{auth}")
        server = uvicorn.Server(uvicorn_config(app, log_level="info", grace_s=5))
        heap.freeze(collect=True)  # the model, tokenizer and app out of the collector's full passes (tether.heap)
        server.run(sockets=[sock])
    finally:
        engine.close()
        sock.close()
