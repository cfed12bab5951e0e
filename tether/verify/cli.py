"""The ``tether verify`` sub-commands (registered on ``tether.cli.app`` as ``verify``).

Exit codes, for every sub-command: 0 all criteria hold, 1 some failed (the diagnosis is printed), 2 bad input.
Imports of ``tether.cli`` are inside the commands: ``tether.cli`` imports this module to register it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

verify_app = typer.Typer(
    help="Check that a run is actually learning: environment, async pipeline, optimisation.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@verify_app.command("env")
def env(
    files: Annotated[list[Path], typer.Argument(help="YAML config files, merged in order (later wins).")],
    set_: Annotated[list[str] | None, typer.Option(
        "--set", help="Override one key, e.g. --set environment.state.max_turns=10 (value parsed as YAML).")] = None,
    tasks: Annotated[int, typer.Option("--tasks", min=1, help="Train tasks the scripted expert plays.")] = 10,
    random_episodes: Annotated[int, typer.Option("--random", min=0,
                                                 help="Episodes of random and adversarial actions.")] = 8,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the random episodes.")] = 0,
    policy: Annotated[bool, typer.Option("--policy", help="Also run a few episodes of the configured policy "
                                                          "through the agent loop (builds the model).")] = False,
) -> None:
    """Drive the configured environment with scripted probes: tool calls return structured observations, rewards
    stay in the verifier's range, each termination condition fires when it should, every verifier component
    scores, the anti-hacking detectors fire on planted hacks. Prints a table of checks and a diagnosis naming the
    config key for each failure. Exit 0 all hold (warnings allowed), 1 a check failed, 2 bad input."""
    from tether.cli import fail, load_or_exit
    from tether.verify.env import exit_code, render, verify_env

    cfg = load_or_exit(files, set_)
    try:
        checks = verify_env(cfg, num_tasks=tasks, random_episodes=random_episodes, seed=seed, policy=policy)
    except (ValueError, KeyError) as e:  # an environment the config cannot build (unknown name, tool, check)
        raise fail(str(e)) from None
    typer.echo(render(checks))
    raise typer.Exit(exit_code(checks))
