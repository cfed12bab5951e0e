"""An agent program run as a command (``agent_loop.program_command``): one process per episode.

Its environment points the official SDKs at the episode's endpoint (``OPENAI_BASE_URL``, ``OPENAI_API_KEY``) and
tells it the episode (``TETHER_MODEL``, ``TETHER_EPISODE`` as JSON, ``TETHER_EPISODE_URL`` for the tools: the
gateway's ``/episode`` routes). A timeout kills the process; a non-zero exit is a ``CommandFailed`` naming the exit
status and the last line of its stderr; a number on the last line of its stdout is its reward.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Sequence

from tether.programs.episode import Episode


class CommandFailed(RuntimeError):
    """The program's process exited with a non-zero status."""


def command_env(ep: Episode) -> dict[str, str]:
    episode = {"task_id": ep.task.id, "system_prompt": ep.system_prompt, "prompt": ep.prompt, "tools": ep.tools,
               "sampling": ep.sampling}
    return {**os.environ, "OPENAI_BASE_URL": ep.base_url, "OPENAI_API_KEY": ep.api_key, "TETHER_MODEL": ep.model,
            "TETHER_EPISODE_URL": ep.base_url.removesuffix("/v1") + "/episode", "TETHER_EPISODE": json.dumps(episode)}


async def run_command(argv: Sequence[str], ep: Episode) -> float | None:
    """Run ``argv`` for ``ep`` to its end; its reward when its stdout ends with a number."""
    try:
        proc = await asyncio.create_subprocess_exec(*argv, env=command_env(ep), stdin=asyncio.subprocess.DEVNULL,
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    except OSError as e:
        raise CommandFailed(f"agent_loop.program_command {list(argv)} could not start: {e}") from None
    try:
        out, err = await proc.communicate()
    except asyncio.CancelledError:  # agent_loop.program_timeout_s
        proc.kill()
        await proc.wait()
        raise
    if proc.returncode != 0:
        last = err.decode(errors="replace").strip().splitlines()[-1:] or ["(no stderr)"]
        raise CommandFailed(f"program command exited with status {proc.returncode}: {last[0][:500]}")
    lines = out.decode(errors="replace").strip().splitlines()
    try:
        return float(lines[-1]) if lines else None
    except ValueError:
        return None
