"""The Rollouter: runs agent loops concurrently against one engine and returns finished groups.

Every trajectory gets its own environment instance (its own database copy) and a seed derived from
(run seed, task id, index in group), so a rollout is reproducible whatever else runs beside it.
``max_concurrent`` bounds how many episodes are in flight at once (``rollout.worker.max_concurrent_tasks``);
``num_workers`` bounds how many of them execute an environment step (tool calls, user simulator, verifier)
at once (``rollout.worker.num_workers``): the others wait for a free worker, as episodes would for a pool
of sandboxes. Generation is not counted against workers: the engine batches it.

**Failed episodes.** What the model writes never fails an episode (the parser and the tools turn it into error
observations). An exception from the environment, the verifier, the engine or the loop itself, or a timeout,
does: the episode is retried ``retries`` times with a fresh environment, then given up, logged and counted
once as ``rollout/episode_failures/<cause>`` (``timeout``, ``env``, ``verifier``, ``engine``, ``agent_loop``;
``teacher`` when the teacher loop could not score a finished episode: not retried, the episode is left out).
A group keeps the episodes that finished (a failed one has no reward to compare with: it is not trained on
as a zero), so one broken episode never stops the run. Only when *every* episode of a ``group`` (or of a
``groups`` call) failed is ``RolloutError`` raised: then the failure is systematic, not the episode's.
**Rewards by a judge** (``verifier.judge: llm``): the episode's rubrics are scored by the reward loop
(``rewards``, ``tether.reward``) as soon as the episode ends, while the other episodes keep generating;
``GroupProducer`` settles a judge failure by ``reward.on_judge_failure``, ``groups`` by the rule checks alone.
Evaluation asks for ``keep_failed``: a failed episode stays in its place as an unsuccessful trajectory whose
``termination`` is ``failed:<cause>``. The one exception: ``StopRun`` (an environment configured to stop the run on
a fault, e.g. ``environment.openenv.on_server_death: stop``) is neither retried nor counted, it ends the run.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from tether.agent.loop import AgentLoopBase
from tether.env.base import Env
from tether.errors import StopRun
from tether.metrics import record_metric
from tether.pipeline.staleness import mask_older_segments
from tether.reward.loop import RewardLoop
from tether.types import Group, Task, Trajectory

log = logging.getLogger(__name__)


def episode_seed(seed: int, task_id: str, index: int) -> int:
    digest = hashlib.blake2b(f"{seed}:{task_id}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF


class WorkerPool:
    """``num_workers`` environment-step slots, shared by every episode of a Rollouter (one semaphore per
    event loop: a Rollouter may be driven from several loops, e.g. one ``asyncio.run`` per sync batch)."""

    def __init__(self, num_workers: int):
        if num_workers < 1:
            raise ValueError(f"rollout.worker.num_workers must be >= 1, got {num_workers}")
        self.num_workers = num_workers
        self._sems: dict[asyncio.AbstractEventLoop, asyncio.Semaphore] = {}

    def slot(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if loop not in self._sems:
            self._sems = {lp: s for lp, s in self._sems.items() if not lp.is_closed()}
            self._sems[loop] = asyncio.Semaphore(self.num_workers)
        return self._sems[loop]


class EpisodeFailure(RuntimeError):
    """An exception from the environment (or the verifier it runs), tagged with where it happened."""

    def __init__(self, cause: str, error: Exception):
        super().__init__(f"{type(error).__name__}: {error}")
        self.cause = cause


class EpisodeEnv:
    """One episode's environment as the agent loop sees it: ``astep`` runs on a worker of the pool (when
    there is one), and every exception the env raises comes out as an ``EpisodeFailure`` naming its cause
    (``finalize`` scores the episode: ``verifier``; anything else: ``env``)."""

    def __init__(self, env: Env, pool: WorkerPool | None = None):
        self._env, self._pool = env, pool

    async def astep(self, action):
        try:
            if self._pool is None:
                return await self._env.astep(action)
            async with self._pool.slot():
                return await self._env.astep(action)
        except StopRun:
            raise
        except Exception as e:
            raise EpisodeFailure("env", e) from e

    def finalize(self, termination: str):
        try:
            return self._env.finalize(termination)
        except StopRun:
            raise
        except Exception as e:
            raise EpisodeFailure("verifier", e) from e

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._env, name)
        if not callable(value):
            return value

        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return value(*args, **kwargs)
            except StopRun:
                raise
            except Exception as e:
                raise EpisodeFailure("env", e) from e

        return call


PooledEnv = EpisodeEnv  # its earlier name


def failure_cause(error: BaseException) -> str:
    """``EpisodeFailure``'s cause; otherwise ``engine`` when raised inside ``tether.engine``, else ``agent_loop``."""
    if isinstance(error, EpisodeFailure):
        return error.cause
    tb, module = error.__traceback__, ""
    while tb is not None:  # the innermost tether frame is where it was raised
        name = tb.tb_frame.f_globals.get("__name__", "")
        module = name if name.startswith("tether.") else module
        tb = tb.tb_next
    return "engine" if module.startswith("tether.engine") else "agent_loop"


class RolloutError(RuntimeError):
    """An episode failed on every attempt (``cause``: why the last one did), or every episode of a group did."""

    def __init__(self, message: str, cause: str = "agent_loop"):
        super().__init__(message)
        self.cause = cause


def failed_trajectory(task: Task, error: RolloutError) -> Trajectory:
    """The place of a failed episode in an evaluation: unsuccessful, no tokens, the reason in ``errors``."""
    return Trajectory(task_id=task.id, prompt_ids=[], termination=f"failed:{error.cause}", errors=[str(error)])


class Rollouter:
    def __init__(self, agent_loop: AgentLoopBase, make_env: Callable[[], Env], *, max_concurrent: int = 128,
                 timeout_s: float | None = None, retries: int = 0, reuse_policy: str = "all",
                 num_workers: int | None = None, score: Callable[[Trajectory], Awaitable[None]] | None = None,
                 rewards: RewardLoop | None = None):
        self.agent_loop = agent_loop
        self.make_env = make_env
        self.max_concurrent = max_concurrent
        self.timeout_s = timeout_s  # rollout.worker.task_timeout_s: one episode, all its turns and tools
        self.retries = retries  # rollout.worker.retry_on_failure: further attempts with a fresh env
        if reuse_policy not in ("all", "on_policy_segment_only"):
            raise ValueError(f"reuse_policy must be 'all' or 'on_policy_segment_only', got {reuse_policy!r}")
        self.reuse_policy = reuse_policy  # rollout.partial_rollout.reuse_policy
        self.workers = WorkerPool(num_workers) if num_workers else None  # None = no bound
        self.score = score  # the teacher loop: scores each finished episode (``tether.teacher.scorer``)
        self.rewards = rewards  # the reward loop: the judge's rubrics of each finished episode (``tether.reward``)

    async def rollout(self, task: Task, seed: int) -> Trajectory:
        """One episode; a timeout or an exception is retried ``retries`` times, then raised as RolloutError
        (counted by cause, see the module docstring). A retry uses a derived seed: it is a new attempt, not
        a replay of the one that failed."""
        reasons: list[str] = []
        cause = "agent_loop"
        for attempt in range(self.retries + 1):
            env = None
            try:
                try:
                    env = EpisodeEnv(self.make_env(), self.workers)
                except StopRun:
                    raise
                except Exception as e:
                    raise EpisodeFailure("env", e) from e
                attempt_seed = seed if attempt == 0 else episode_seed(seed, "retry", attempt)
                run = self.agent_loop.run(task, env, seed=attempt_seed)
                traj = await asyncio.wait_for(run, self.timeout_s)
                if self.reuse_policy == "on_policy_segment_only":
                    record_metric("rollout/older_segment_tokens_masked", mask_older_segments(traj), "sum")
                return traj
            except TimeoutError:
                reasons.append(f"timed out after {self.timeout_s} s")
                cause = "timeout"
                record_metric("rollout/episode_timeouts", 1, "sum")
            except StopRun:
                raise
            except Exception as e:  # noqa: BLE001 — recorded, retried, and counted and raised below
                cause = failure_cause(e)
                reasons.append(f"{cause}: {e}" if isinstance(e, EpisodeFailure) else f"{type(e).__name__}: {e}")
                record_metric("rollout/episode_errors", 1, "sum")
            finally:
                if env is not None:
                    self._close(env)
        record_metric(f"rollout/episode_failures/{cause}", 1, "sum")
        message = f"task {task.id}: all {self.retries + 1} attempts failed: {'; '.join(reasons)}"
        log.warning("episode failed (%s), the run goes on: %s", cause, message)
        raise RolloutError(message, cause)

    @staticmethod
    def _close(env: Env) -> None:
        try:
            env.close()
        except Exception as e:  # noqa: BLE001 — the episode's result stands; the leak is counted and logged
            record_metric("rollout/env_close_errors", 1, "sum")
            log.warning("closing an episode's environment failed: %s", e)

    async def _attempt(self, task: Task, seed: int) -> Trajectory | RolloutError:
        try:
            traj = await self.rollout(task, seed)
        except RolloutError as e:
            return e
        if self.score is not None:  # as the episode finishes, while the others generate; not retried
            try:
                await self.score(traj)
            except Exception as e:  # noqa: BLE001 — counted, and the episode left out like any failed one
                record_metric("rollout/episode_failures/teacher", 1, "sum")
                log.warning("the teacher could not score an episode of task %s, the run goes on without it: %s",
                            task.id, e)
                return RolloutError(f"task {task.id}: the teacher could not score the episode: {e}", "teacher")
        return traj

    async def _rewarded(self, result: Trajectory | RolloutError) -> Trajectory | RolloutError:
        """The episode, its rubrics scored by the reward loop when one is set (a judge failure is recorded on the
        trajectory, never raised)."""
        if self.rewards is not None and isinstance(result, Trajectory):
            await self.rewards.score(result)
        return result

    reports_episodes = True  # ``group`` takes ``on_episode`` (the Ray rollouter's stand-in does not)

    async def group(self, task: Task, group_size: int, seed: int,
                    on_episode: Callable[[list[float]], None] | None = None) -> Group:
        """``group_size`` rollouts of one task, concurrently (the async rollouter's unit of work); the
        episodes that failed are left out, and RolloutError is raised only when all of them failed.
        ``on_episode``: told the rewards of the episodes finished so far, after each one."""
        finished: list[float] = []

        async def one(i: int) -> Trajectory | RolloutError:
            result = await self._rewarded(await self._attempt(task, episode_seed(seed, task.id, i)))
            if on_episode is not None and isinstance(result, Trajectory):
                finished.append(result.reward)
                on_episode(finished)
            return result

        results = await asyncio.gather(*(one(i) for i in range(group_size)))
        return Group(task.id, _survivors(task, results))

    async def groups(self, tasks: list[Task], group_size: int | list[int], seed: int, *,
                     keep_failed: bool = False) -> list[Group]:
        """``group_size`` rollouts of each task (one size for all, or one per task), all in flight together
        (bounded by max_concurrent). Failed episodes are left out, and a task none of whose episodes finished
        is left out of the list — or, with ``keep_failed`` (evaluation), each failed episode is a
        ``failed_trajectory`` in its place. RolloutError only when every episode failed."""
        sizes = group_size if isinstance(group_size, list) else [group_size] * len(tasks)
        sem = asyncio.Semaphore(self.max_concurrent)

        async def one(task: Task, i: int) -> Trajectory | RolloutError:
            async with sem:
                attempt = await self._attempt(task, episode_seed(seed, task.id, i))
            return await self._rewarded(attempt)  # judged outside the slot: the next episode starts now

        results = await asyncio.gather(*(one(t, i) for t, n in zip(tasks, sizes) for i in range(n)))
        if self.rewards is not None:  # no trainer to drop a group for: a judge failure leaves the rule checks
            for k in range(len(tasks)):
                start = sum(sizes[:k])
                self.rewards.settle([r for r in results[start:start + sizes[k]] if isinstance(r, Trajectory)],
                                    "rule_only")
        errors = [r for r in results if isinstance(r, RolloutError)]
        if results and len(errors) == len(results):
            raise RolloutError(f"every episode of {len(tasks)} tasks failed; the first: {errors[0]}", errors[0].cause)
        starts = [sum(sizes[:k]) for k in range(len(tasks) + 1)]
        out = []
        for k, task in enumerate(tasks):
            mine = results[starts[k]:starts[k + 1]]
            if keep_failed:
                out.append(Group(task.id, [failed_trajectory(task, r) if isinstance(r, RolloutError) else r
                                           for r in mine]))
            elif any(isinstance(r, Trajectory) for r in mine):
                out.append(Group(task.id, _survivors(task, mine)))
        return out


def _survivors(task: Task, results: list[Trajectory | RolloutError]) -> list[Trajectory]:
    kept = [r for r in results if isinstance(r, Trajectory)]
    if results and not kept:
        first = [r for r in results if isinstance(r, RolloutError)][0]  # = results[0]: every one failed
        raise RolloutError(f"task {task.id}: all {len(results)} episodes of the group failed; the first: {first}",
                           first.cause)
    return kept


def record_rollout_metrics(trajs: list[Trajectory], elapsed_s: float | None,
                           hacking_patterns: tuple[str, ...] = ()) -> None:
    """The agent/, reward/ and rollout throughput metrics of one batch of trajectories. Every pattern in
    ``hacking_patterns`` is recorded (0 when not seen), so a clean run shows zeros rather than nothing."""
    n = len(trajs)
    rewards = [t.reward for t in trajs]
    mean = sum(rewards) / n
    record_metric("reward/mean", mean)
    record_metric("reward/std", (sum((r - mean) ** 2 for r in rewards) / max(n - 1, 1)) ** 0.5)
    for name in sorted({c for t in trajs for c in t.reward_components}):
        record_metric(f"reward/{name}", sum(t.reward_components.get(name, 0.0) for t in trajs) / n)
    for pattern in sorted(set(hacking_patterns) | {p for t in trajs for p in t.hacking_flags}):
        record_metric(f"reward/hacking/{pattern}", sum(t.hacking_flags.get(pattern, 0) for t in trajs), "sum")
    record_metric("rollout/success_rate", sum(t.success for t in trajs) / n)
    for field in ("generate_sequences", "tool_calls", "compute_score", "num_preempted", "num_turns"):
        record_metric(f"agent/{field}", sum(getattr(t.metrics, field) for t in trajs) / n)
    record_metric("agent/num_tool_calls", sum(t.num_tool_calls for t in trajs) / n)
    record_metric("agent/errors", sum(len(t.errors) for t in trajs) / n)
    for cause in ("program_error", "program_timeout"):  # agent_loop: program (tether.programs.loop)
        if failed := sum(t.termination == cause for t in trajs):
            record_metric(f"agent/{cause}s", failed, "sum")
    record_metric("rollout/response_tokens", sum(t.num_model_tokens for t in trajs) / n)
    record_metric("rollout/truncated_ratio", sum(t.truncated for t in trajs) / n)
    record_metric("rollout/max_turns_failed", sum(t.max_turns_failed for t in trajs) / n)  # max_turns_exceeded: fail
    record_metric("rollout/segments", sum(len(t.segments) for t in trajs) / n)  # memory segments per trajectory
    # partial rollouts: trajectories whose model tokens come from more than one parameter version
    record_metric("rollout/partial_ratio",
                  sum(len({v for s in t.segments for v in s.versions if v >= 0}) > 1 for t in trajs) / n)
    if elapsed_s is not None:  # wall time of generating this batch (sync mode)
        record_metric("perf/rollout_time", elapsed_s, "sum")
