"""The reward loop and the LLM judge of the verifier's rubrics (``environment.verifier.judge: llm``).

Files: ``loop.py`` (``RewardLoop``: async workers, cache, failure policy), ``judge_llm.py`` (``LLMJudge``: a
rubric prompt → a score through ``tether.llm``), ``rubrics.py`` (the prompt's answer format and its strict
parser), ``stub.py`` (a stub OpenAI-compatible chat server for dry runs, tests and benchmarks).

Layer: above ``env`` (it reads ``tether.env.verifier``'s ``PendingRubrics``) and ``llm``, below ``pipeline``,
whose Rollouter hands each finished trajectory to the loop (``tether.pipeline.rollouter``).
"""

from tether.reward.judge_llm import LLMJudge
from tether.reward.loop import RewardLoop, RewardLoopStats
from tether.reward.rubrics import UnparseableJudgeAnswer, parse_score

__all__ = ["LLMJudge", "RewardLoop", "RewardLoopStats", "UnparseableJudgeAnswer", "parse_score"]
