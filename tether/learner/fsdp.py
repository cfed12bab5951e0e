"""FSDP2 for the trainer (``actor_worker.strategy: fsdp2``; ``fsdp`` is the same): the Learner's step data
parallel over ranks, its parameters, gradients and AdamW moments sharded by PyTorch's ``fully_shard``.

    ranks = init_ranks()                                  # torchrun's env; gloo on CPU, NCCL on GPU
    learner = sharded_learner(model, ranks, lc, po, ...)  # every rank, the same model and sections
    learner.train_step(trajectories, advantages)          # every rank, the same trajectories
    weights = learner.state_dict_for_engine()             # every rank (a collective); whole tensors

One Learner per rank runs the very same ``train_step``; ``tether.learner.ranks`` gives each rank its share of
every micro-batch and sums what must be summed, and each decoder layer (then the root: embeddings, final norm,
LM head) is one ``fully_shard`` unit, gathered for its forward and backward and freed after. Gradients are
*summed* across ranks (FSDP's default averages them): each rank's loss is already its share of the whole
mini-batch's loss, so the sum is the single-process gradient. ``clip_grad_norm_`` on the sharded gradients
gives the global norm, so the clip and the non-finite guard decide the same on every rank.

The KL reference is sharded the same way and scored on each rank's share. π_prox (with an off-policy correction)
is scored in shares too: each rank its rows of every scoring chunk (``Ranks.rows``; a rank with none scores a
stand-in row, so that every rank runs the same forwards), the rows summed across ranks. Collectives of the step's
metrics run on the GPU under NCCL, on the CPU under gloo (``tether.learner.ranks``).

A rank is a process: ``torchrun --nproc-per-node N`` (or ``torch.multiprocessing``, or a Ray actor per rank)
sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``; ``init_ranks`` reads them.

**In a run** (``run_learner``: one trainer rank, ``backend: local`` and the Ray backend's trainer actor) ``fsdp2``
shards over a process group of one rank (``benchmarks/gpu_smoke.sh`` runs it on one GPU with bf16 compute through
``shard_model(param_dtype=...)``, as a run with ``model.dtype: bfloat16`` does: float32 master weights, gradients
reduced in float32). Several trainer ranks in a run
(``resource_pool.trainer_pool.num_ranks``) are ``tether.learner.pool``'s: ``tether train`` spawns them and drives
them through ``tether.learner.group``; a run launched by torchrun (``WORLD_SIZE`` above 1) is refused. Checkpoints
and the evaluation engine see whole weights (``unsharded``); the optimizer state is saved whole, keyed by parameter
name (``optimizer_state`` / ``load_optimizer_state``), so a run saved with N ranks resumes with M.

With ``model.lora`` the peft model is wrapped first and its base model sharded (``sharded_learner``): each unit holds
the frozen base weights and the adapter's A and B, FSDP2 reduces only the adapter's gradients and AdamW holds only
the adapter; the KL reference is the same shards with the adapter off. What leaves the learner gathers the adapter
alone (a sync, a checkpoint) or the merged weights (``tether.learner.lora``).
"""

from __future__ import annotations

import copy
import os
import socket
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from tether.config.actor import ActorWorkerConfig
from tether.config.policy import PolicyOptimConfig
from tether.config.sections import LearnerConfig
from tether.config.teacher import TeacherConfig
from tether.learner.learner import Learner, sharded
from tether.learner.ranks import Ranks, full_tensor

STRATEGIES = ("fsdp", "fsdp2")  # the values of actor_worker.strategy that shard with fully_shard


def init_ranks(backend: str | None = None) -> Ranks:
    """Join (or reuse) the default process group; returns this rank. Under torchrun (``WORLD_SIZE`` set) from its
    environment variables; otherwise a group of one rank on a free local port (this process's environment is left
    as it was, so a later group does not reuse a stale port).

    ``backend``: None = NCCL when CUDA is available, else gloo. With CUDA, ``LOCAL_RANK`` picks the device."""
    if not dist.is_initialized():
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        if "WORLD_SIZE" in os.environ:
            missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
            if missing:
                raise RuntimeError(f"WORLD_SIZE is set but {', '.join(missing)} are not: launch the ranks with "
                                   "torchrun, or unset WORLD_SIZE for one rank")
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    return Ranks(dist.get_rank(), dist.get_world_size())


def device_mesh() -> DeviceMesh:
    """A 1-D mesh over every rank of the default group, on this rank's device type."""
    kind = "cuda" if dist.get_backend() == "nccl" else "cpu"
    return init_device_mesh(kind, (dist.get_world_size(),))


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of a Hugging Face causal LM (``model.model.layers`` in Qwen2/Llama): one FSDP unit
    each."""
    for path in ("model.layers", "transformer.h", "gpt_neox.layers", "model.decoder.layers"):
        obj: Any = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
        if isinstance(obj, torch.nn.ModuleList) and len(obj):
            return list(obj)
    raise ValueError(f"{type(model).__name__}: no decoder layers found to shard (looked for model.layers, "
                     "transformer.h, gpt_neox.layers, model.decoder.layers)")


def shard_model(model: Any, mesh: DeviceMesh | None = None, *, param_dtype: torch.dtype | None = None,
                offload: bool = False) -> Any:
    """``fully_shard`` each decoder layer, then the root, in place; gradients summed (not averaged) over ranks.

    ``param_dtype``: compute in this dtype (e.g. bfloat16) with float32 master weights and gradient reduction;
    None = the parameters' own. ``offload``: keep the sharded parameters, gradients and optimizer state in CPU
    memory between uses (``CPUOffloadPolicy``)."""
    mesh = mesh or device_mesh()
    kwargs: dict[str, Any] = dict(
        mesh=mesh, offload_policy=CPUOffloadPolicy() if offload else OffloadPolicy(),
        mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None))
    if mesh.device_type == "cuda" and not offload:
        model.to(torch.device("cuda", torch.cuda.current_device()))
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # each rank's loss is its share of the sum: add the gradients
            module.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no pre-multiplied sum)
    return model


def sharded_learner(model: Any, ranks: Ranks, lc: LearnerConfig, po: PolicyOptimConfig, *, temperature: float,
                    max_response_tokens: int, teacher: TeacherConfig | None = None, worker: str = "ActorWorker",
                    param_dtype: torch.dtype | None = None) -> Learner:
    """A Learner (the arguments after ``ranks`` are ``Learner``'s) whose model, and KL reference when KL is on, is
    sharded over ``ranks`` by ``shard_model``; ``param_dtype``: their forward and backward's (``model.dtype``), the
    parameters as given (float32 in a run) the master weights.

    A peft LoRA model (``model.lora``: wrapped before this) has its base model sharded with the adapter inside each
    unit, rank 0's adapter initialisation broadcast first (each rank drew its own A), and no reference copy: the
    reference is the policy with the adapter off, on the same shards.

    Call it on every rank with the same model weights; the model is sharded in place."""
    param_dtype = None if param_dtype == torch.float32 else param_dtype
    ref: Any = None
    if hasattr(model, "get_base_model"):  # model.lora
        if ranks.sharded:
            _broadcast_trainable(model)
        shard_model(model.get_base_model(), param_dtype=param_dtype)
    else:
        if po.kl_control.type != "none":
            ref = shard_model(copy.deepcopy(model).requires_grad_(False), param_dtype=param_dtype)
        shard_model(model, param_dtype=param_dtype)
    learner = Learner(model, ref, lc, po, temperature=temperature, max_response_tokens=max_response_tokens,
                      teacher=teacher, worker=worker, compute_dtype=param_dtype)
    learner.ranks = ranks
    return learner


def _broadcast_trainable(model: torch.nn.Module) -> None:
    """Rank 0's values of the parameters that require gradients (a LoRA adapter's random A) on every rank."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    for p in model.parameters():
        if p.requires_grad:
            buf = p.data.to(device or p.device, copy=True)
            dist.broadcast(buf, src=0)
            p.data.copy_(buf)


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole weights of a sharded model, on every rank (a collective), on the CPU."""
    return {k: full_tensor(v).detach().cpu() for k, v in model.state_dict().items()}


# ---------------------------------------------------------------------------------------------- in a run


def run_learner(model: Any, lc: LearnerConfig, po: PolicyOptimConfig, actor_worker: ActorWorkerConfig, *,
                temperature: float, max_response_tokens: int, teacher: TeacherConfig | None = None,
                compute_dtype: torch.dtype | None = None) -> Learner:
    """The run's learner as ``actor_worker.strategy`` lays it out: plain (``none``), or sharded by FSDP2 over the
    trainer's one rank (a process group of one is started when none is running: gloo on CPU, NCCL on GPU). The
    other arguments are ``Learner``'s; ``compute_dtype`` (``model.dtype``): autocast in the plain learner, FSDP2's
    ``param_dtype`` in the sharded one."""
    if actor_worker.strategy not in STRATEGIES:
        return Learner(model, None, lc, po, temperature=temperature, max_response_tokens=max_response_tokens,
                       teacher=teacher, worker=actor_worker.class_, compute_dtype=compute_dtype)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        raise RuntimeError(f"actor_worker.strategy: {actor_worker.strategy} with WORLD_SIZE={world}: tether train "
                           "starts its trainer ranks itself; launch the run as one process, without torchrun, with "
                           f"resource_pool.trainer_pool.num_ranks: {world}")
    return sharded_learner(model, init_ranks(), lc, po, temperature=temperature,
                           max_response_tokens=max_response_tokens, teacher=teacher, worker=actor_worker.class_,
                           param_dtype=compute_dtype)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def is_sharded(model: Any) -> bool:
    """Whether ``model`` is sharded by ``shard_model``; a peft LoRA model when its base model is."""
    return sharded(model)


def unsharded(model: Any, weights: dict[str, torch.Tensor] | None = None) -> Any:
    """``model`` itself, or for a sharded one a plain copy of its class with the whole weights (a collective), for
    ``save_pretrained`` and an engine of its own. ``weights``: the whole weights to put in the copy instead of the
    model's own (``lora.merged_copy``'s merged ones: ``model`` is then a sharded peft model's base)."""
    if not is_sharded(model):
        return model
    if hasattr(model, "get_base_model"):  # the whole weights of a sharded peft model are its merged ones
        raise TypeError("fsdp.unsharded got a sharded peft model: use tether.learner.lora.merged_copy")
    cls: Any = next(c for c in type(model).__bases__ if not issubclass(c, FSDPModule))  # FSDP<cls> → cls
    with torch.device("meta"):
        plain = cls(model.config)
    plain.load_state_dict(full_state_dict(model) if weights is None else weights, assign=True)
    for name, buf in model.named_buffers():  # non-persistent buffers (rotary frequencies) are not in a state dict
        owner, _, leaf = name.rpartition(".")
        plain.get_submodule(owner).register_buffer(leaf, buf.detach().cpu().clone(), persistent=False)
    if hasattr(plain, "tie_weights"):
        plain.tie_weights()
    if getattr(model, "generation_config", None) is not None:
        plain.generation_config = model.generation_config
    return plain.eval()


def load_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Load whole weights into a sharded model (each rank keeps its shards). A tied LM head may be absent."""
    whole: dict[str, Any] = dict(weights)
    set_model_state_dict(model, whole, options=StateDictOptions(full_state_dict=True, strict=False))


def optimizer_state(learner: Learner) -> dict[str, Any]:
    """``PolicyOptimizer.state_dict()``, with AdamW's state whole and keyed by parameter name for a sharded model and
    for a LoRA one (whose checkpoint any layout resumes: ``load_optimizer_state``)."""
    state = learner.optimizer.state_dict()
    if is_sharded(learner.model) or learner.lora_scaling is not None:
        state["optimizer"] = get_optimizer_state_dict(learner.model, learner.optimizer.optimizer,
                                                      options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return state


def load_optimizer_state(learner: Learner, state: dict[str, Any]) -> None:
    """The inverse of ``optimizer_state``: a state keyed by parameter name into any layout (plain or sharded over
    any number of ranks); one keyed by position into the plain layout it was saved from."""
    groups = state["optimizer"].get("param_groups") or [{}]
    by_name = any(isinstance(p, str) for p in groups[0].get("params", []))
    if by_name or is_sharded(learner.model):
        set_optimizer_state_dict(learner.model, learner.optimizer.optimizer, state["optimizer"],
                                 options=StateDictOptions(full_state_dict=True))
        state = {**state, "optimizer": learner.optimizer.optimizer.state_dict()}
    learner.optimizer.load_state_dict(state)
