"""``agent_loop.name: program``: a user's agent program plays each episode; tether records and trains what it did.

Per episode: the environment is reset, the program gets an ``Episode`` (its own endpoint on the gateway, the task's
tools and the environment's ``call_tool``) and runs — a sync function in a thread of the loop's pool, an ``async``
one on the rollout's event loop, a command as a process (``command.py``) — under ``agent_loop.program_timeout_s``.
Its calls' tokens are stitched into the trajectory's segments (``stitch.py``) and the environment scores the
episode: when the environment ended it, with that step's reward; otherwise with ``finalize(reason)``, the reason
being the limit that stopped it (``max_assistant_turns``, ``max_user_turns``, ``context_window``), ``no_action``
when the program returned by itself, ``program_timeout`` or ``program_error`` (its exception in the trajectory's
errors, as a failed tool would be). A number the program returns replaces the reward
(``reward_components["program"]``).
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tether.agent.chat import ChatAssembler, TokenBuffer
from tether.agent.loop import AgentLoopBase, register
from tether.agent.rules import apply_final_info
from tether.env.base import Env
from tether.programs.command import CommandFailed, run_command
from tether.programs.episode import Episode, Limits
from tether.programs.gateway import MODEL_NAME, Gateway
from tether.programs.recording import Session
from tether.programs.stitch import stitch
from tether.types import Segment, Task, Trajectory

_POOL_THREADS = 256  # sync programs at once (each mostly waits on HTTP and tools)


@register("program")
class ProgramAgentLoop(AgentLoopBase):
    def __init__(self, *args: Any, program: Callable[[Episode], Any] | Sequence[str], timeout_s: float = 600.0,
                 **kwargs: Any):
        """program: a function of an ``Episode``, or a command (argv) run once per episode (``command.py``)."""
        super().__init__(*args, **kwargs)
        self.program, self.timeout_s = program, timeout_s
        self._gateway: Gateway | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def gateway(self) -> Gateway:
        """Started at the first episode (an evaluation loop that never runs starts no server)."""
        with self._lock:
            if self._gateway is None:
                self._gateway = Gateway(self.engine, self.tokenizer, parser=self.parser_name,
                                        extra_stop_ids=self.stop_ids)
                self._pool = ThreadPoolExecutor(_POOL_THREADS, thread_name_prefix="tether-program")
            return self._gateway

    def close(self) -> None:
        with self._lock:
            if self._gateway is not None:
                self._gateway.close()
                self._gateway = None
            if self._pool is not None:
                self._pool.shutdown(wait=False, cancel_futures=True)
                self._pool = None

    async def run(self, task: Task, env: Env, *, seed: int | None = None) -> Trajectory:
        gateway = self.gateway()
        obs = env.reset(task_id=task.id)
        schemas = env.tool_schemas()
        if self.limits.tool_selection == "per_sample" and task.tools is not None:
            schemas = [s for s in schemas if s["function"]["name"] in task.tools]
        session = Session(uuid.uuid4().hex, sampling=self.sampling, seed=seed, window=self.limits.context_window,
                          max_calls=self.limits.max_assistant_turns)
        sampling = {"temperature": self.sampling.temperature, "top_p": self.sampling.top_p,
                    "max_tokens": self.sampling.max_tokens}
        ep = Episode(task=task, system_prompt=env.system_prompt(), prompt=obs.get("user_reply") or "", tools=schemas,
                     base_url=gateway.open(session), api_key=gateway.api_key, model=MODEL_NAME, sampling=sampling,
                     env=env, session=session, loop=asyncio.get_running_loop(),
                     limits=Limits(self.limits.max_user_turns, self.limits.max_assistant_turns,
                                   self.limits.max_parallel_calls))
        session.episode = ep
        returned, failure = await self._play(ep)
        gateway.close_session(session)
        return self._trajectory(ep, returned, failure)

    async def _play(self, ep: Episode) -> tuple[Any, str | None]:
        """What the program returned, and why it failed (None when it did not)."""
        try:
            program = self.program
            if not callable(program):
                work: Any = run_command(program, ep)
            elif inspect.iscoroutinefunction(program):
                work = program(ep)
            else:
                assert self._pool is not None
                work = asyncio.get_running_loop().run_in_executor(self._pool, program, ep)
            return await asyncio.wait_for(work, self.timeout_s), None
        except TimeoutError:
            return None, "program_timeout"
        except Exception as e:  # noqa: BLE001 — the program's failure is the episode's, counted like a tool's
            if ep.session.ending is not None:  # it stopped on a limit the endpoint enforced
                return None, None
            ep.errors.append(str(e) if isinstance(e, CommandFailed) else f"program raised {type(e).__name__}: {e}")
            return None, "program_error"
        finally:
            ep.end()

    def _trajectory(self, ep: Episode, returned: Any, failure: str | None) -> Trajectory:
        calls = ep.session.calls
        segments = stitch(calls)
        if not segments:  # no call was made: the opening prompt, nothing generated
            segments = [TokenBuffer(ChatAssembler(self.tokenizer, ep.tools).prompt(ep.messages()))]
        first, *rest = segments
        traj = Trajectory(task_id=ep.task.id, prompt_ids=first.prompt_ids, response_ids=first.response_ids,
                          response_mask=first.response_mask, logprobs=first.logprobs, versions=first.versions,
                          continuations=[Segment(s.prompt_ids, s.response_ids, s.response_mask, s.logprobs,
                                                 s.versions) for s in rest])
        info, score_s = ep.info, 0.0
        if not ep.env_done:
            reason = failure or ep.session.ending or ep.limit_reached or "no_action"
            t = time.perf_counter()
            reward, info = ep.env.finalize(reason)
            score_s = time.perf_counter() - t
            info = dict(info)
            info.setdefault("termination", reason)
            ep.reward = float(reward)
        if isinstance(returned, (int, float)) and not isinstance(returned, bool):
            ep.reward = float(returned)
            info = {**info, "reward_components": {**info.get("reward_components", {}), "program": float(returned)}}
        traj.reward = float(ep.reward or 0.0)
        traj.messages = self._messages(ep)
        traj.metrics.compute_score = score_s
        apply_final_info(traj, info)  # adds the environment's own compute_score_s
        traj.errors = list(ep.errors)
        traj.num_tool_calls, traj.num_user_turns, traj.num_assistant_turns = ep.tool_calls, ep.user_turns, len(calls)
        traj.metrics.generate_sequences = sum(c.seconds for c in calls)
        traj.metrics.tool_calls = ep.tool_s  # as the tool_agent loop times them: the environment's steps
        traj.metrics.num_preempted = sum(c.result.num_preempted for c in calls)
        traj.metrics.num_turns = ep.user_turns + len(calls) + 1
        traj.check()
        return traj

    def _messages(self, ep: Episode) -> list[dict[str, Any]]:
        """A readable conversation: each generation parsed as the tool_agent loop parses it, then what answered."""
        messages = ep.messages()
        for i, call in enumerate(ep.session.calls):
            ids = list(call.result.token_ids)
            if ids and ids[-1] in self.stop_ids:
                ids = ids[:-1]
            parsed = self.parse(self.tokenizer.decode(ids, skip_special_tokens=False))
            msg: dict[str, Any] = {"role": "assistant", "content": parsed.content}
            if parsed.calls:
                msg["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}} for c in parsed.calls]
            messages.append(msg)
            messages += [m for made, m in ep.events if made == i + 1]
        return messages
