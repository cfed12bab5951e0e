"""Environments users bring: the plugin API.

    registry.py   ``environment.name`` → an environment: registered name, ``module:attribute``, the
                  ``tether.environments`` entry-point group, ``tau2:<domain>`` (lazy)
    functions.py  tools from plain functions (schemas by transformers' ``get_json_schema``), bound to the
                  config's ``action_space`` and checked against their signatures
    tasks.py      tasks from a JSONL / YAML file or a function, train and held-out (``eval``) splits
    env.py        ``ToolEnvironment`` (what a user writes) and ``ToolEnv`` (its episodes: the ``Env`` protocol)

``examples/custom_env/`` is a complete one in under 100 lines.
"""

from tether.env.plugin.env import SENT, EpisodeEndedError, ToolEnv, ToolEnvironment, environment_config
from tether.env.plugin.functions import bind, function_schema
from tether.env.plugin.registry import ENTRY_POINT_GROUP, ENVIRONMENTS, EnvironmentNotFound, register, resolve
from tether.env.plugin.tasks import TaskFileError, load_task_file, tasks_from

__all__ = ["ENTRY_POINT_GROUP", "ENVIRONMENTS", "SENT", "EnvironmentNotFound", "EpisodeEndedError", "TaskFileError",
           "ToolEnv", "ToolEnvironment", "bind", "environment_config", "function_schema", "load_task_file", "register",
           "resolve", "tasks_from"]
