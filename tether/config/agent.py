"""``agent_loop`` and ``tool_parser``: the multi-turn loop that plays each episode (``tether.agent.loop``, or a user's
agent program: ``tether.programs``) and how tool calls are parsed out of the model's text (``tether.agent.parsers``)."""

from __future__ import annotations

from typing import Literal

from pydantic import model_validator

from tether.config.base import NonNegInt, PosFloat, PosInt, Section, _check

__all__ = ["AgentLoopConfig", "ToolParserConfig"]



class AgentLoopConfig(Section):
    """The multi-turn agent loop (GENERATING ⇄ PROCESSING_TOOLS)."""

    name: str = "tool_agent"
    """Registered agent loop, as in ``@register("tool_agent")`` (``tether.agent.loop``): ``tool_agent`` (tether's
    own state machine) or ``program`` (``agent_loop.program``, a user's agent that calls an OpenAI-compatible
    endpoint: ``tether.programs``)."""
    max_user_turns: PosInt = 3
    """Maximum user turns per episode, in replies of the (simulated) user; the episode ends (truncated) when
    the user has replied this many times."""
    max_assistant_turns: PosInt = 5
    """Maximum assistant turns (model generations) per episode; the episode ends (truncated) after the last."""
    max_parallel_calls: PosInt = 2
    """Maximum tool calls run (concurrently) per assistant turn; further calls of that turn are not run and
    get an error observation."""
    tool_selection: Literal["per_sample", "all"] = "per_sample"
    """Offer each sample its task's tools (per_sample) or every tool of the action space (all)."""
    program: str | None = None
    """With ``name: program``, the agent program each episode runs: ``module:function`` (a module on the path, in the
    current directory or beside the config). The function takes a ``tether.programs.Episode`` (the episode's
    OpenAI-compatible ``base_url``, ``api_key``, ``model``, ``tools``, ``system_prompt``, ``prompt``, ``sampling``,
    and ``call_tool`` for the environment); sync functions run in a thread, ``async`` ones on the rollout's event
    loop. Every call it makes is recorded (prompt and completion token ids, logprobs, weight versions) and stitched
    into the episode's trajectory; a number it returns replaces the environment's reward. The run's sampling
    (``engine.*``) applies to every call whatever the request says, so the recorded logprobs are the policy's."""
    program_command: list[str] | None = None
    """With ``name: program``, instead of ``program``: a command run once per episode (argv, no shell; relative paths
    from the current directory), with ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` / ``TETHER_MODEL`` set to the episode's
    endpoint (so the official SDK's ``OpenAI()`` finds it), ``TETHER_EPISODE`` (JSON: ``system_prompt``, ``prompt``,
    ``tools``, ``sampling``, ``task_id``) and ``TETHER_EPISODE_URL``: ``POST $TETHER_EPISODE_URL/tools/<name>`` with
    the arguments as the JSON body runs a tool (``{"text", "user_reply", "error", "done"}``), ``GET`` it tells
    ``done`` (both with the same bearer key). A non-zero exit is ``program_error`` (its stderr's last line in the
    trajectory's errors); a number printed as its last line of stdout replaces the reward."""
    program_timeout_s: PosFloat = 600.0
    """Wall-clock limit of one episode of ``agent_loop.program``, in seconds; past it the episode ends
    (``program_timeout``), scored on what was done, and the program's later calls are refused."""
    constrained_tool_calls: bool = False
    """Decode every assistant turn (rollouts and evaluation episodes alike) under a grammar (``tether.engine.grammar``,
    the ``grammar`` extra): free text, or hermes tool calls of the episode's tools whose arguments are valid under the
    tool's JSON schema — a ``<tool_call>`` the model opens must become such a call (until ``engine.max_tokens`` cuts
    it). What ``tether serve`` does for tools with ``strict: true``, so a policy trained with it sees the grammar it is
    served with. The rollout is then off-policy by the mass the mask removes, which no importance ratio sees (the
    recorded logprobs are the unmasked model's: ``tether.engine.base``). Needs the in-process engine (``engine.type:
    local``), a tool parser that reads hermes blocks (hermes, function_call_parser) and ``engine.min_tokens: 0``.
    tether's own key; off by default."""

    @model_validator(mode="after")
    def _program_with_its_loop(self) -> AgentLoopConfig:
        given = (self.program is not None) + (self.program_command is not None)
        _check(given <= 1, "give agent_loop.program or agent_loop.program_command, not both")
        _check((self.name == "program") == (given == 1),
               "agent_loop.program (or program_command) is the program of name: program; give both or neither",
               name=self.name, program=self.program, program_command=self.program_command)
        _check(self.program_command is None or len(self.program_command) > 0,
               "agent_loop.program_command is a non-empty argv list")
        if self.program is not None:
            module, _, attr = self.program.partition(":")
            _check(bool(module and attr), "agent_loop.program is 'module:function'", program=self.program)
        return self


class ToolParserConfig(Section):
    """How tool calls are parsed out of the model's text."""

    name: Literal["hermes", "function_call_parser", "pythonic"] = "hermes"
    """Registered tool-call parser (``tether.agent.parsers``): hermes ``<tool_call>{json}</tool_call>`` blocks,
    function_call_parser (the same blocks, else an OpenAI-style ``{"name", "arguments"}`` JSON object), or
    pythonic (a turn that is a Python list of keyword calls, ``[name(arg="v")]``: Llama-3.2/4 models). It must
    match the format the model writes: a mismatch parses no call at all (``monitor/signal/no_tool_calls``)."""
    stop_token_ids: list[NonNegInt] = []
    """Extra token ids (vocabulary ids of the policy's tokenizer) that end a generation, e.g. the
    end-of-tool-call token."""
