"""The OpenAI-compatible client: rate limits shared per endpoint, retries, and errors that say what to check.

    client = LLMClient.from_config(cfg.llm_client)            # or LLMClient(base_url, api_key, model, ...)
    reply = await client.chat([{"role": "user", "content": "ping"}], max_tokens=8)
    ids = await client.completions([151644, 872, 198], max_tokens=16, logprobs=1, return_token_ids=True)
    await client.post("/update_weights_from_disk", {"model_path": path})   # at the server root

Files: ``client.py`` (``LLMClient``: requests, retries, the diagnosis of each answer), ``limits.py`` (concurrency
cap and token buckets shared by every client of an endpoint), ``keys.py`` (the key, read from the environment
at each request), ``errors.py`` (the taxonomy, redaction).

**httpx, not the ``openai`` package.** tether's remote engine is token-in/token-out: it sends vLLM/SGLang
extensions (``prompt`` as token ids, ``return_token_ids``, ``stop_token_ids``) and root endpoints outside the
OpenAI API (``/update_weights_from_disk``, ``/health``); it needs the raw body of a bad answer to diagnose it
(a 200 without ``choices``, a body cut off mid-transfer), and one retry/limit policy it owns (the SDK retries
on its own schedule, hides Retry-After handling and raises its own exception types). The SDK can pass extra
fields (``extra_body``) but every answer goes through its typed models, and partial bodies and root paths are
out of its reach. httpx is what the SDK itself is built on, so connection behaviour (pooling, proxies from
``HTTP(S)_PROXY``/``NO_PROXY``, timeouts) is the same. The ``openai`` package remains a test dependency: the tests
of ``tether serve`` drive the server with it, which is what proves the protocol is compatible.

Layer: ``llm`` sits at the bottom beside ``engine``; it imports ``tether.metrics`` and ``tether.secrets`` only
(the one ``${VAR}`` interpolator and ``Secret``; an endpoint's errors name its config section, e.g.
``reward.judge_client.api_key``, from the section's ``key_path``). Metrics: ``llm/retries`` and ``llm/failures``
(sums), ``llm/latency_s`` (mean, successful calls).
"""

from tether.llm.client import ClientStats, LLMClient
from tether.llm.errors import (
                               AuthError,
                               BadRequest,
                               ConnectionRefused,
                               EndpointUnreachable,
                               LLMError,
                               LLMTimeout,
                               MalformedKey,
                               MalformedResponse,
                               MissingKey,
                               RateLimited,
                               ServerError,
)
from tether.llm.limits import EndpointLimits, SharedGate, TokenBucket, limits_for

__all__ = [
    "AuthError", "BadRequest", "ClientStats", "ConnectionRefused", "EndpointLimits", "EndpointUnreachable",
    "LLMClient", "LLMError", "LLMTimeout", "MalformedKey", "MalformedResponse", "MissingKey", "RateLimited",
    "ServerError", "SharedGate", "TokenBucket", "limits_for",
]
