"""The ``tether`` command line. Each command is a function on ``app``; add one with ``@app.command()``.

No traceback reaches the terminal. Bad input (a config error, a missing key variable) exits with code 2 and a
one-paragraph message on stderr; a failed training run exits 1 with what failed, its last complete checkpoint and
the command that resumes it, the traceback in ``RUN/train.log`` (``cli_common.run_failed``); any other exception a
command does not catch exits 1 with one line naming the file that holds its traceback (``tether.cli_common.Group``).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.syntax import Syntax

from tether.agent.loop import LoopLimits
from tether.cli_common import (
    Files,
    Group,
    Overrides,
    check_checkpoint,
    check_run_dir,
    check_weights,
    fail,
    load_or_exit,
    resume_command,
    run_failed,
    say,
    stamp,
)
from tether.config import ConfigError
from tether.config.explain import explain as explain_key
from tether.config.plan import Plan
from tether.env.tau2 import passk
from tether.llm import BadRequest, LLMClient, LLMError, MalformedResponse
from tether.llm.errors import display_url
from tether.pipeline.evaluate import eval_metrics, evaluate
from tether.pipeline.preemption import Preempted
from tether.pipeline.progress import sft_bar, show_eval
from tether.pipeline.rollouter import Rollouter
from tether.verify.cli import verify_app
from tether.warmstart.demos import DemoError, expert_demos, jsonl_demos, read_conversations

# The commands that train, evaluate or serve import torch and transformers (seconds) in their bodies, one import
# per module they use: `tether --help` and `tether config` start without them.

app = typer.Typer(
    help="Agentic RL for tool-using LLMs that tells you whether the run is learning.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    cls=Group,  # an exception no command caught: one line, the traceback in a file (tether.cli_common)
)
app.add_typer(verify_app, name="verify")


@app.callback()
def main() -> None:
    """tether: train, evaluate and verify tool-using agents."""  # keeps `tether CMD` form with one command
    # Weight-loading bars would drown the training progress: off through the environment, read when a command
    # imports transformers (importing it here would cost every command a second), or directly where it is imported
    # already (the app run in-process, as by the tests).
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "huggingface_hub" in sys.modules:
        from transformers.utils import logging as hf_logging  # noqa: PLC0415 — third-party, imported already

        hf_logging.disable_progress_bar()


@app.command()
def config(
    files: Annotated[list[Path] | None, typer.Argument(help="YAML config files, merged in order (later wins).")] = None,
    set_: Overrides = None,
    explain: Annotated[str | None, typer.Option(
        "--explain", metavar="KEY",
        help="Describe KEY (e.g. policy_optimization.kl_control.horizon): what it does, "
             "unit, allowed values, default, its value in FILES, the seed config naming it.")] = None,
) -> None:
    """Validate and merge config FILES and print the resolved YAML.

    Secrets are redacted; a `# warning:` line names each value that cannot act within the run. --explain KEY
    describes one key instead."""
    if explain is not None:
        try:
            typer.echo(explain_key(explain, files or (), set_ or ()))
        except ConfigError as e:
            raise fail(str(e)) from None
        return
    if not files:
        raise fail("give the config FILES to resolve (or --explain KEY)")
    cfg = load_or_exit(files, set_)
    keys = [s.partition("=")[0] for s in set_ or ()]  # values could be secrets: never echo them
    header = f"# resolved from: {', '.join(map(str, files))}" + "".join(f" --set {k}" for k in keys)
    derived = ", ".join(f"{k}={v}" for k, v in Plan.of(cfg).totals().items())
    warnings = "".join(f"# warning: {w}\n" for w in cfg.warnings())
    text = f"{header}\n# derived: {derived}\n{warnings}{cfg.to_yaml()}"
    console = Console(soft_wrap=True)
    if console.is_terminal:
        console.print(Syntax(text, "yaml", background_color="default", word_wrap=False))
    else:  # piped: plain text that loads back as YAML
        typer.echo(text, nl=False)


@app.command()
def train(
    files: Files,
    set_: Overrides = None,
    run_dir: Annotated[Path | None,
                       typer.Option("--run-dir", help="Where the run writes (default runs/<time>).")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from the last checkpoint in --run-dir.")] = False,
    allow_config_change: Annotated[list[str] | None, typer.Option(
        "--allow-config-change", help="With --resume: a key (or a prefix ending in '.') whose value may differ from "
                                      "the recorded config.yaml; repeat for several. metrics.jsonl or samples.jsonl: "
                                      "resume although that file lacks rows before the checkpoint (damage).")] = None,
) -> None:
    """Train with the merged config FILES.

    FILES: e.g. an example config plus seed files.

    Exit codes: 0 done; 1 the run failed (what failed, the last complete checkpoint and the resume command are printed,
    the traceback appended to RUN/train.log); 2 bad input (config, run directory, key variable); 3 stopped by a monitor
    (``monitors.on_fail: stop``) after saving a checkpoint; 130 / 143 stopped by SIGINT / SIGTERM after saving a
    checkpoint (resume with --resume).

    One run per directory: a second run on a directory in use is refused (exit 2) naming the holder's PID and host.
    --resume refuses a corrupt latest checkpoint, naming the complete one before it, and a metrics.jsonl / samples.jsonl
    that lacks rows before the checkpoint unless --allow-config-change names the file."""
    from tether.distributed import ray_backend  # noqa: PLC0415 — torch, transformers: not for --help
    from tether.learner.checkpoint import latest_checkpoint, resumable_checkpoint  # noqa: PLC0415 — as above
    from tether.pipeline import monitors, trainer  # noqa: PLC0415 — as above

    cfg = load_or_exit(files, set_)
    run_training = ray_backend.train_on_ray if cfg.backend == "ray" else trainer.train  # one loop: in actors or here
    if resume and run_dir is None:
        raise fail("--resume needs --run-dir (the run to continue)")
    run_dir = run_dir or Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    check_run_dir(run_dir)
    if cfg.model.path:
        check_weights(Path(cfg.model.path))
    recorded = stamp(run_dir / "config.yaml")  # the run rewrites it once past its checks of the run directory
    try:
        if resume:  # a corrupt latest checkpoint: one line naming the complete one before it (before Ray starts)
            resumable_checkpoint(run_dir)
        result = run_training(cfg, run_dir, resume=resume, allow_config_change=tuple(allow_config_change or ()))
    except (Preempted, monitors.MonitorStop) as e:
        hint = ("change the keys the warnings above name, then resume with (adding --allow-config-change KEY for "
                "each changed key)") if isinstance(e, monitors.MonitorStop) else "resume with"
        Console(stderr=True, soft_wrap=True).print(
            f"{escape(str(e))}\n{hint}: {escape(resume_command(files, set_, run_dir))}", highlight=False)
        raise typer.Exit(e.exit_code) from None
    except Exception as e:  # noqa: BLE001 — any failure of the run: a few lines here, the traceback in train.log
        now = stamp(run_dir / "config.yaml")
        raise run_failed(e, resume_command(files, set_, run_dir), run_dir, latest_checkpoint(run_dir),
                          wrote=now is not None and now != recorded, fresh=recorded is None) from None
    after = result.eval_after.get("eval/success_rate")
    typer.echo(f"run directory: {result.run_dir}" + (f"  (held-out success {after:.2%})" if after is not None else ""))
    _print_report(result.run_dir)


def _print_report(run_dir: Path) -> None:
    """Build RUN/report and print its page; the run is done, so a failure here is a warning, not an exit."""
    try:
        from tether.report import build_report  # noqa: PLC0415 — matplotlib: not for --help

        typer.echo(f"report: {build_report(run_dir).index}")
    except Exception as e:  # noqa: BLE001 — any fault of the plots must not fail a finished training run
        Console(stderr=True, soft_wrap=True).print(
            f"[yellow]warning:[/] no report ({escape(type(e).__name__)}: {escape(str(e))}); build it later with "
            f"tether report {escape(str(run_dir))}", highlight=False)


@app.command()
def sft(
    files: Files,
    set_: Overrides = None,
    demos: Annotated[Path | None, typer.Option(
        "--demos", help="JSONL file, one conversation per line (OpenAI messages with tool calls; the format is "
                        "in tether/warmstart/demos.py).")] = None,
    expert: Annotated[bool, typer.Option(
        "--expert", help="Demonstrate every train task with the environment's scripted expert.")] = False,
    mistake_rate: Annotated[float, typer.Option(
        "--mistake-rate", help="With --expert: the fraction of episodes with its systematic mistakes.")] = 0.0,
    out: Annotated[Path | None, typer.Option(
        "--out", help="Checkpoint folder to write (default runs/sft-<time>).")] = None,
    epochs: Annotated[int, typer.Option("--epochs", min=1, help="Passes over the demonstrations.")] = 3,
    lr: Annotated[float, typer.Option("--lr", min=0.0, help="Peak learning rate (AdamW, warm-up then cosine).")] = 1e-4,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Demonstrations per update.")] = 8,
) -> None:
    """Supervised warm start: fine-tune the model on demonstrations.

    Fine-tunes the config's model on the tokens the agent loop would produce (mask-1 only), then writes a Hugging Face
    checkpoint to train from (model.path). With model.lora only an adapter is trained, and the weights written have it
    merged in."""
    import torch  # noqa: PLC0415 — torch, transformers: not for --help

    from tether.learner.model import load_model_and_tokenizer, torch_dtype  # noqa: PLC0415 — as above
    from tether.learner.sft import sft as fine_tune  # noqa: PLC0415 — as above
    from tether.runtime import env_factory, model_path  # noqa: PLC0415 — as above

    cfg = load_or_exit(files, set_)
    if (demos is None) == (not expert):
        raise fail("give exactly one of --demos FILE.jsonl and --expert")
    if not 0.0 <= mistake_rate <= 1.0 or (mistake_rate and not expert):
        raise fail(f"--mistake-rate is a fraction in [0, 1] and goes with --expert, got {mistake_rate}")
    out = out or Path("runs") / time.strftime("sft-%Y%m%d-%H%M%S")
    try:
        conversations = read_conversations(demos) if demos else None  # a bad file fails before any model loads
        say(f"building the environment {cfg.environment.name} and loading the model…")
        make_env, tasks = env_factory(cfg)
        model, tokenizer = load_model_and_tokenizer(model_path(cfg), "float32")  # master weights: model.dtype computes
        if conversations is not None:
            env = make_env()
            try:  # what a conversation leaves out is filled in as the agent loop would see it
                system, tools = env.system_prompt(), env.tool_schemas()
            finally:
                env.close()
            assert demos is not None  # the conversations were read from it
            trajs = jsonl_demos(demos, tokenizer, system_prompt=system, tools=tools, conversations=conversations)
        else:
            train_tasks = tasks("train")
            say(f"replaying {len(train_tasks)} expert demonstrations through the agent loop…")
            trajs = expert_demos(cfg.environment.name, make_env, train_tasks, tokenizer,
                                 limits=LoopLimits.from_config(cfg.agent_loop, cfg.environment.state.context_window),
                                 parser=cfg.tool_parser.name, mistake_rate=mistake_rate, seed=cfg.trainer.seed)
            typer.echo(f"expert: {sum(t.success for t in trajs)}/{len(trajs)} train tasks solved")
    except (DemoError, ValueError, FileNotFoundError) as e:
        raise fail(str(e)) from None
    tokens = sum(t.num_model_tokens for t in trajs)
    plural = "s" if epochs != 1 else ""
    typer.echo(f"{len(trajs)} demonstrations, {tokens} trained tokens; {epochs} epoch{plural} at lr {lr:g}")
    torch.manual_seed(cfg.trainer.seed)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if cfg.model.lora is not None:  # an adapter on the frozen model, merged into the weights written
        from tether.learner import lora  # noqa: PLC0415 — peft, with model.lora only

        model = lora.wrap(model, cfg.model.lora)
    with sft_bar(epochs * len(trajs)) as (seen, log):
        fine_tune(model, trajs, pad_id=pad, epochs=epochs, lr=lr, batch_size=batch_size, seed=cfg.trainer.seed,
                  augment=seen, log=log, compute_dtype=torch_dtype(cfg.model.dtype))
    if cfg.model.lora is not None:
        model = model.merge_and_unload()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    typer.echo(f"wrote {out}; train from it with --set model.preset=null --set model.path={out}")


@app.command(name="eval")
def eval_(
    checkpoint: Annotated[Path, typer.Argument(help="A Hugging Face model folder, e.g. RUN/checkpoints/step_N.")],
    config_files: Annotated[list[Path], typer.Option("--config", help="Config file(s) of the run.")],
    set_: Overrides = None,
    tasks: Annotated[int | None, typer.Option("--tasks", min=1, help="Evaluate the first N held-out tasks.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the metrics as JSON.")] = False,
    trials: Annotated[int, typer.Option("--trials", min=1, help=(
        "Rollouts per task. 1: greedy. K > 1: sampled at engine.temperature, and pass^1 .. pass^K are reported "
        "per task kind (a tau2 task's kind is its domain), as tau2's report does."))] = 1,
) -> None:
    """Evaluate CHECKPOINT on the held-out split: pass^k per task kind.

    One greedy rollout per task, or --trials sampled ones; tau-bench's pass^k: the mean over tasks of
    C(successes, k) / C(trials, k)."""
    from tether.runtime import Runtime  # noqa: PLC0415 — torch, transformers: not for --help

    cfg = load_or_exit(config_files, set_)
    check_checkpoint(checkpoint)
    try:
        rt = Runtime.build(cfg, str(checkpoint))
    except (ConfigError, OSError, ValueError) as e:  # e.g. engine.max_tokens past the model's positions
        raise fail(str(e)) from None
    try:
        eval_tasks = rt.tasks("eval")[:tasks]
        rollouter = Rollouter(rt.loop(greedy=trials == 1), rt.make_env,
                              max_concurrent=cfg.rollout.worker.max_concurrent_tasks, rewards=rt.rewards)
        if trials == 1:
            metrics, trajs = asyncio.run(evaluate(rollouter, eval_tasks, seed=cfg.trainer.seed))
            per_task = [[t] for t in trajs]
        else:
            groups = asyncio.run(rollouter.groups(eval_tasks, trials, cfg.trainer.seed, keep_failed=True))
            by_id = {g.task_id: g.trajectories for g in groups}
            per_task = [by_id.get(t.id, []) for t in eval_tasks]
            trajs = [t for ts in per_task for t in ts]
            metrics = eval_metrics([t for t, ts in zip(eval_tasks, per_task) for _ in ts], trajs)
    finally:
        rt.close()
    kinds, wins = [t.kind for t in eval_tasks], [[t.success for t in ts] for ts in per_task]
    for kind, ks in passk.by_group(kinds, wins).items():
        metrics.update({f"eval/pass^{k}/{kind}": v for k, v in ks.items()})
    if as_json:
        typer.echo(json.dumps(metrics, indent=2))
    else:
        shown = [t for t, ts in zip(eval_tasks, per_task) for _ in ts]
        show_eval(Console(), str(checkpoint), metrics, shown, trajs, rows=3)
        for k, v in metrics.items():
            typer.echo(f"{k:40s} {v:.4f}")
        typer.echo(passk.report(kinds, wins, [[t.reward for t in ts] for ts in per_task],
                                [[t.hacking_flags.get("no_op_pass", 0) > 0 for t in ts] for ts in per_task]))


@app.command()
def export(
    checkpoint: Annotated[Path, typer.Argument(help="A LoRA checkpoint: RUN/checkpoints/step_N of a model.lora run.")],
    out: Annotated[Path, typer.Option("--out", help="The folder to write (must not exist).")],
    merge: Annotated[bool, typer.Option("--merge", help="Merge the adapter into the base's weights (required: the "
                                                        "only export built).")] = False,
) -> None:
    """Merge a LoRA CHECKPOINT into its base as a plain HF model folder.

    The folder holds the merged weights and the tokenizer. The base is the folder the adapter names
    (adapter_config.json's base_model_name_or_path); W + (alpha / rank) · B A is computed and written
    in float32. The result loads with AutoModelForCausalLM.from_pretrained and needs neither peft nor the base."""
    import torch  # noqa: PLC0415 — torch, transformers: not for --help
    from transformers import AutoTokenizer  # noqa: PLC0415 — as above

    from tether.learner import lora  # noqa: PLC0415 — peft, as above

    if not merge:
        raise fail("give --merge: the merged weights are the only export built (the checkpoint itself is the adapter "
                   "in peft's format)")
    if not lora.is_adapter_folder(checkpoint):
        raise fail(f"{checkpoint} is not a LoRA checkpoint (no adapter_config.json, or a whole model's config.json "
                   "beside it): a full fine-tuning checkpoint is already a merged model folder")
    if out.exists():
        raise fail(f"--out {out} already exists; give a new folder")
    check_weights(checkpoint)
    try:
        model = lora.load_merged(checkpoint, torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(checkpoint), local_files_only=True)
    except (OSError, ValueError, KeyError) as e:  # the base folder moved, a damaged adapter
        raise fail(f"{checkpoint}: {e}") from None
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    typer.echo(f"wrote {out}: {lora.base_of(checkpoint)} with the adapter merged in")


@app.command()
def serve(
    checkpoint: Annotated[Path, typer.Argument(help="A Hugging Face model folder, e.g. RUN/checkpoints/step_N.")],
    host: Annotated[str, typer.Option("--host", help="Address to listen on (loopback by default).")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=0, max=65535, help="Port to listen on; 0 = any free one.")] = 8000,
    api_key_env: Annotated[str | None, typer.Option(
        "--api-key-env", metavar="VAR", help="Require 'Authorization: Bearer <key>', the key read from the "
                                             "environment variable VAR at start.")] = None,
    config_files: Annotated[list[Path] | None, typer.Option(
        "--config", help="Config file(s): model.dtype, engine.max_batch_size, rollout.partial_rollout, "
                         "tool_parser (name, stop_token_ids), trainer.seed.")] = None,
    set_: Overrides = None,
    served_model_name: Annotated[str | None, typer.Option(
        "--served-model-name", help="The model id clients send (default: the checkpoint folder's name).")] = None,
    chat_template: Annotated[Path | None, typer.Option(
        "--chat-template", metavar="FILE", help="A Jinja chat template file that renders chat requests instead of "
                                                "the checkpoint's own (vLLM's option). A policy reads prompts as it "
                                                "was trained on them: check with `tether verify consistency`.")] = None,
    max_loras: Annotated[int, typer.Option(
        "--max-loras", min=0, help="LoRA adapters loaded at once through /v1/load_lora_adapter (vLLM's option); "
                                   "each is served from a copy of the model's weights.")] = 4,
    enable_weight_updates: Annotated[bool, typer.Option(
        "--enable-weight-updates", help="Allow the weight-update routes (/update_weights_from_*, LoRA loading) without "
                                        "an API key (with --api-key-env they are allowed): engine.type remote "
                                        "training needs them.")] = False,
    weights_root: Annotated[Path | None, typer.Option(
        "--weights-root", metavar="FOLDER", help="The folder under which /update_weights_from_disk and "
                                                 "/v1/load_lora_adapter may read (default: CHECKPOINT's parent "
                                                 "folder, e.g. RUN/checkpoints).")] = None,
    max_request_bytes: Annotated[int | None, typer.Option(
        "--max-request-bytes", min=1, help="The largest request body of the JSON routes (413 above it; default: 128 "
                                           "bytes per token of the model's context, at least 4 MiB); weight tensors "
                                           "pushed in a body are not bounded.")] = None,
    stream_interval: Annotated[str, typer.Option(
        "--stream-interval", help="Tokens per streamed chunk after a choice's first (vLLM's flag; 1 = every decode "
                                  "step's tokens as the step ends), or auto: 1 while at most 16 choices stream at "
                                  "once, above that one more token a chunk per 16 more streams (at most 8), so the "
                                  "chunks a decode step makes stay about 16.")] = "auto",
    latency_rows: Annotated[int, typer.Option(
        "--latency-rows", min=0, help="A request of at most this many choices (n) is latency-sensitive: while one "
                                      "is queued or running, requests of more choices decode at most this many rows "
                                      "together (the rest parked, resumed after), so its decode steps stay short; "
                                      "0 = off.")] = 4,
) -> None:
    """Serve CHECKPOINT over an OpenAI-compatible HTTP API.

    On the local engine: chat and text completions, token ids in and out, weight updates; prints the address and runs
    until Ctrl-C. Exit 2 on bad input."""
    from tether.serve import server  # noqa: PLC0415 — torch: not for --help

    api_key = None
    if api_key_env is not None:
        api_key = os.environ.get(api_key_env)
        if api_key is None:
            raise fail(f"--api-key-env {api_key_env}: the variable {api_key_env} is not set in this process")
        if not api_key.strip():
            raise fail(f"--api-key-env {api_key_env}: the variable {api_key_env} is empty")
    cfg = load_or_exit(config_files or [], set_)
    check_checkpoint(checkpoint, "pass a Hugging Face model folder")
    interval = None if stream_interval == "auto" else int(stream_interval) if stream_interval.isdigit() else 0
    if interval == 0:
        raise fail(f"--stream-interval {stream_interval}: pass a whole number of tokens >= 1, or auto")
    try:
        template = None if chat_template is None else server.read_chat_template(chat_template)
    except ValueError as e:
        raise fail(str(e)) from None
    try:
        server.serve(checkpoint, cfg, host=host, port=port, model_name=served_model_name, api_key=api_key,
                     api_key_env=api_key_env, chat_template=template, max_loras=max_loras,
                     weight_updates=enable_weight_updates, weights_root=weights_root,
                     max_request_bytes=max_request_bytes, stream_interval=interval,
                     latency_rows=latency_rows)
    except OSError as e:  # the port is taken, the host is not an address of this machine
        raise fail(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    except (ConfigError, ValueError) as e:
        raise fail(str(e)) from None


@app.command()
def ping(
    config_files: Annotated[list[Path] | None, typer.Option(
        "--config", help="Config file(s) whose llm_client section names the endpoint.")] = None,
    base_url: Annotated[str | None, typer.Option(
        "--base-url", help="Endpoint, ending in /v1 (overrides llm_client.base_url).")] = None,
    model: Annotated[str | None, typer.Option("--model", help="Model id (overrides llm_client.model).")] = None,
    api_key_env: Annotated[str | None, typer.Option(
        "--api-key-env", metavar="VAR", help="Environment variable holding the key, read now and never printed "
                                             "(overrides llm_client.api_key).")] = None,
    set_: Overrides = None,
) -> None:
    """Send one chat request to the llm_client endpoint.

    The request is "ping", max_tokens 8, no retries; prints the reply and its latency, or what to check. Exit 0 ok, 1
    endpoint fault, 2 bad config or environment."""
    overrides = list(set_ or [])
    if api_key_env is not None:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", api_key_env):
            raise fail(f"--api-key-env {api_key_env!r}: expected an environment variable name, not a value")
        overrides.append(f"llm_client.api_key=${{{api_key_env}}}")
    for key, value in (("base_url", base_url), ("model", model)):
        if value is not None:
            overrides.append(f"llm_client.{key}={json.dumps(value)}")  # quoted: the value stays a string
    cfg = load_or_exit(config_files or [], overrides)
    section = cfg.llm_client
    if section.base_url == type(section).model_fields["base_url"].default:
        raise fail(f"no endpoint: llm_client.base_url is the placeholder {section.base_url}; give --base-url URL "
                   "or a --config file that sets it")
    try:
        client = LLMClient.from_config(section, max_retries=0)  # one request: a fault shows as it is
    except (ConfigError, ValueError) as e:
        raise fail(str(e)) from None

    async def once() -> tuple[dict, float, list[str] | None, LLMError | None]:
        async with client:
            t = time.perf_counter()
            try:
                reply = await client.chat([{"role": "user", "content": "ping"}], max_tokens=8)
            except (BadRequest, MalformedResponse) as e:  # a wrong model id is the usual cause: list the served ones
                try:
                    served = await client.models()
                except LLMError:
                    served = None
                return {}, 0.0, served, e
            except LLMError as e:
                return {}, 0.0, None, e
            return reply, time.perf_counter() - t, None, None

    reply, latency, served, error = asyncio.run(once())
    if error is not None:
        extra = f"\n  the server lists these model ids: {', '.join(served)}" if served else ""
        raise fail(f"{type(error).__name__}: {error}{extra}", code=2 if error.config_fault else 1)
    message = reply["choices"][0].get("message") or {}
    content = message.get("content")
    shown = repr(content) if isinstance(content, str) else json.dumps(message)[:200]
    typer.echo(f"ok: {client.model} at {display_url(client.base_url)} replied {shown} in {latency * 1000:.0f} ms")


@app.command()
def report(
    run_dir: Annotated[Path, typer.Argument(help="A run directory (holds metrics.jsonl); finished or in progress.")],
    out: Annotated[Path | None, typer.Option("--out", help="Folder to write (default RUN_DIR/report).")] = None,
) -> None:
    """Plot a run's metrics: PNG figures and an HTML page.

    The page is index.html, self-contained; one figure each for success and reward, learning signal, KL and entropy,
    staleness, queue, idle ratios, reward components and monitors."""
    from tether.report import ReportError, build_report  # noqa: PLC0415 — matplotlib: not for --help

    try:
        built = build_report(run_dir, out)
    except (ReportError, OSError) as e:  # OSError: --out is a file, or not writable
        raise fail(str(e)) from None
    for note in built.notes:
        typer.echo(f"note: {note}")
    typer.echo(f"{len(built.figures)} figures: {', '.join(p.name for p in built.figures)}")
    typer.echo(f"report: {built.index}")


if __name__ == "__main__":  # python -m tether.cli
    app()
