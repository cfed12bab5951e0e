"""``actor_worker``: the trainer's worker — what it keeps of its weights, and how its model is laid over ranks
(separation_config.yaml)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field

from tether.config.base import Section

if TYPE_CHECKING:
    from tether.config.run import RunConfig

__all__ = ["ActorWorkerConfig", "actor_inert"]


class ActorWorkerConfig(Section):
    """The trainer's actor worker (``tether.learner.detach``, ``tether.learner.fsdp``)."""

    class_: Literal["ActorWorker", "DetachActorWorker"] = Field("ActorWorker", alias="class")
    """ActorWorker: π_prox (the policy the PPO ratio and the behaviour correction are taken around) is the
    learner's weights at the start of each step. DetachActorWorker (the seeds' separation_config.yaml): the
    trainer's weights are saved to CPU memory at every weight sync and π_prox is scored under them, so it stays
    fixed across the ``trainer.trigger_parameter_sync_step`` steps of a sync window (verl's fully-async trainer);
    save and restore times are logged as ``perf/detach_save_s`` / ``perf/detach_restore_s``. The two agree when
    the weights are synced every step, and without an off-policy correction (no π_prox)."""
    strategy: Literal["none", "fsdp", "fsdp2", "veOmni", "megatron"] = "none"
    """How the trainer's model is laid over its ranks. none: one unsharded module in one process. fsdp2 (fsdp is
    the same): data parallel with the parameters, gradients and optimizer state sharded by PyTorch's
    ``fully_shard`` (``tether.learner.fsdp``; gloo on CPU, NCCL on GPU). veOmni and megatron are not built and
    are refused at load."""


def actor_inert(cfg: RunConfig) -> list[str]:
    """Warnings for ``tether.config.inert``: a DetachActorWorker whose held π_prox cannot differ from the current
    weights in this run."""
    if cfg.actor_worker.class_ != "DetachActorWorker":
        return []
    opc = cfg.learner.off_policy_correction
    if opc.proximal == "update_start":
        why = "learner.off_policy_correction.proximal: update_start takes π_prox under each update's own weights"
    elif opc.method == "none" and not opc.tis_enabled:
        why = ("no π_prox is computed (learner.off_policy_correction.method: none, tis_enabled: false): the ratio "
               "is taken to the behaviour policy")
    elif cfg.rollout.mode == "sync":
        why = "rollout.mode sync pushes the weights after every step, so each step starts from the synced weights"
    elif cfg.trainer.trigger_parameter_sync_step == 1:
        why = "trainer.trigger_parameter_sync_step = 1 pushes the weights after every step"
    else:
        return []
    return [f"actor_worker.class = DetachActorWorker changes nothing in this run: {why}; it holds π_prox at the "
            f"last sync's weights across a window of trigger_parameter_sync_step > 1 steps in an async mode"]
