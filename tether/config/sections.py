"""The sections beside ``environment``: client, model, engine, rollout, buffer, learner, policy optimisation, trainer
and placement (the agent loop and parser: ``tether.config.agent``)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, PrivateAttr, field_validator, model_validator

from tether.config.base import *  # noqa: F401,F403 — the shared types
from tether.config.base import _check

# ----------------------------------------------------------------------------- client


class LLMClientConfig(Section):
    """An OpenAI-compatible endpoint (rollouts on a server, judges, teachers, ``tether ping``), used through
    ``tether.llm.LLMClient.from_config``.

    ``base_url`` and ``model`` may contain ``${VAR}``; like the key they are resolved at use time by
    ``resolved()``. The section knows where it sits in the run's config (``key_path``: ``llm_client``,
    ``reward.judge_client``, ``environment.user_llm.client``, ``teacher.remote``), so that an error names the
    endpoint's own keys."""

    _key_path: str = PrivateAttr("llm_client")  # set by ``tether.secrets.name_secrets`` when a RunConfig is built

    base_url: str = "https://api.example.com/v1"
    """Endpoint URL, http:// or https:// (or a ``${VAR}`` reference)."""
    api_key: Secret | None = None
    """API key, best given as ``${VAR}``; None = no Authorization header."""
    model: str = "your-rollout-model-id"
    """Model id sent with each request."""
    timeout_s: PosFloat = 60.0
    """Timeout of one request, seconds."""
    max_retries: NonNegInt = 3
    """Retries of a request that failed in a retryable way (429, 5xx, refused connection), in requests."""
    max_concurrency: PosInt = 64
    """Requests in flight at once to this endpoint, in requests; shared by every client of the same base_url and
    model in the process (rollout workers, judge, ping), the stricter value winning. tether's own key."""
    requests_per_minute: PosFloat | None = None
    """Request rate limit, in requests per minute (a token bucket, burst of one second's worth, shared like
    max_concurrency; every retry counts); None = unlimited. tether's own key."""
    tokens_per_minute: PosFloat | None = None
    """Token rate limit, in tokens per minute: prompt (estimated at 4 characters a token for text) plus
    max_tokens, charged before the request and corrected from the answer's ``usage``; shared like
    max_concurrency; None = unlimited. tether's own key."""

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        if not v.startswith("${"):  # a ${VAR} reference is checked when resolved
            _check_url(v)
        return v

    @property
    def key_path(self) -> str:
        """The section's dotted path in the run's config, e.g. ``reward.judge_client`` (``llm_client`` alone)."""
        return self._key_path

    def resolved(self) -> dict[str, str | None]:
        """``base_url``, ``api_key`` and ``model`` with ``${VAR}`` read from the environment now."""
        url = interpolate(self.base_url, f"{self.key_path}.base_url")
        try:
            _check_url(url)
        except ValueError as e:
            raise ConfigError(f"`{self.key_path}.base_url` resolved to {url!r}: {e}") from None
        return {
            "base_url": url,
            "api_key": self.api_key.get() if self.api_key is not None else None,
            "model": interpolate(self.model, f"{self.key_path}.model"),
        }


def _check_url(url: str) -> None:
    if not url.startswith(("http://", "https://")):
        raise ValueError("must start with http:// or https:// (or be a ${VAR} reference)")


# ----------------------------------------------------------------------------- model and engine


class LoraConfig(Section):
    """A low-rank adapter trained on the frozen policy (``tether.learner.lora``, through peft): each target
    projection W [out, in] becomes W + (alpha / rank) · B A with A [rank, in] and B [out, rank], B starting at zero
    (the adapter starts as the identity: the first rollouts are the base model's). Only A and B are trained and held
    by AdamW, the KL reference is the base with the adapter switched off (no second model), and a weight sync moves
    A and B only (``perf/weight_sync_mb``): a rank-r adapter on the 7 projections of a layer is r · (sum of in + out)
    numbers a layer, ~1% of the layer at rank 16 on a 7B model."""

    rank: PosInt = 16
    """r, the adapter's rank (rows of A, columns of B), in dimensions: its capacity and its size grow with it."""
    alpha: PosFloat = 32.0
    """The scale numerator: the update is (alpha / rank) · B A, so alpha sets the step a learning rate makes
    independently of the rank's sum (peft's ``lora_alpha``)."""
    dropout: Annotated[float, Field(ge=0, lt=1)] = 0.0
    """Dropout on the adapter's input, a probability in [0, 1) (peft's ``lora_dropout``; on in training forwards
    only). Above 0 the learner scores π_prox in an extra pass, as for any dropout in the model."""
    target_modules: list[str] = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    """The linear layers that get an adapter, by module name suffix (peft's ``target_modules``): the attention and
    MLP projections of Llama/Qwen-style models by default."""

    @field_validator("target_modules")
    @classmethod
    def _some_targets(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("give at least one module name (an adapter on nothing trains nothing)")
        return v


class ModelConfig(Section):
    """The policy model: the built-in tiny preset or a Hugging Face folder (exactly one), and an optional adapter."""

    preset: Literal["tiny", "tiny-sft"] | None = "tiny"
    """Built-in model built from a config (no download), once, into the cache (``$TETHER_CACHE``): ``tiny``
    has random weights; ``tiny-sft`` is ``tiny`` warm-started on the customer-service expert's
    demonstrations (minutes, the first time), so RL learns from it. Cleared when only ``path`` is given."""
    path: str | None = None
    """Local Hugging Face model folder (``AutoModelForCausalLM``)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """The compute dtype, as verl and TRL mean it. ``bfloat16``: the trainer keeps float32 master weights and float32
    AdamW state, and runs the forward and backward in bfloat16 (``torch.autocast``; with ``actor_worker.strategy:
    fsdp2``, FSDP2's ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``); log-probabilities,
    entropy, KL and the loss are float32 (the logits upcast before the log-softmax). The KL reference computes the
    same way, without gradients; ``tether sft`` too. The rollout engine holds a bfloat16 copy of the weights (its KV
    cache in bfloat16), and every weight sync casts the learner's float32 weights to it. Checkpoints hold the float32
    weights. ``tether eval`` and ``tether serve`` load the model in this dtype."""
    lora: LoraConfig | None = None
    """Train a low-rank adapter instead of the full weights (any key of the section turns it on: ``model.lora:
    {}`` or ``--set model.lora.rank=8``); None (the default) = full fine-tuning. With ``actor_worker.strategy:
    fsdp2`` and several trainer ranks the base is sharded with the adapter inside it and a sync gathers the adapter
    alone. Refused at load with ``engine.weight_sync_dir`` (``backend: ray`` syncs the adapter alone to the rollouter;
    ``engine.type: remote`` pushes it alone to ``tether serve`` in the request body, ``tether.serve.adapters``).
    Checkpoints hold the adapter in peft's format (``tether export CKPT --merge`` writes merged weights)."""

    @model_validator(mode="after")
    def _one_source(self) -> ModelConfig:
        if self.path is not None and "preset" not in self.model_fields_set:
            self.preset = None  # giving a path replaces the default preset
        both = self.preset is not None and self.path is not None
        _check(
            (self.preset is None) != (self.path is None),
            "give exactly one of preset and path" + (" (set preset: null to use path)" if both else ""),
            preset=self.preset,
            path=self.path,
        )
        return self


class EngineConfig(Section):
    """Where and how the rollout policy samples."""

    type: Literal["local", "remote"] = "local"
    """local: the in-process torch engine (continuous batching). remote: an OpenAI-compatible server reached through
    ``llm_client`` (``tether serve``, or vLLM/SGLang; ``tether.engine.remote``): token ids in, token ids and
    behaviour logprobs out, the learner's weights pushed to its update endpoint at start and at every sync."""
    max_batch_size: PosInt = 64
    """Maximum sequences decoded together, in sequences (the engine's continuous batch)."""
    temperature: NonNegFloat = 1.0
    """Sampling temperature (unitless); 0 = greedy. Evaluation always samples greedily."""
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    """Nucleus sampling: the probability mass kept, in (0, 1]; 1 = no truncation."""
    max_tokens: PosInt = 64
    """Maximum new tokens per assistant turn, in tokens; a turn cut here is closed with the end-of-turn token."""
    # The keys below act in rollouts (and sampled ``tether eval``); greedy evaluation decodes the plain argmax without
    # them. What each does to the behaviour logprob: ``tether.engine.base``.
    top_k: NonNegInt = 0
    """Top-k truncation: draw among the k most likely tokens (and any tied with the k-th), in tokens; 0 = off
    (vLLM's ``top_k``). Like top_p, the recorded logprob is the untruncated one the learner scores (ratio 1 at equal
    weights), while tokens outside the k are never drawn: a bias no importance ratio sees."""
    min_p: Annotated[float, Field(ge=0, le=1)] = 0.0
    """Min-p truncation: drop the tokens whose probability (after temperature) is below min_p × the most likely
    token's, a fraction in [0, 1]; 0 = off (vLLM's ``min_p``). Like top_p, the recorded logprob is the untruncated
    one the learner scores, while the dropped tokens are never drawn."""
    repetition_penalty: Annotated[float, Field(gt=0)] = 1.0
    """Repetition penalty, a factor > 0 (unitless); 1 = off: the logit of every token already in the prompt or the
    turn's output is divided by it when positive, multiplied by it when negative (vLLM's and HF's semantics; > 1
    discourages repeats). Makes rollouts off-policy w.r.t. what the learner scores: tokens are drawn from the
    penalised logits but recorded with the model's own logprob (the learner cannot recompute a penalty), so the
    importance ratio stays 1 and nothing corrects the difference."""
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    """Presence penalty, in logits, in [-2, 2]; 0 = off: subtracted from the logit of every token generated at
    least once in the turn's output (OpenAI's semantics: the prompt, earlier turns included, does not count).
    Makes rollouts off-policy w.r.t. what the learner scores (see repetition_penalty)."""
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    """Frequency penalty, in logits per occurrence, in [-2, 2]; 0 = off: a token's logit loses this once for each
    time it was generated in the turn's output (OpenAI's semantics). Makes rollouts off-policy w.r.t. what the
    learner scores (see repetition_penalty)."""
    min_tokens: NonNegInt = 0
    """Minimum new tokens per assistant turn, in tokens, at most max_tokens; 0 = off: until a turn has this many,
    its stop tokens (EOS and the end-of-turn ids, ``tool_parser.stop_token_ids``) cannot be drawn (vLLM's
    ``min_tokens``). Makes rollouts off-policy w.r.t. what the learner scores: the recorded logprob keeps the
    stop tokens' share of the probability, which the draw did not have."""
    weight_sync_dir: str | None = None
    """engine.type remote: a folder this process writes and the server reads (shared storage); weights go
    there as safetensors and the server loads them through ``/update_weights_from_disk``. None = in the body of
    ``/update_weights_from_tensor`` (no shared folder needed). tether's own key."""

    @model_validator(mode="after")
    def _min_within_max(self) -> EngineConfig:
        _check(self.min_tokens <= self.max_tokens, "min_tokens must be at most max_tokens",
               min_tokens=self.min_tokens, max_tokens=self.max_tokens)
        return self


# ----------------------------------------------------------------------------- rollout and buffer


class SchedulerConfig(Section):
    """Admission of rollouts under bounded staleness."""

    type: Literal["fifo", "windowed_fifo"] = "windowed_fifo"
    """Order in which the trainer takes finished groups from the queue: finish order (fifo), or finish order
    within a window of start positions (windowed_fifo: bounded reordering, ``tether.pipeline.scheduler``)."""
    window_size: PosInt = 64
    """The windowed_fifo window, in groups (start positions after the oldest unconsumed group)."""
    max_hold_s: NonNegFloat | None = 0.25
    """windowed_fifo: the longest a finished group outside the window waits for it, in seconds; then it may be
    taken past the window, so a straggler holding the window cannot starve the trainer (null: it waits until the
    window reaches it, strictly bounded reordering; 0: as fifo). The straggler itself is never overtaken for
    longer than it runs: being the oldest, it is taken as soon as it finishes."""
    max_staleness: NonNegInt = 4
    """Admission control: how many parameter versions the rollouter may run ahead of the trainer, in versions
    (async modes; one_step_off_policy uses min(1, this)); 0 = the sync schedule."""


class PartialRolloutConfig(Section):
    """Interrupting generations at a weight sync and resuming them under the new weights."""

    enabled: bool = True
    """A weight sync interrupts in-flight generations, which resume under the new weights; false = the sync
    waits for them to finish under the old ones. The seed's ``rollouter.partial_rollout`` is an alias of it."""
    segment_length: PosInt = 8
    """Decode steps between interruption points, in tokens: every generation gets at least this many tokens
    from a version before the next weight sync is applied."""
    replay_buffer_size: PosInt = 512
    """Capacity of the priority replay buffer, in groups (buffer.type: priority, async modes)."""
    reuse_policy: Literal["on_policy_segment_only", "all"] = "on_policy_segment_only"
    """Which tokens of a partial rollout are trained on: only those of its last (newest) version — earlier
    segments stay as context — or all of them."""


class WorkerConfig(Section):
    """Rollout workers."""

    num_workers: PosInt = 32
    """Environment steps (tool calls, user simulator, verifier) executed at once, in workers; the other
    episodes wait for a free worker."""
    max_concurrent_tasks: PosInt = 128
    """Maximum episodes in flight at once, in episodes (also bounds evaluation)."""
    task_timeout_s: PosFloat = 600
    """An episode running longer than this fails, in seconds (all its turns and tools together)."""
    retry_on_failure: NonNegInt = 2
    """Further attempts of a failed episode (with a fresh environment), in attempts."""


class RolloutConfig(Section):
    """How rollouts are produced relative to training."""

    mode: Literal["sync", "one_step_off_policy", "fully_async"] = "sync"
    """sync: generate then train; one_step_off_policy: generate k+1 while training k; fully_async:
    continuous generation (the seed's ``async`` means fully_async). The seed's ``trainer.class`` /
    ``rollouter.class`` are aliases of it (``PIPELINES``: e.g. FullyAsyncTrainer → fully_async)."""
    scheduler: SchedulerConfig = SchedulerConfig()
    """Admission control."""
    partial_rollout: PartialRolloutConfig = PartialRolloutConfig()
    """Interrupt/resume at weight syncs."""
    worker: WorkerConfig = WorkerConfig()
    """Rollout workers."""

    @field_validator("mode", mode="before")
    @classmethod
    def _seed_async(cls, v: Any) -> Any:
        return "fully_async" if v == "async" else v


class StaleFilterConfig(Section):
    """Drop samples at consumption whose policy lag is too large."""

    enabled: bool = True
    """Drop stale groups when the trainer takes them (async modes)."""
    max_policy_lag: NonNegInt = 3
    """A group whose behaviour policy lags the trainer by more than this is dropped, in parameter versions."""


class BufferConfig(Section):
    """The sample buffer between rollouts and the learner."""

    type: Literal["fifo", "priority"] = "priority"
    """Async modes: take groups from the queue in its order (fifo), or through the priority replay buffer."""
    freshness_weight: Unit = 0.7
    """Priority weight of freshness (1 / (1 + policy lag)), in [0, 1]."""
    diversity_weight: Unit = 0.3
    """Priority weight of the group's reward spread (reward std / half its range), in [0, 1]."""
    stale_filter: StaleFilterConfig = StaleFilterConfig()
    """Staleness filter at consumption."""


# ----------------------------------------------------------------------------- learner


class OffPolicyCorrectionConfig(Section):
    """Correction for the gap between the behaviour and the target policy."""

    method: Literal[
        "double_sided_importance_sampling", "truncated_importance_sampling", "decoupled_ppo", "none"
    ] = "double_sided_importance_sampling"
    """Correction method."""
    clip_ratio: OpenUnit = 0.2
    """Importance-ratio clip ε (a ratio, unitless), in (0, 1); also the policy loss's ε_low unless
    ``policy_optimization.clip_ratio_low`` is set."""
    token_level_clipping: bool = True
    """Correct per token (true) or with the sequence's ratio (false)."""
    tis_enabled: bool = True
    """Truncated importance sampling of the rollout/train logprob mismatch (π_prox / π_behav)."""
    tis_cap: PosFloat = 2.0
    """TIS cap C (a ratio): importance weights above it are truncated to it (verl's rollout_is_threshold)."""
    proximal: Literal["step_start", "update_start"] = "step_start"
    """The weights pi_prox is taken under (the policy the loss's ratio is clipped around; the correction weighs
    pi_prox / pi_behav): step_start = the step's start for every update of the step (verl's old_log_prob; a step of
    several updates scores its later mini-batches under them, and a streamed step keeps a copy of them for that);
    update_start = each update's own starting weights (decoupled PPO with the latest policy as the proximal one,
    Hilton et al. 2021): no scoring pass and no copy; a trajectory's one update then sees ratio 1, and the
    correction's band on pi_prox / pi_behav bounds how far the policy has moved since it sampled. tether's own key;
    with actor_worker.class DetachActorWorker, update_start takes the place of the held weights."""


class LearnerConfig(Section):
    """Batching of the policy update (trajectories, not prompts)."""

    batch_size: PosInt = 64
    """Trajectories per trainer step (nominal: the degenerate-group filter may drop groups)."""
    mini_batch_size: PosInt = 8
    """Trajectories per optimizer update; divides batch_size."""
    update_frequency: PosInt = 4
    """Passes (PPO epochs) over each trainer batch per trainer step; every pass reuses the behaviour logprobs as
    old logprobs."""
    gradient_accumulation_steps: PosInt = 2
    """Micro-batches accumulated per optimizer update, in micro-batches; divides mini_batch_size."""
    off_policy_correction: OffPolicyCorrectionConfig = OffPolicyCorrectionConfig()
    """Off-policy correction."""
    overlap_rollout: bool = True
    """When a step is one pass (update_frequency 1) whose pi_prox is each update's own first forward: train each
    group as soon as it finishes (sync mode) or as soon as the trainer may take it (the async modes, not with
    trainer.deterministic), in a thread beside the rollout, instead of after the whole batch; with several updates a
    step (mini_batch_size < batch_size) each is applied as soon as it holds mini_batch_size trajectories
    (``tether.pipeline.streaming``). One update: the same update as after the batch, to float rounding; several:
    each mini-batch holds trajectories in the order their groups finished (which groups make which update follows
    the engine's timing), in task order with trainer.deterministic in sync mode (then the same updates, to float
    rounding). In the async modes the trainer takes the groups one by one as they come instead of a mini-batch at a
    time, so a priority replay buffer (buffer.type) chooses among the groups it holds at each take. The staleness
    bound is unchanged (the version moves after the step, as before). ``perf/learner_overlap_s`` says how much of the
    learner's time it moved under the rollout (or the async modes' wait for the batch)."""

    @model_validator(mode="after")
    def _batches_divide(self) -> LearnerConfig:
        b, m, g = self.batch_size, self.mini_batch_size, self.gradient_accumulation_steps
        rule = "mini_batch_size must be <= batch_size and divide it"
        _check(m <= b and b % m == 0, rule, mini_batch_size=m, batch_size=b)
        rule = "gradient_accumulation_steps must divide mini_batch_size"
        _check(m % g == 0, rule, gradient_accumulation_steps=g, mini_batch_size=m)
        return self


# ----------------------------------------------------------------------------- components and placement


# The (trainer.class, rollouter.class) pair of each rollout.mode: the seed's class keys name the pipeline, and are
# folded into rollout.mode at load (``tether.config.aliases``; the fully_async names are the seed's, after verl's
# recipe/fully_async_policy, the others tether's).
PIPELINES: dict[Literal["sync", "one_step_off_policy", "fully_async"], tuple[str, str]] = {
    "sync": ("Trainer", "Rollouter"),
    "one_step_off_policy": ("OneStepOffTrainer", "OneStepOffRollouter"),
    "fully_async": ("FullyAsyncTrainer", "FullyAsyncRollouter"),
}


class TrainerConfig(Section):
    """The trainer component and the run length."""

    ppo_mini_batch_size: PosInt = 64
    """Trajectories the async trainer takes from the message queue at once (a queue batch); divides
    learner.batch_size, the trajectories of a step. Unset: half of learner.batch_size (all of it when that is
    odd). The seed's ``trainer.require_batches`` (queue batches per step) is folded at load into
    learner.batch_size = ppo_mini_batch_size × require_batches; given without learner.batch_size, this key alone
    sets learner.batch_size to twice it (require_batches' default, 2)."""
    trigger_parameter_sync_step: PosInt = 4
    """Push weights to the rollouter every N trainer steps, in steps (async modes; sync pushes every step)."""
    use_trainer_do_validate: bool = True
    """Which weights the held-out evaluation scores (async modes): true — the trainer validates its current
    weights on an engine of its own (a second model copy); false — the rollouter validates the weights of the
    last weight sync. Same weights in sync mode (``eval/weights_step`` records which)."""
    total_steps: PosInt = 100
    """Length of the run, in trainer steps."""
    eval_every: NonNegInt = 10
    """Held-out evaluation every N trainer steps (also at step 0 and at the end); 0 = only those."""
    save_every: NonNegInt = 50
    """Checkpoint every N trainer steps (also at the end); 0 = only at the end."""
    seed: int = 0
    """Seed of sampling, task shuffling and initialisation."""
    deterministic: bool = False
    """Bit-for-bit reproducible generation: the local engine computes every request on its own (a batch of
    one, no prefix-cache reuse), so a token and its logprob do not depend on which requests share a decode
    step. With it, two sync-mode runs of one config and seed on the same CPU, torch build and thread count
    give identical metrics (wall-clock timings aside) and weights; async modes keep the per-request
    guarantee, but which weight version a token is sampled under depends on timing (docs/determinism.md).
    Cost: engine time grows with the number of concurrent requests instead of staying almost flat (1.8× with
    8 concurrent episodes, 1.3× step time; 4.3× with 32, 1.35× step time). tether's own key (no seed config
    names it)."""
    eval_tasks: PosInt | None = None
    """Held-out tasks per evaluation, in tasks; None = environment.num_eval_tasks."""


class MessageQueueConfig(Section):
    """The queue between rollouter and trainer."""

    class_: Literal["MessageQueue"] = Field("MessageQueue", alias="class")
    """Queue implementation: MessageQueue (``tether.pipeline.queue``) is the only value today."""
    max_queue_size: PosInt = 512
    """Capacity, in groups; when full the oldest group is dropped. The seed's ``rollouter.max_queue_size`` is an
    alias of it."""


class MetricsConfig(Section):
    """Where metrics go (``metrics.jsonl`` is always written)."""

    tensorboard: bool = True
    """Write TensorBoard events to RUN_DIR/tensorboard."""
    wandb: bool = False
    """Log to Weights & Biases (needs the ``wandb`` package)."""
    wandb_project: str | None = None
    """W&B project (with metrics.wandb: true); None = "tether"."""
