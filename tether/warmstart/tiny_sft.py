"""The ``tiny-sft`` preset: the tiny model warm-started on the customer-service expert's demonstrations.

The untrained ``tiny`` preset never succeeds at the customer-service task, so every GRPO group is
degenerate (all rewards equal) and RL has nothing to learn from. ``tiny-sft`` is the demo's warm start:

1. build the tiny preset, narrowed (``Recipe.model``), with one token per entity of the environment's
   database (``entities.py``: digit-coded, frozen embeddings);
2. a copy task alone (``copy_steps``), which forms the copying head;
3. SFT on demonstrations of a deliberately imperfect expert (``imperfect_expert.py``, ``mistake_rate``)
   replayed through the real agent loop — first without the system prompt with the copy task alongside
   (``dialogue_epochs``), then on the exact sequences RL will generate (``full_epochs``) — with entity ids
   swapped at random each time a demonstration is trained on.

The imperfect expert leaves room for RL: its mistakes are stratified (``mistakes``, ``replays``): each train task is
replayed 3 times, exactly ``round(3 × mistake_rate)`` = 2 of them with the expert's mistakes where one applies and
one without, so the right and the wrong LATE / NOT_NEEDED refund code both stay in the warm start's distribution
(``benchmarks/reason_codes.py``: drawn per episode instead, ``sampled``, the right code's probability lands anywhere
between 0.07 and 0.65 by the build's seed, and below ~0.1 RL did not find it in 32 steps). The swaps and the copy
task draw among every entity of the database (``entity_pool: database``; ``train``, the train demonstrations'
entities only, leaves the model preferring those: 0.97 of their tokens copied right, 0.83 of the others',
``entities.py``). Measured on build seeds 0 and 1 (session 22, ``benchmarks/time_to_target.py --steps 32``):
greedy decoding of the warm start succeeds on 34-36 % of held-out tasks, and GRPO reaches 90 % within 32 steps on RL
seeds 0-2 (README, "Measured", for this commit's figures). ``examples/customer_service/demo.py`` calls
``model_path``, which builds the preset once into the cache (``tether.runtime.model_path``), keyed by ``cache_key``.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import torch

from tether.agent.loop import LoopLimits
from tether.config import RunConfig
from tether.config.plan import max_env_steps
from tether.env.customer_service import CustomerServiceEnv, example_texts
from tether.env.customer_service.tasks import world_eval_tasks
from tether.learner.model import BUILD_VERSION, TINY_DEFAULTS, TINY_VOCAB_SIZE, build_tiny, load_model_and_tokenizer
from tether.learner.sft import sft
from tether.learner.tiny import CHAT_TEMPLATE, IM_START
from tether.threads import TorchThreads
from tether.types import Task, Trajectory
from tether.warmstart.demos import expert_demos
from tether.warmstart.entities import (
    CopyTask,
    EntitySwap,
    EntityVocab,
    copy_pretrain,
    init_entity_embeddings,
    tied_class_gradients,
    world_entities,
)

ENVIRONMENT = "customer_service_agent"
_RECIPE_VERSION = 1  # bump when this file's recipe changes in a way the Recipe fields do not show


@dataclass(frozen=True)
class Recipe:
    """What ``build_tiny_sft`` does; the defaults are the demo's (SFT + RL in a few minutes on 2 cores)."""

    model: dict[str, int] = field(default_factory=lambda: dict(
        hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2))
    corpus_texts: int = 400  # environment texts the tokenizer is trained on (plus the built-in corpus)
    copy_steps: int = 100  # the copy task alone, before SFT
    copy_lr: float = 3e-3
    copy_batch_size: int = 32
    dialogue_epochs: int = 6  # system prompt dropped, copy task alongside
    dialogue_lr: float = 3e-3
    full_epochs: int = 1  # the exact sequences RL will generate
    full_lr: float = 1e-3
    batch_size: int = 8
    mistake_rate: float = 0.6
    mistakes: Literal["sampled", "stratified"] = "stratified"  # exact shares per task, or drawn per episode
    replays: int = 3  # each train task's demonstrations (stratified at 0.6: 1 right, 2 with the mistakes)
    entity_pool: Literal["train", "database"] = "database"  # what the swaps and the copy task draw among
    max_train_tasks: int | None = None  # demonstrations of the first N train tasks (None: all)
    seed: int = 0  # the build's seed (model init, expert mistakes, SFT order); RL's is trainer.seed


RECIPE = Recipe()


def imperfect_demos(cfg: RunConfig, tasks: list[Task], tokenizer: Any, recipe: Recipe, seed: int) -> list[Trajectory]:
    """``recipe.replays`` demonstrations of each task by the imperfect expert: its mistakes drawn per episode at
    ``mistake_rate`` (``sampled``), or exactly ``round(replays × mistake_rate)`` of each task's replays with its
    mistakes where one applies and the rest without (``stratified``)."""
    if recipe.replays < 1 or not 0.0 <= recipe.mistake_rate <= 1.0:
        raise ValueError(f"Recipe.replays must be >= 1 and mistake_rate in [0, 1], got {recipe.replays} and "
                         f"{recipe.mistake_rate}")
    def play(tasks: list[Task], rate: float) -> list[Trajectory]:
        return expert_demos(ENVIRONMENT, lambda: CustomerServiceEnv(cfg), tasks, tokenizer, parser=cfg.tool_parser.name,
                            limits=LoopLimits.from_config(cfg.agent_loop, cfg.environment.state.context_window),
                            mistake_rate=rate, seed=seed)

    if recipe.mistakes == "sampled":
        return play(tasks * recipe.replays, recipe.mistake_rate)
    wrong = round(recipe.replays * recipe.mistake_rate)
    right = recipe.replays - wrong
    return (play(tasks, 0.0) * right if right else []) + (play(tasks, 1.0) * wrong if wrong else [])


def without_system_prompt(traj: Trajectory, turn_start: int) -> Trajectory:
    """The trajectory from its first user turn on: the system prompt and tool list (~290 of its ~400
    tokens, the same in every demonstration) dropped, so an epoch costs a quarter."""
    first_user = traj.prompt_ids.index(turn_start, 1)
    return replace(traj, prompt_ids=traj.prompt_ids[first_user:])


def _tokens(trajs: list[Trajectory]) -> int:
    return sum(len(t.prompt_ids) + len(t.response_ids) for t in trajs)


class EpochClock:
    """The time left of a build's SFT phases, appended to each epoch's log line: the epochs left of every phase
    times a measured epoch's seconds, a phase not reached yet scaled from the last measured one by its tokens per
    epoch (an estimate; it firms up as phases are measured)."""

    def __init__(self, log: Callable[[str], None], phases: list[tuple[str, int, int]],
                 clock: Callable[[], float] = time.perf_counter):
        self.log, self.clock = log, clock
        self.epochs = {name: epochs for name, epochs, _ in phases}
        self.tokens = {name: max(tokens, 1) for name, _, tokens in phases}
        self.order = [name for name, _, _ in phases]
        self.done = dict.fromkeys(self.order, 0)
        self.seconds: dict[str, float] = {}  # seconds per epoch, by phase (the last measured)
        self._t: float | None = None

    def phase(self, name: str) -> Callable[[str], None]:
        """The ``log`` to give ``sft`` for phase ``name``: its epoch lines get the time left."""
        self._t = None

        def log(msg: str) -> None:
            now = self.clock()
            if msg.startswith("sft epoch"):
                if self._t is not None or self.done[name] == 0:
                    start = self._t if self._t is not None else self._start
                    self.seconds[name] = now - start
                self.done[name] += 1
                self._t = now
                left = self.left()
                if left is not None:
                    msg += f" — about {_duration(left)} of the build left"
            self.log(msg)

        self._start = self.clock()
        return log

    def left(self) -> float | None:
        """Seconds left of every phase, or None before any epoch was measured."""
        if not self.seconds:
            return None
        ref = next(n for n in reversed(self.order) if n in self.seconds)
        per_token = self.seconds[ref] / self.tokens[ref]
        return sum((self.epochs[n] - self.done[n]) * self.seconds.get(n, per_token * self.tokens[n])
                   for n in self.order)


def _duration(seconds: float) -> str:
    minutes = round(seconds / 60)
    return f"{minutes} min" if minutes >= 1 else f"{max(1, round(seconds))} s"


def _check_environment(cfg: RunConfig) -> None:
    if cfg.environment.name != ENVIRONMENT:
        raise ValueError(f"model.preset tiny-sft is warm-started on the {ENVIRONMENT} environment, not "
                         f"{cfg.environment.name!r}: use model.preset tiny and `tether sft` with your demonstrations")


def cache_key(cfg: RunConfig, recipe: Recipe | None = None) -> str:
    """A short hash of what the preset's weights depend on: the recipe (default ``RECIPE``, its seed included), the
    code versions, the world and the train tasks (the environment section; ``num_eval_tasks`` only where it grows
    the world, ``world_eval_tasks``; ``state.max_turns`` only up to what the agent loop can reach), the agent
    loop's limits and the tool parser. Not in it: the verifier (the demonstrations are the expert's whatever it
    scores) and ``trainer.seed`` (it seeds RL, not the preset)."""
    recipe = recipe or RECIPE
    env = cfg.redacted_dict()["environment"]
    env.pop("verifier", None)
    env["num_eval_tasks"] = world_eval_tasks(cfg.environment.num_eval_tasks)
    reach = max_env_steps(cfg.agent_loop.max_assistant_turns, cfg.agent_loop.max_parallel_calls)
    env["state"]["max_turns"] = min(cfg.environment.state.max_turns, reach)  # past the loop's reach: all the same
    limits = LoopLimits.from_config(cfg.agent_loop, cfg.environment.state.context_window)
    key = json.dumps([BUILD_VERSION, _RECIPE_VERSION, CHAT_TEMPLATE, TINY_DEFAULTS, TINY_VOCAB_SIZE,
                      asdict(recipe), env, asdict(limits), cfg.tool_parser.name], sort_keys=True, default=str)
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def build_tiny_sft(cfg: RunConfig, out: str | Path, *, seed: int | None = None, recipe: Recipe | None = None,
                   log: Callable[[str], None] = print) -> Path:
    """Build the tiny model and fine-tune it on imperfect demonstrations into ``out`` (an HF folder); the
    recipe defaults to ``RECIPE``, the seed to the recipe's.

    The torch thread count follows the load (``tether.threads``: re-decided every 25 copy-task steps and every SFT
    epoch, at most the caller's count); the weights' last bits depend on it, so ``tether_warmstart.json`` records
    every count decided (``torch_threads``) and ``TETHER_THREADS=N`` fixes it for a reproducible build."""
    _check_environment(cfg)
    recipe = recipe or RECIPE
    seed = recipe.seed if seed is None else seed
    out = Path(out)
    t0 = time.perf_counter()
    names = world_entities(cfg)
    with tempfile.TemporaryDirectory(prefix="tiny-base-") as base:
        build_tiny(base, corpus=example_texts(recipe.corpus_texts), seed=seed,
                   extra_tokens=[e for v in names.values() for e in v], **recipe.model)
        model, tokenizer = load_model_and_tokenizer(base)
    vocab = EntityVocab.build(names, tokenizer)
    init_entity_embeddings(model, vocab, seed)
    tasks = CustomerServiceEnv(cfg).tasks("train")[: recipe.max_train_tasks]
    demos = imperfect_demos(cfg, tasks, tokenizer, recipe, seed)
    ok = sum(d.success for d in demos) / len(demos)
    log(f"{len(demos)} demonstrations ({len(tasks)} train tasks × {recipe.replays}, mistakes {recipe.mistakes}), "
        f"expert success {ok:.0%}, "
        f"{_tokens(demos) / len(demos):.0f} tokens each; "
        f"{sum(len(v) for v in names.values())} entity tokens ({', '.join(f'{len(v)} {c}' for c, v in names.items())})")
    pools = (vocab.ids if recipe.entity_pool == "database"  # every entity of the database (entities.py)
             else vocab.pools(t for d in demos for t in d.prompt_ids + d.response_ids))  # the train demos' only
    entity_ids = {i for v in vocab.ids.values() for i in v}
    copy_task = CopyTask(pools, vocab.markers, seed=seed, pad_id=tokenizer.pad_token_id,
                         filler=[t for d in demos for t in d.prompt_ids + d.response_ids if t not in entity_ids])
    swap = EntitySwap(pools)
    turn_start = tokenizer.convert_tokens_to_ids(IM_START)
    pad = tokenizer.pad_token_id
    short = [without_system_prompt(d, turn_start) for d in demos]
    progress = EpochClock(log, [("dialogue", recipe.dialogue_epochs, _tokens(short)),
                                ("full", recipe.full_epochs, _tokens(demos))])
    log(f"SFT: {recipe.dialogue_epochs} epochs without the system prompt ({_tokens(short) / 1e6:.2f} M tokens each), "
        f"then {recipe.full_epochs} on the full sequences ({_tokens(demos) / 1e6:.2f} M tokens each); the time left "
        "is estimated after each epoch")
    threads = TorchThreads(log)  # one for the three phases: each gives the caller's count back
    with torch.random.fork_rng(devices=[]), tied_class_gradients(model, vocab):  # the caller's RNG untouched
        torch.manual_seed(seed)
        copy_pretrain(model, copy_task, steps=recipe.copy_steps, lr=recipe.copy_lr,
                      batch_size=recipe.copy_batch_size, log=log, threads=threads)
        dialogue = sft(model, short, pad_id=pad, seed=seed, augment=swap, extra_loss=copy_task.loss,
                       log=progress.phase("dialogue"), epochs=recipe.dialogue_epochs, lr=recipe.dialogue_lr,
                       batch_size=recipe.batch_size, threads=threads)
        full = sft(model, demos, pad_id=pad, seed=seed, augment=swap, log=progress.phase("full"),
                   epochs=recipe.full_epochs, lr=recipe.full_lr, batch_size=recipe.batch_size, threads=threads)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    losses: list[float | None] = [*dialogue, *full] or [None]
    (out / "tether_warmstart.json").write_text(json.dumps({
        "preset": "tiny-sft", "seed": seed, "recipe": asdict(recipe), "demonstrations": len(demos),
        "expert_success": ok, "sft_nll_per_token": losses[-1], "torch_threads": threads.counts,
        "build_s": round(time.perf_counter() - t0, 1),
    }, indent=2))
    return out


