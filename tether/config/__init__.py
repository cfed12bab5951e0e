"""Typed run configuration: one ``RunConfig`` whose sections cover every key of the seed configs.

Every model forbids unknown keys, documents every field (the docstring under it) and has defaults, so
``RunConfig()`` is valid and a file with one section loads. Loading, merging, ``--set`` overrides and
error messages that name the key, the file and what is allowed live in ``tether.config.io``.

Each value is held once: the seeds' second spellings of a value (``rollouter.max_queue_size``, ``trainer.class``,
…) are folded into its canonical key at load (``tether.config.aliases``).

Secrets (``api_key`` and any ``*_key`` / ``*token*`` / ``*secret*`` / ``password`` string field) are
``Secret`` values (``tether.secrets``): a literal or a ``${VAR}`` reference that is resolved only when used
(``.get()``), so validating a file needs no secret, and no dump, ``repr`` or log ever shows the value.
"""

from tether.config.agent import *  # noqa: F401,F403
from tether.config.base import *  # noqa: F401,F403
from tether.config.base import ConfigError, CrossFieldError, Secret, Section, interpolate  # noqa: F401
from tether.config.environment import *  # noqa: F401,F403
from tether.config.io import load_config  # noqa: F401
from tether.config.monitors import MonitorsConfig  # noqa: F401
from tether.config.policy import *  # noqa: F401,F403
from tether.config.run import RunConfig  # noqa: F401
from tether.config.sections import *  # noqa: F401,F403
