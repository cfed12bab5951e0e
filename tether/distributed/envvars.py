"""The environment variables each actor is given explicitly (Ray ``runtime_env={"env_vars": ...}``).

An actor's process is started by the cluster's raylet, not by this process: on a cluster started elsewhere (or
before a variable was exported here) it does not see this process's environment, and a key read there is missing —
the source document's "401 Unauthorized ... Ray Actor 有时拿不到父进程的环境变量，需要在启动脚本里显式传". So the
driver passes, by name, the variables the actors may read: those the config's secrets reference
(``llm_client.api_key: ${VAR}`` and any other ``Secret``), every ``TETHER_*`` variable (cache, faults), the
thread-count and Hugging Face offline variables, and the names in ``ray.env_vars``. Only the names are ever
logged; the values travel in the runtime environment and are never written to the run directory.
"""

from __future__ import annotations

import os
import re

from pydantic import BaseModel

from tether.config import RunConfig, Secret

PASSED_THROUGH = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "HF_HOME", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
                  "TOKENIZERS_PARALLELISM")
_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def secret_variables(model: BaseModel) -> list[str]:
    """The environment variables referenced by the secrets anywhere in ``model`` (``${VAR}``), in field order."""
    out: list[str] = []
    for name in type(model).model_fields:
        value = getattr(model, name)
        if isinstance(value, Secret):
            out += _REF.findall(value.redacted())  # a literal secret shows as *** and names no variable
        elif isinstance(value, BaseModel):
            out += secret_variables(value)
    return list(dict.fromkeys(out))


def actor_env_names(cfg: RunConfig) -> list[str]:
    """Every variable name an actor is given, set or not in this process."""
    tether = sorted(k for k in os.environ if k.startswith("TETHER_"))
    return list(dict.fromkeys([*secret_variables(cfg), *tether, *PASSED_THROUGH, *cfg.ray.env_vars]))


def actor_env_vars(cfg: RunConfig) -> dict[str, str]:
    """``{name: value}`` of the names of ``actor_env_names`` that are set in this process."""
    return {k: os.environ[k] for k in actor_env_names(cfg) if k in os.environ}
