"""Scoring a finished tau2 episode with tau2's own evaluator, and the no-op-pass check.

``score`` hands the episode's messages (tau2 ``Message`` objects, exactly what tau2's orchestrator would have
recorded) and its termination reason to ``tau2.evaluator.evaluator.evaluate_simulation`` (its environments built
by tau2's own constructor from the database parsed once: ``_load.evaluator_domain``): the reward is tau2's
(0 unless the episode ended by a stop; otherwise the product of the components in the task's ``reward_basis``:
the database replay check, env assertions, gold actions, communicated info, NL assertions). The components tau2
reports (``reward_breakdown``) become tether's ``reward_components`` under short names (``db``,
``env_assertion``, ``action``, ``communicate``, ``nl``).

**NL assertions** are judged by an LLM. With a judge (``environment.verifier.judge: llm`` at
``reward.judge_client``, or ``judge=`` in code) tau2's own NL evaluator runs, its prompt and parsing
unchanged, with its model call answered by the judge instead of litellm. Without one, a task whose basis holds
``NL_ASSERTION`` is scored on its other components, ``nl`` is listed in ``skipped``
(``info["skipped_components"]``) and the episode never counts as a success.
(In tau2 26.3's mock, retail and airline data no task has ``NL_ASSERTION`` in its basis; tasks carry
``nl_assertions`` as notes only.)

tau2's evaluator raises where an env assertion names a record the episode never created (mock's
``create_task_1_with_env_assertions`` after a do-nothing episode); tau2's runner then fails the simulation. Here
the episode scores 0 with the exception in ``note``, so that one bad episode does not stop a training run.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tether.env.tau2._load import evaluator_domain, load

COMPONENTS = {"DB": "db", "ENV_ASSERTION": "env_assertion", "ACTION": "action", "COMMUNICATE": "communicate",
              "NL_ASSERTION": "nl"}
Judge = Callable[[list[dict[str, Any]]], str]  # OpenAI-style messages -> the judge's reply text

_local = threading.local()
_patch_lock = threading.Lock()


@dataclass
class Score:
    reward: float  # tau2's reward (over the evaluated components)
    components: dict[str, float] = field(default_factory=dict)  # tether names -> tau2's component reward
    basis: list[str] = field(default_factory=list)  # the task's reward_basis (tau2 names)
    skipped: list[str] = field(default_factory=list)  # components of the basis not evaluated (nl without judge)
    note: str | None = None  # tau2's note (e.g. a premature termination)

    @property
    def passed(self) -> bool:
        """tau2's pass (reward 1), and nothing of the basis skipped."""
        return self.reward >= 1.0 - 1e-9 and not self.skipped


def _route_nl_judge() -> None:
    """Make tau2's NL-assertion evaluator ask the judge of the current thread (``_local.judge``) when one is
    set; otherwise tau2's own litellm call runs as before."""
    from tau2.evaluator import evaluator_nl_assertions as nl  # noqa: PLC0415 — the optional extra ``tau2``

    with _patch_lock:
        if getattr(nl.generate, "_tether_routed", False):
            return
        original = nl.generate

        def generate(model: str, messages: list[Any], **kwargs: Any) -> Any:
            judge = getattr(_local, "judge", None)
            if judge is None:
                return original(model=model, messages=messages, **kwargs)
            from tau2.data_model.message import AssistantMessage  # noqa: PLC0415 — the optional extra ``tau2``

            text = judge([{"role": m.role, "content": m.content} for m in messages])
            return AssistantMessage(role="assistant", content=text)

        generate._tether_routed = True  # type: ignore[attr-defined]
        nl.generate = generate


def score(domain: str, task: Any, messages: list[Any], termination: str, *, solo: bool,
          judge: Judge | None = None) -> Score:
    """tau2's evaluation of one episode. ``termination``: a ``TerminationReason`` value (``user_stop``,
    ``agent_stop``, ``max_steps``, ``too_many_errors``, ``agent_error``, ...)."""
    load()
    from tau2.data_model.simulation import SimulationRun, TerminationReason  # noqa: PLC0415 — the optional extra ``tau2``
    from tau2.data_model.tasks import RewardType  # noqa: PLC0415 — the optional extra ``tau2``
    from tau2.evaluator.evaluator import EvaluationType, evaluate_simulation  # noqa: PLC0415 — the optional extra ``tau2``

    criteria = task.evaluation_criteria
    basis = [b.value for b in criteria.reward_basis] if criteria is not None else []
    skipped: list[str] = []
    etype = EvaluationType.ALL
    if RewardType.NL_ASSERTION.value in basis:
        if judge is None:
            skipped = ["nl"]
            task = task.model_copy(deep=True)
            task.evaluation_criteria.reward_basis = [b for b in task.evaluation_criteria.reward_basis
                                                     if b != RewardType.NL_ASSERTION]
        else:
            etype = EvaluationType.ALL_WITH_NL_ASSERTIONS
            _route_nl_judge()
    run = SimulationRun(id=str(uuid.uuid4()), task_id=task.id, start_time="", end_time="", duration=0.0,
                        termination_reason=TerminationReason(termination), messages=messages)
    _local.judge = judge
    try:
        info = evaluate_simulation(run, task, etype, solo_mode=solo, domain=evaluator_domain(domain))
    except Exception as e:  # noqa: BLE001 — e.g. an env assertion about a record the episode never created raises in tau2
        return Score(0.0, {}, basis, skipped, f"tau2's evaluator raised {type(e).__name__}: {e}")
    finally:
        _local.judge = None
    components = {COMPONENTS.get(getattr(k, "value", str(k)), str(k)).lower(): float(v)
                  for k, v in (info.reward_breakdown or {}).items()}
    note = (info.info or {}).get("note") if isinstance(info.info, dict) else None
    return Score(float(info.reward), components, basis, skipped, note)


def db_digest(env: Any) -> tuple[str | None, str | None]:
    """The agent-side and user-side database hashes of a tau2 ``Environment`` (tau2's ``get_db_hash``)."""
    return env.get_db_hash(), env.get_user_db_hash()
