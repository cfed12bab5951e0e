"""The ``reward`` section: the reward loop that scores rubrics with an LLM judge (``tether.reward``).

It acts when ``environment.verifier.judge`` is ``llm``: the verifier's rule checks stay synchronous in the
environment, and the rubrics (``environment.verifier.model_based``, each with its ``prompt``) are scored by
the judge at ``judge_client`` while generation goes on (the second source document's Reward Loop, with
verl's ``LimitedRewardManager`` rate limits as ``judge_client.requests_per_minute`` / ``tokens_per_minute`` /
``max_concurrency``). With the deterministic judge (the offline default) nothing here is read, and a value
set here is reported at start (``RunConfig.warnings``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from tether.config.base import NonNegFloat, NonNegInt, PosInt, Section, _check
from tether.config.sections import LLMClientConfig

if TYPE_CHECKING:
    from tether.config.run import RunConfig


class RewardConfig(Section):
    """The reward loop and the LLM judge (read when ``environment.verifier.judge`` is ``llm``)."""

    judge_client: LLMClientConfig | None = None
    """The judge's OpenAI-compatible endpoint: base_url, model, api_key (``${VAR}``), timeout_s and max_retries
    of each request, and the endpoint's limits (max_concurrency, requests_per_minute, tokens_per_minute: token
    buckets shared by every client of that endpoint). Required with ``environment.verifier.judge: llm``.
    tether's own key (the second source document's generative reward model behind LimitedRewardManager)."""
    judge_samples: PosInt = 1
    """Judge answers per rubric and trajectory, averaged (sent as ``n`` in one request), in answers."""
    judge_temperature: NonNegFloat = 0.0
    """Sampling temperature of the judge (unitless); above 0 when judge_samples > 1, or the samples agree."""
    judge_max_tokens: PosInt = 256
    """Most tokens of one judge answer (its reasoning, then the ``SCORE:`` line), in tokens."""
    workers: PosInt = 32
    """Rubric scorings in flight at once in the reward loop (its pool of async workers), in jobs; the endpoint's
    own max_concurrency caps the HTTP requests below that."""
    cache_size: NonNegInt = 4096
    """Judge results kept, keyed by (rubric prompt, trajectory content, judge model and sampling), in entries;
    0 = no cache (every trajectory is judged)."""
    on_judge_failure: Literal["drop_group", "rule_only"] = "drop_group"
    """What a judge failure (a timeout, an HTTP error after the client's retries, an unparseable answer) does to
    the trajectory's group: drop_group — the group is delivered marked dropped and not trained
    (``reward/judge_dropped_groups``); rule_only — every trajectory of the group is scored on the rule checks
    alone, rubrics removed, so the group stays comparable (``reward/rule_only_groups``). Either way the failure
    is in the trajectory's errors and counted in ``reward/judge_failures``; it never scores as 0."""


def check_reward(cfg: RunConfig) -> None:
    """Cross-section rule: the LLM judge needs its endpoint."""
    if cfg.environment.verifier.judge == "llm" and cfg.environment.verifier.type != "rule":
        _check(cfg.reward.judge_client is not None,
               "environment.verifier.judge: llm needs the judge's endpoint: set reward.judge_client "
               "(base_url, model, and api_key as ${VAR} when the endpoint wants a key)",
               **{"environment.verifier.judge": "llm", "reward.judge_client": None})


def reward_inert(cfg: RunConfig) -> list[str]:
    """Values of this section that cannot act in ``cfg``'s run (``tether.config.inert``)."""
    v = cfg.environment.verifier
    if v.judge == "llm" and v.type != "rule":
        out = []
        r = cfg.reward
        if r.judge_samples > 1 and r.judge_temperature == 0:
            out.append(f"reward.judge_samples = {r.judge_samples} with judge_temperature = 0: the samples of a greedy "
                       "judge agree, so averaging them changes nothing; raise judge_temperature or set "
                       "judge_samples: 1")
        return out
    set_here = sorted(cfg.reward.model_fields_set)
    if not set_here:
        return []
    why = ("environment.verifier.type is rule (no rubric is scored)" if v.judge == "llm"
           else "environment.verifier.judge is deterministic (plain functions score the rubrics)")
    return [f"reward.{k} acts with the LLM judge only: {why}; set environment.verifier.judge: llm to use it"
            for k in set_here]
