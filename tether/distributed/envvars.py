"""The environment variables each actor is given explicitly.

An actor's process is started by the cluster's raylet, not by this process: on a cluster started elsewhere (or
before a variable was exported here) it does not see this process's environment, and a key read there is missing —
the source document's "401 Unauthorized ... Ray Actor 有时拿不到父进程的环境变量，需要在启动脚本里显式传". So the
driver passes, by name, the variables the actors may read: those the config's secrets reference
(``llm_client.api_key: ${VAR}`` and any other ``Secret``), every ``TETHER_*`` variable (cache, faults), the
thread-count and Hugging Face offline variables, and the names in ``ray.env_vars``. Only the names are ever
logged. The thread-count variables travel in the actor's Ray runtime environment (they must be set before torch is
imported); every other value is handed to the actor's constructor and set in its environment first thing
(``apply_env``), because Ray's runtime-env agent writes a runtime environment's ``env_vars``, values included, to
its log files (``runtime_env_agent.log``): an API key must not travel that way.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

PASSED_THROUGH = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "HF_HOME", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
                  "TOKENIZERS_PARALLELISM")


def actor_env_names(secret_variables: Sequence[str], extra: Sequence[str] = ()) -> list[str]:
    """Every variable name an actor is given, set or not in this process: the config's secrets' variables
    (``Plan.secret_variables``), every ``TETHER_*``, ``PASSED_THROUGH`` and ``extra`` (``ray.env_vars``)."""
    tether = sorted(k for k in os.environ if k.startswith("TETHER_"))
    return list(dict.fromkeys([*secret_variables, *tether, *PASSED_THROUGH, *extra]))


def actor_env_vars(secret_variables: Sequence[str], extra: Sequence[str] = ()) -> dict[str, str]:
    """``{name: value}`` of the names of ``actor_env_names`` that are set in this process."""
    return {k: os.environ[k] for k in actor_env_names(secret_variables, extra) if k in os.environ}


def runtime_env(env: dict[str, str]) -> dict[str, dict[str, str]]:
    """The Ray runtime environment of an actor given ``env``: the thread-count variables only (Ray logs the
    values of a runtime environment's variables; these are not secrets and must precede torch's import)."""
    return {"env_vars": {k: v for k, v in env.items() if k in PASSED_THROUGH}}


def apply_env(env: dict[str, str]) -> None:
    """In an actor, first thing: set the variables the driver handed over (``actor_env_vars``)."""
    os.environ.update(env)
