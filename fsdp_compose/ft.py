"""Fault-tolerant data parallelism across replica groups with torchft.

torchft (``pip install fsdp_compose[ft]``) runs several *replica groups*, each a
fully sharded job of its own (one process group, one mesh), and keeps them in step
through a ``torchft.Manager``: gradients are averaged across the groups that are
alive, a step is committed only where every rank agrees, and a group that restarts
after a failure fetches the sharded state of a healthy group before it trains on.

:func:`enable_torchft` wires what that takes onto a model sharded with
:func:`fsdp_compose.fully_shard` over the group's mesh::

    manager = torchft.Manager(pg=torchft.ProcessGroupGloo(), load_state_dict=None,
                              state_dict=None, min_replica_size=1, ...)
    ft = fsdp_compose.ft.enable_torchft(model, optimizer, manager,
                                        replica_group=group, num_replica_groups=groups)
    sampler = DistributedSampler(dataset, rank=ft.dp_rank, num_replicas=ft.dp_size)
    for batch in loader:
        ft.optimizer.zero_grad()   # joins the step's quorum; heals if behind
        loss_fn(model(batch)).backward()
        ft.optimizer.step()        # steps only if every rank of every group committed

This module uses fsdp_compose's public API only and is never imported by the
runtime; torchft is imported when :func:`enable_torchft` is called.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ._runtime._fsdp_module import FSDPModule

if TYPE_CHECKING:
    from torchft.manager import Manager
    from torchft.optim import OptimizerWrapper

__all__ = ["TorchFTSetup", "enable_torchft", "load_shard_state_dict", "shard_state_dict"]


@dataclass(frozen=True)
class TorchFTSetup:
    """What :func:`enable_torchft` returns.

    Attributes:
        optimizer: the torchft ``OptimizerWrapper`` to train with (``zero_grad``
            starts the step's quorum, ``step`` commits it).
        dp_rank: this rank's index among all data-parallel ranks of all replica
            groups (``replica_group * group_size + group_rank``), for the sampler.
        dp_size: the number of data-parallel ranks over all replica groups
            (``num_replica_groups * group_size``), for the sampler.
    """

    optimizer: OptimizerWrapper
    dp_rank: int
    dp_size: int


def _fsdp_modules(model: nn.Module) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _group_rank_and_size(model: nn.Module) -> tuple[int, int]:
    for p in model.parameters():
        if isinstance(p, DTensor):
            mesh = p.device_mesh
            if mesh.ndim != 1:
                raise ValueError(
                    "enable_torchft expects each replica group to shard over a 1-D mesh "
                    f"(torchft replicates across groups), got a {mesh.ndim}-D mesh"
                )
            return mesh.get_local_rank(), mesh.size()
    return 0, 1


def shard_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's shards of the model and optimizer state, as plain tensors.

    The format torchft sends to a recovering replica: each ``DTensor`` is replaced
    by its local tensor, since the receiving rank holds the same shard of the same
    parameter. Load it with :func:`load_shard_state_dict`.

    Args:
        model: the module sharded with ``fully_shard``.
        optimizer: its optimizer (the wrapped one, not torchft's wrapper).
    """
    optim_sd = optimizer.state_dict()
    sharded_keys: list[tuple[int, str]] = []
    state: dict[int, dict[str, Any]] = {}
    for index, values in optim_sd["state"].items():
        state[index] = {}
        for key, value in values.items():
            if isinstance(value, DTensor):
                sharded_keys.append((index, key))
                value = value.to_local()
            state[index][key] = value
    model_sd = {
        name: (t.to_local() if isinstance(t, DTensor) else t).detach()
        for name, t in _named_tensors(model)
    }
    return {
        "model": model_sd,
        "optim": {"state": state, "param_groups": optim_sd["param_groups"]},
        "optim_sharded_keys": sharded_keys,
    }


def load_shard_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]
) -> None:
    """Loads what :func:`shard_state_dict` returned on the same rank of another
    replica group: copies the model's shards in place and rebuilds the optimizer's
    sharded state as ``DTensor``s like its parameters.

    Args:
        model: the module sharded with ``fully_shard``.
        optimizer: its optimizer (the wrapped one, not torchft's wrapper).
        state_dict: the dictionary :func:`shard_state_dict` returned.
    """
    tensors = dict(_named_tensors(model))
    if set(tensors) != set(state_dict["model"]):
        raise ValueError(
            "the state dict's tensors differ from the model's: missing "
            f"{sorted(set(tensors) - set(state_dict['model']))}, unexpected "
            f"{sorted(set(state_dict['model']) - set(tensors))}"
        )
    with torch.no_grad():
        for name, t in tensors.items():
            local = t.to_local() if isinstance(t, DTensor) else t
            local.copy_(state_dict["model"][name])
    params = [p for group in optimizer.param_groups for p in group["params"]]
    optim_sd = state_dict["optim"]
    state = {index: dict(values) for index, values in optim_sd["state"].items()}
    for index, key in state_dict["optim_sharded_keys"]:
        p = params[index]
        assert isinstance(p, DTensor), "a sharded optimizer state belongs to a DTensor"
        state[index][key] = DTensor.from_local(
            state[index][key], p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
        )
    optimizer.load_state_dict({"state": state, "param_groups": optim_sd["param_groups"]})


def _named_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*model.named_parameters(), *model.named_buffers()]


def enable_torchft(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    manager: Manager,
    *,
    replica_group: int,
    num_replica_groups: int,
    state_dict_key: str = "fsdp_compose",
) -> TorchFTSetup:
    """Makes a sharded model train as one replica group of a torchft job.

    Sets an all-reduce hook on every ``FSDPModule`` in ``model`` that averages the
    reduce-scattered gradient shard across the replica groups of the current
    quorum (``manager.allreduce``), registers :func:`shard_state_dict` and
    :func:`load_shard_state_dict` with the manager for recovery, and wraps the
    optimizer in torchft's ``OptimizerWrapper``.

    Args:
        model: the module sharded with ``fully_shard`` over this group's 1-D mesh.
        optimizer: its optimizer.
        manager: this rank's ``torchft.Manager`` (created with
            ``load_state_dict=None, state_dict=None``; its ``rank`` and
            ``world_size`` are the rank and size within the replica group).
        replica_group: this group's index, ``0 <= replica_group < num_replica_groups``.
        num_replica_groups: the largest number of replica groups; sets the data
            split, which stays fixed while groups come and go.
        state_dict_key: the key the state-dict functions are registered under.
    """
    from torchft.optim import OptimizerWrapper

    if not 0 <= replica_group < num_replica_groups:
        raise ValueError(f"replica_group must be in [0, {num_replica_groups}), got {replica_group}")
    modules = _fsdp_modules(model)
    if not modules:
        raise ValueError("enable_torchft needs a model sharded with fully_shard")

    def all_reduce_across_groups(output: torch.Tensor) -> None:
        # The manager averages over the participating groups; on error it records
        # the failure and the step is not committed (should_commit is False).
        manager.allreduce(output, reduce_op=dist.ReduceOp.AVG).wait()

    for module in modules:
        module.set_all_reduce_hook(all_reduce_across_groups)
    manager.register_state_dict_fn(
        state_dict_key,
        lambda sd: load_shard_state_dict(model, optimizer, sd),
        lambda: shard_state_dict(model, optimizer),
    )
    group_rank, group_size = _group_rank_and_size(model)
    return TorchFTSetup(
        optimizer=OptimizerWrapper(manager, optimizer),
        dp_rank=replica_group * group_size + group_rank,
        dp_size=num_replica_groups * group_size,
    )
