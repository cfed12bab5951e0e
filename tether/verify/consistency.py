"""``tether verify consistency CHECKPOINT``: is the policy served the policy trained? (issue 14 item 4)

The source document's step 4.4: run one batch of tasks through the training environment and through the
deployment, compare the action sequences; the action match rate must be above 90 %, else the tokenizer, the tool
schemas or the context packing differ between training and deployment.

The same tasks (the first ``--tasks`` of the split, same task ids, same environment seeds) are played greedily
twice (``consistency_paths``): by the training path (the agent loop, token-in/token-out on a local engine) and
by the deployment path (``tether serve`` on this checkpoint, started in-process on a free port, driven over HTTP
by an OpenAI chat client: text messages and tool schemas in, tool calls parsed by the server out). Both engines
run ``trainer.deterministic`` (each request computed on its own), so that a difference comes from what the paths
give the model, not from which requests shared a batch.

**Action match rate.** For each task the two action sequences are compared turn by turn from the first; the
task's *matched* actions are the turns before the first that differs (its common prefix: once the actions differ
the episodes differ, and a later agreement is chance), its *compared* actions the longer sequence's length (a
turn one path took and the other did not is a mismatch). The rate is Σ matched / Σ compared over the tasks; it
passes when above 0.9.

**Diagnosis** of the first divergence (the first task, in task order, whose sequences differ, at its first
differing turn; the earlier turns matched, so both paths were at the same point of the same episode): the turn's
two prompts and settings are compared, and the cause named is the first of
- *tokenizer*: the prompts are the same text but different token ids;
- *tool schema rendering*: the prompts' texts first differ inside the tools part of the training prompt (located by
  rendering the episode's opening messages with and without the tools);
- *chat template*: they first differ elsewhere;
- *sampling settings*: same prompt ids, different temperature, top_p, max_tokens or stop ids;
- *generation*: same prompt and settings, different tokens (engine numerics);
- *tool-call parsing*: same tokens, read as different actions.
Each prompt difference is shown at its first differing token, decoded on both sides.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tether.agent.loop import AgentLoopBase
from tether.agent.parsers import get_parser
from tether.config import RunConfig
from tether.llm import LLMClient
from tether.pipeline.rollouter import episode_seed
from tether.runtime import Runtime, sampling_params
from tether.serve.http import ServerThread
from tether.serve.server import build
from tether.verify.consistency_paths import DeployClient, Episode, Settings, Turn, training_episode

THRESHOLD = 0.9
SPLITS = {"heldout": "eval", "train": "train"}


@dataclass
class TaskResult:
    task_id: str
    train: Episode
    deploy: Episode

    @property
    def matched(self) -> int:
        n = 0
        for a, b in zip(self.train.turns, self.deploy.turns):
            if a.action != b.action:
                break
            n += 1
        return n

    @property
    def compared(self) -> int:
        return max(len(self.train.turns), len(self.deploy.turns))


@dataclass
class Diagnosis:
    task_id: str
    turn: int  # 0-based
    cause: str  # tokenizer | tool schema rendering | chat template | sampling settings | generation | tool-call parsing
    detail: list[str] = field(default_factory=list)  # the evidence, one line each; other findings after the cause


@dataclass
class ConsistencyReport:
    results: list[TaskResult]
    diagnosis: Diagnosis | None  # of the first turn whose actions differ
    seconds: float
    prompt_pairs: int = 0  # turns both paths took at the same point of an episode (first_prompt_difference)
    same_prompts: int = 0  # of them, with token-identical prompts
    prompt_diff: Diagnosis | None = None  # the first of them whose prompts differ

    @property
    def matched(self) -> int:
        return sum(r.matched for r in self.results)

    @property
    def compared(self) -> int:
        return sum(r.compared for r in self.results)

    @property
    def rate(self) -> float:
        return self.matched / self.compared if self.compared else 0.0

    @property
    def passed(self) -> bool:
        return self.compared > 0 and self.rate > THRESHOLD


# ------------------------------------------------------------------------------------------------- running


def check_consistency(checkpoint: str | Path, cfg: RunConfig, *, num_tasks: int = 8, split: str = "heldout",
                      chat_template: str | None = None, deploy_sampling: dict[str, Any] | None = None,
                      log: Callable[[str], None] | None = None) -> ConsistencyReport:
    """Play the first ``num_tasks`` tasks of ``split`` through both paths and compare them (module docstring).

    chat_template: the serving template (``tether serve --chat-template``), default the checkpoint's own.
    deploy_sampling: overrides of the deployment requests' ``temperature`` / ``top_p`` / ``max_tokens`` (default:
        the training path's greedy settings, ``engine.max_tokens``)."""

    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    if split not in SPLITS:
        raise ValueError(f"--split {split!r}: choose one of {sorted(SPLITS)}")
    cfg = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"deterministic": True})})
    t0 = time.perf_counter()
    rt = Runtime.build(cfg, str(checkpoint))
    try:
        tasks = rt.tasks(SPLITS[split])[:num_tasks]
        if not tasks:
            raise ValueError(f"the {split} split of environment {cfg.environment.name!r} has no tasks")
        log(f"training path: {len(tasks)} {split} tasks through the agent loop (local engine, greedy)")
        loop = rt.loop(greedy=True)
        train = asyncio.run(_training_path(rt, loop, tasks))
    finally:
        rt.close()
    greedy = sampling_params(cfg.engine, greedy=True)
    request = {"temperature": greedy.temperature, "top_p": greedy.top_p, "max_tokens": greedy.max_tokens,
               **(deploy_sampling or {})}
    app, engine = build(checkpoint, cfg, model_name="policy", api_key=None, chat_template=chat_template)
    try:
        with ServerThread(app) as server:
            log(f"deployment path: tether serve on {server.base_url}, OpenAI chat with tools "
                f"(temperature {request['temperature']}, top_p {request['top_p']}, max_tokens {request['max_tokens']})")
            client = LLMClient(server.base_url + "/v1", model="policy", timeout_s=600.0, max_retries=0)
            stop_ids = tuple(sorted(app.state.generator.chat_stop_ids))
            deploy = DeployClient(client, loop.limits, request, stop_ids)
            episodes = asyncio.run(_deployment_path(deploy, rt, tasks, cfg.rollout.worker.max_concurrent_tasks))
    finally:
        engine.close()
    results = [TaskResult(t.id, a, b) for t, a, b in zip(tasks, train, episodes)]
    first = next((r for r in results if r.matched < r.compared), None)
    diagnosis = None if first is None else diagnose(first, rt.tokenizer)
    pairs, same, prompt_diff = first_prompt_difference(results, rt.tokenizer)
    return ConsistencyReport(results, diagnosis, time.perf_counter() - t0, pairs, same, prompt_diff)


async def _training_path(rt: Runtime, loop: AgentLoopBase, tasks: list[Any]) -> list[Episode]:
    seed, limit = rt.cfg.trainer.seed, asyncio.Semaphore(rt.cfg.rollout.worker.max_concurrent_tasks)
    settings = Settings(loop.sampling.temperature, loop.sampling.top_p, loop.sampling.max_tokens, loop.stop_ids)
    parse = get_parser(rt.cfg.tool_parser.name)

    async def one(task: Any) -> Episode:
        async with limit:
            env = rt.make_env()
            try:
                traj = await loop.run(task, env, seed=episode_seed(seed, task.id, 0))
                return training_episode(traj, env, task, tokenizer=rt.tokenizer, parse=parse, settings=settings,
                                        limits=loop.limits)
            finally:
                env.close()

    return list(await asyncio.gather(*(one(t) for t in tasks)))


async def _deployment_path(deploy: DeployClient, rt: Runtime, tasks: list[Any], concurrency: int) -> list[Episode]:
    limit = asyncio.Semaphore(concurrency)

    async def one(task: Any) -> Episode:
        async with limit:
            env = rt.make_env()
            try:
                return await deploy.play(env, task)
            finally:
                env.close()

    try:
        return list(await asyncio.gather(*(one(t) for t in tasks)))
    finally:
        await deploy.client.aclose()


# ----------------------------------------------------------------------------------------------- diagnosis


def diagnose(result: TaskResult, tokenizer: Any) -> Diagnosis:
    """Why the first differing turn of ``result`` differs (module docstring)."""
    k = result.matched
    a = result.train.turns[k] if k < len(result.train.turns) else None
    b = result.deploy.turns[k] if k < len(result.deploy.turns) else None
    if a is None or b is None:  # one path stopped: its last turn ended the episode, the other's did not
        missing = "training" if a is None else "deployment"
        detail = [f"the {missing} path took no turn {k + 1}"]
        if result.deploy.error:
            detail.append(f"the deployment episode stopped on: {result.deploy.error}")
        return Diagnosis(result.task_id, k, "episode length", detail)
    return diagnose_turn(result, k, tokenizer)


def diagnose_turn(result: TaskResult, k: int, tokenizer: Any) -> Diagnosis:
    """The cause first, the other findings after, for turn ``k`` (0-based), which both paths took."""
    a, b = result.train.turns[k], result.deploy.turns[k]
    causes: list[tuple[str, list[str]]] = []
    if a.prompt_ids != b.prompt_ids:
        causes.append(_prompt_cause(a, b, result.train, tokenizer))
    settings = _settings_diff(a.settings, b.settings)
    if settings:
        causes.append(("sampling settings", settings))
    if not causes and a.output_ids != b.output_ids:
        i = _first_diff(a.output_ids, b.output_ids)
        causes.append(("generation", [
            f"same prompt ids and sampling settings, yet the generated tokens differ at token {i}: training "
            f"{_show(tokenizer, a.output_ids, i)} vs deployment {_show(tokenizer, b.output_ids, i)} "
            f"(engine numerics)"]))
    if not causes:
        causes.append(("tool-call parsing", ["same prompt, settings and generated tokens, read as different actions "
                                             "(the server's parser vs the agent loop's)"]))
    diag = Diagnosis(result.task_id, k, *causes[0])
    for cause, lines in causes[1:]:
        diag.detail += [f"also {cause}: {line}" for line in lines]
    return diag


def first_prompt_difference(results: list[TaskResult], tokenizer: Any) -> tuple[int, int, Diagnosis | None]:
    """Over the turns both paths took at the same point of an episode (every turn up to and including each task's
    first differing one): how many, how many had token-identical prompts, and the diagnosis of the first that did
    not (task order, then turn). Actions can agree on different prompts: a robust policy hides a difference that a
    less robust one will not."""
    pairs = same = 0
    first = None
    for r in results:
        for k in range(min(r.matched + 1, len(r.train.turns), len(r.deploy.turns))):
            pairs += 1
            if r.train.turns[k].prompt_ids == r.deploy.turns[k].prompt_ids:
                same += 1
            elif first is None:
                first = diagnose_turn(r, k, tokenizer)
    return pairs, same, first


def _prompt_cause(a: Turn, b: Turn, train: Episode, tokenizer: Any) -> tuple[str, list[str]]:
    i = _first_diff(a.prompt_ids, b.prompt_ids)
    where = (f"the prompts differ from token {i} (training {len(a.prompt_ids)} tokens, deployment "
             f"{len(b.prompt_ids)})")
    shown = f"training {_show(tokenizer, a.prompt_ids, i)} vs deployment {_show(tokenizer, b.prompt_ids, i)}"
    text_a = tokenizer.decode(a.prompt_ids, skip_special_tokens=False)
    text_b = tokenizer.decode(b.prompt_ids, skip_special_tokens=False)
    if text_a == text_b:
        return "tokenizer", [f"{where} but decode to the same text: {shown}"]
    c = _first_diff(text_a, text_b)
    lo = max(0, c - 20)
    context = f"at character {c}: training {text_a[lo:c + 40]!r} vs deployment {text_b[lo:c + 40]!r}"
    start, end = _tools_span(tokenizer, train)
    if start <= c < end:
        return "tool schema rendering", [f"{where}, inside the tools part of the prompt (characters {start}-{end}): "
                                         f"{shown}", context]
    return "chat template", [f"{where}, outside the tools part: {shown}", context]


def _tools_span(tokenizer: Any, ep: Episode) -> tuple[int, int]:
    """Characters [start, end) of a prompt's text that the tools add: the opening messages rendered by the training
    tokenizer's template with and without them differ there (a prefix-stable template keeps it in later turns)."""
    if not ep.tools:
        return 0, 0
    with_tools = tokenizer.apply_chat_template(ep.header, tools=ep.tools, add_generation_prompt=True, tokenize=False)
    without = tokenizer.apply_chat_template(ep.header, tools=None, add_generation_prompt=True, tokenize=False)
    start = _first_diff(with_tools, without)
    suffix = 0
    while (suffix < len(with_tools) - start and suffix < len(without) - start
           and with_tools[-1 - suffix] == without[-1 - suffix]):
        suffix += 1
    return start, len(with_tools) - suffix


def _settings_diff(a: Settings, b: Settings) -> list[str]:
    return [f"{name} training {getattr(a, name)} vs deployment {getattr(b, name)}"
            for name in ("temperature", "top_p", "max_tokens", "stop_ids") if getattr(a, name) != getattr(b, name)]


def _first_diff(a: Any, b: Any) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _show(tokenizer: Any, ids: list[int], i: int, n: int = 6) -> str:
    return f"{ids[i:i + n]} {tokenizer.decode(ids[i:i + n], skip_special_tokens=False)!r}"


# ------------------------------------------------------------------------------------------------- output


def _action_text(turn: Turn | None) -> str:
    if turn is None:
        return "(no turn)"
    if not turn.action:
        return "(no action)"
    return "; ".join(f"{name} {args}" for name, args in turn.action)


def render(report: ConsistencyReport, echo: Callable[[str], None] = print) -> None:
    echo(f"{'task':<14} {'matched/compared':>16}  first divergence")
    for r in report.results:
        where = "-" if r.matched == r.compared else f"turn {r.matched + 1}"
        echo(f"{r.task_id:<14} {f'{r.matched}/{r.compared}':>16}  {where}")
    verdict = "PASS" if report.passed else "FAIL"
    echo(f"action match rate {report.matched}/{report.compared} = {report.rate:.3f} (must be > {THRESHOLD}): "
         f"{verdict}  [{len(report.results)} tasks, {report.seconds:.0f} s]")
    echo(f"prompts token-identical on {report.same_prompts} of {report.prompt_pairs} turns the two paths took at "
         f"the same point of an episode")
    p = report.prompt_diff
    if p is not None and (report.diagnosis is None or (p.task_id, p.turn) != (report.diagnosis.task_id,
                                                                               report.diagnosis.turn)):
        echo(f"first prompt difference: task {p.task_id}, turn {p.turn + 1} (the actions still agreed): {p.cause}")
        for line in p.detail:
            echo(f"  {line}")
    d = report.diagnosis
    if d is None:
        return
    r = next(r for r in report.results if r.task_id == d.task_id)
    turn_a = r.train.turns[d.turn] if d.turn < len(r.train.turns) else None
    turn_b = r.deploy.turns[d.turn] if d.turn < len(r.deploy.turns) else None
    echo(f"first divergence: task {d.task_id}, turn {d.turn + 1}")
    echo(f"  training:   {_action_text(turn_a)}")
    echo(f"  deployment: {_action_text(turn_b)}")
    echo(f"cause: {d.cause}")
    for line in d.detail:
        echo(f"  {line}")


def exit_code(report: ConsistencyReport) -> int:
    return 0 if report.passed else 1

