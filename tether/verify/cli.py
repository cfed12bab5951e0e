"""The ``tether verify`` sub-commands (registered on ``tether.cli.app`` as ``verify``).

Exit codes, for every sub-command: 0 all criteria hold, 1 some failed (the diagnosis is printed), 2 bad input. A
failure of the check itself (an endpoint lost, a bug) also exits 1, in one line naming the file that holds its
traceback (``tether.cli_common.Group``).
The sub-commands that build a model or train import torch and transformers in their bodies (``tether --help``
starts without them).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer

from tether.cli_common import check_checkpoint, fail, load_or_exit, say
from tether.config import ConfigError
from tether.pipeline.rollouter import RolloutError
from tether.verify import async_checks
from tether.verify import optim as optim_checks
from tether.verify.criteria import Report, VerifyInputError, render

verify_app = typer.Typer(
    help="Check that a run is learning: env, async, optim, consistency.\n\nEach exits 0 when its criteria hold, 1 "
         "when some fail (with a diagnosis naming the keys to change), 2 on bad input.",
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
    """Probe the configured environment with scripted episodes.

    Checked: tool calls return structured observations, rewards stay in the verifier's range, each termination condition
    fires when it should, every verifier component scores, the anti-hacking detectors fire on planted hacks. Prints a
    table of checks and a diagnosis naming the config key for each failure. Exit 0 all hold (warnings allowed), 1 a
    check failed, 2 bad input."""
    from tether.verify import env as env_checks  # noqa: PLC0415 — transformers: not for --help

    cfg = load_or_exit(files, set_)
    say(f"verify env: probing {cfg.environment.name} with the scripted expert on {tasks} train tasks and "
        f"{random_episodes} random episodes" + (", then a few episodes of the policy (loading the model)…" if policy
                                                else "…"))
    try:
        checks = env_checks.verify_env(cfg, num_tasks=tasks, random_episodes=random_episodes, seed=seed,
                                       policy=policy)
    except (ValueError, KeyError) as e:  # an environment the config cannot build (unknown name, tool, check)
        raise fail(str(e)) from None
    typer.echo(env_checks.render(checks))
    raise typer.Exit(env_checks.exit_code(checks))


Steps = Annotated[int | None, typer.Option(
    "--steps", min=1, help="Configs: the length of the short run (default 8). A run directory: check its first N "
                           "steps (default all).")]


def _short_run(what: str, files: list[Path], set_: list[str] | None, steps: int, run_dir: Path) -> None:
    """Train the merged config for ``steps`` steps into ``run_dir`` (exit 2 on bad input, 1 when it fails), with
    ``tether train``'s progress on stderr: the model, the engine and a first evaluation come before step 1."""
    from tether.pipeline.trainer import train  # noqa: PLC0415 — torch, transformers: not for --help

    cfg = load_or_exit(files, [*(set_ or ()), f"trainer.total_steps={steps}", f"trainer.save_every={steps}"])
    say(f"verify {what}: a {steps}-step run of {' '.join(map(str, files))} in a temporary directory, then the "
        "checks; loading the model…")
    try:
        train(cfg, run_dir)
    except (ValueError, FileNotFoundError) as e:  # ConfigError is a ValueError
        raise fail(str(e)) from None
    except RolloutError as e:
        raise fail(str(e), code=1) from None


@verify_app.command("optim")
def optim(
    paths: Annotated[list[Path], typer.Argument(
        help="A run directory (its metrics.jsonl and config.yaml), or YAML config files to train briefly first.")],
    set_: Annotated[list[str] | None, typer.Option(
        "--set", help="With configs: override one key, e.g. --set policy_optimization.optimizer.lr=1e-5.")] = None,
    steps: Steps = None,
) -> None:
    """Check the learning signal, gradient norm and KL per step.

    The raw within-group reward std > 0.1 (measured before the degenerate-group filter: optim/advantage_std, after it,
    reads ≈ 0.94 whatever happens), optim/grad_norm in [0.1, 10], optim/kl_divergence below kl_control.max_kl. Prints
    the criteria with pass/fail counts, the steps that failed, and a diagnosis with the keys to change for each failed
    one. Exit 0 all hold, 1 some failed, 2 bad input."""
    _verify("optim", paths, set_, steps, optim_checks.verify_run)


@verify_app.command("async")
def async_(
    paths: Annotated[list[Path], typer.Argument(
        help="YAML config files (rollout.mode fully_async or one_step_off_policy) to run briefly, or the directory "
             "of an async run.")],
    set_: Annotated[list[str] | None, typer.Option(
        "--set", help="With configs: override one key, e.g. --set rollout.scheduler.max_staleness=2.")] = None,
    steps: Steps = None,
) -> None:
    """Check an async run: staleness, queue, syncs, idle time.

    A short run of the real pipeline (or an async run's directory), then on every row: rollout/policy_version_lag_max ≤
    max_staleness; no degenerate group reaches the learner with the filter on; queue accounting balances (produced =
    consumed + dropped + stale + queued); the parameter version advances by one every trigger_parameter_sync_step steps;
    both sides busy (trainer and rollouter idle ratios < 0.95 on average). Exit 0 all hold, 1 some failed, 2 bad input
    (a sync config among them: nothing async to check)."""
    if not (len(paths) == 1 and paths[0].is_dir()):
        try:
            async_checks.check_mode(load_or_exit(paths, set_).rollout.mode)
        except VerifyInputError as e:
            raise fail(str(e)) from None
    _verify("async", paths, set_, steps, async_checks.verify_run)


def _verify(what: str, paths: list[Path], set_: list[str] | None, steps: int | None,
            verify_run: Callable[[Path, int | None], Report]) -> None:
    """Check a run directory, or a short run of the configs ``paths`` in a temporary one; print and exit."""
    try:
        if len(paths) == 1 and paths[0].is_dir():
            report = verify_run(paths[0], steps)
        else:
            with tempfile.TemporaryDirectory(prefix="tether-verify-") as tmp:
                _short_run(what, paths, set_, steps or 8, Path(tmp) / "run")
                report = verify_run(Path(tmp) / "run", None)
    except VerifyInputError as e:
        raise fail(str(e)) from None
    render(report)
    raise typer.Exit(report.exit_code)


@verify_app.command("consistency")
def consistency(
    checkpoint: Annotated[Path, typer.Argument(help="A Hugging Face model folder, e.g. RUN/checkpoints/step_N.")],
    config_files: Annotated[list[Path] | None, typer.Option(
        "--config", help="Config file(s) of the run: environment, agent_loop, engine, tool_parser.")] = None,
    set_: Annotated[list[str] | None, typer.Option(
        "--set", help="Override one key, e.g. --set engine.max_tokens=96 (value parsed as YAML).")] = None,
    tasks: Annotated[int, typer.Option("--tasks", min=1, help="Play the first N tasks of the split.")] = 8,
    split: Annotated[str, typer.Option("--split", help="heldout (the evaluation tasks) or train.")] = "heldout",
    chat_template: Annotated[Path | None, typer.Option(
        "--chat-template", metavar="FILE",
        help="Serve with this chat template instead of the checkpoint's (tether serve --chat-template).")] = None,
    temperature: Annotated[float | None, typer.Option(
        "--temperature", min=0.0, max=2.0, help="The deployment requests' temperature (default 0: greedy, as the "
                                                "training path).")] = None,
    top_p: Annotated[float | None, typer.Option(
        "--top-p", max=1.0, help="The deployment requests' top_p, in (0, 1] (default 1).")] = None,
    max_tokens: Annotated[int | None, typer.Option(
        "--max-tokens", min=1, help="The deployment requests' max_tokens (default engine.max_tokens).")] = None,
) -> None:
    """Compare training and deployment actions, turn by turn.

    Play the same tasks through the training path (agent loop, token-in/token-out, local engine) and the
    deployment path (tether serve on this checkpoint, in-process on a free port, driven by an OpenAI chat client:
    text and tool schemas in, tool calls parsed by the server out), greedily on both, and compare the actions turn
    by turn. Match rate = Σ over tasks of the turns before the first differing one / Σ of the longer sequence's
    length; it must be above 0.9. Prints per-task results, and where the actions first differ with the cause:
    tokenizer, chat template, tool schema rendering or sampling settings (from the two prompts and settings of that
    turn). Exit 0 above 0.9, 1 at or below, 2 bad input."""
    from tether.serve.server import read_chat_template  # noqa: PLC0415 — torch: not for --help
    from tether.verify import consistency as checks  # noqa: PLC0415 — as above

    if split not in checks.SPLITS:
        raise fail(f"--split {split!r}: choose one of {', '.join(checks.SPLITS)}")
    if top_p is not None and top_p <= 0:
        raise fail(f"--top-p {top_p}: must be above 0 (1 keeps the whole distribution)")
    cfg = load_or_exit(config_files or [], set_)
    check_checkpoint(checkpoint)
    overrides = {k: v for k, v in (("temperature", temperature), ("top_p", top_p), ("max_tokens", max_tokens))
                 if v is not None}
    try:
        template = None if chat_template is None else read_chat_template(chat_template)
        say(f"verify consistency: loading {checkpoint}, then {tasks} {split} tasks through the training path and "
            "through tether serve…")
        report = checks.check_consistency(checkpoint, cfg, num_tasks=tasks, split=split, chat_template=template,
                                          deploy_sampling=overrides)
    except (ConfigError, OSError, ValueError) as e:
        raise fail(str(e)) from None
    checks.render(report, typer.echo)
    raise typer.Exit(checks.exit_code(report))
