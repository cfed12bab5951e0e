"""An arithmetic taskset written against verifiers 0.4.0 (``verifiers.v1``), trained by tether (config.yaml).

The rows are made here (no dataset download); each task is scored by verifiers itself: ``correct`` — the reply's
``\\boxed{}`` answer (or its last number) checked with verifiers' ``verify_boxed_math_answer`` — and
``shows_a_number`` (weight 0.1), so that an untrained policy's group has some spread.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator

import verifiers.v1 as vf

from tether.programs.verifiers import VerifiersTaskset

SYSTEM = "Answer with the result only, as \\boxed{N}."
NUMBER = re.compile(r"-?\d+")


class ArithData(vf.TaskData):
    answer: str


class ArithTask(vf.Task[ArithData, vf.State]):
    @vf.reward
    async def correct(self, task: ArithData, trace: vf.Trace) -> float:
        reply = trace.last_reply or ""
        boxed = vf.extract_boxed_answer(reply, strict=True)
        numbers = NUMBER.findall(reply)
        answer = boxed or (numbers[-1] if numbers else "")
        return 1.0 if answer and vf.verify_boxed_math_answer(f"\\boxed{{{answer}}}", task.answer) else 0.0

    @vf.reward(weight=0.1)
    async def shows_a_number(self, trace: vf.Trace) -> float:
        return 1.0 if NUMBER.search(trace.last_reply or "") else 0.0


class ArithTaskset(vf.Taskset[ArithTask]):
    """Sums and products of two small numbers, ``size`` of them, seeded."""

    def __init__(self, config: vf.TasksetConfig | None = None, *, size: int = 64, seed: int = 0):
        super().__init__(config or vf.TasksetConfig())
        self.size, self.seed = size, seed

    def load(self) -> Iterator[ArithTask]:
        rng = random.Random(self.seed)
        for i in range(self.size):
            a, b, op = rng.randint(1, 20), rng.randint(1, 20), rng.choice("+*")
            yield ArithTask(ArithData(id=f"arith-{i}", prompt=f"What is {a} {op} {b}?", system_prompt=SYSTEM,
                                      answer=str(a + b if op == "+" else a * b)))


bridge = VerifiersTaskset(ArithTaskset())  # environment.name: arith:bridge
agent = bridge.agent  # agent_loop.program: arith:agent
