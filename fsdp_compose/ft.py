"""Fault-tolerant data parallelism across replica groups with torchft.

torchft (``pip install fsdp_compose[ft]``) runs several *replica groups*, each a
fully sharded job of its own (one process group), and keeps them in step
through a ``torchft.Manager``: gradients are averaged across the groups that are
alive, a step is committed only where every rank agrees, and a group that restarts
after a failure fetches the sharded state of a healthy group before it trains on.

:func:`enable_torchft` wires what that takes onto a model sharded with
:func:`fsdp_compose.fully_shard` over the group's mesh::

    t = fsdp_compose.ft.torchft_timeouts(timedelta(seconds=60))  # see [Note: torchft timeouts]
    dist.init_process_group(..., timeout=t.replica_group)          # this replica group
    manager = torchft.Manager(pg=torchft.ProcessGroupGloo(timeout=t.process_group),
                              timeout=t.manager, quorum_timeout=t.quorum,
                              load_state_dict=None, state_dict=None, min_replica_size=1, ...)
    ft = fsdp_compose.ft.enable_torchft(model, optimizer, manager,
                                        replica_group=group, num_replica_groups=groups)
    sampler = DistributedSampler(dataset, rank=ft.dp_rank, num_replicas=ft.dp_size)
    for batch in loader:
        ft.optimizer.zero_grad()   # joins the step's quorum; heals if behind
        loss_fn(model(batch)).backward()
        ft.optimizer.step()        # steps only if every rank of every group committed

This module uses fsdp_compose's public API only (it relies on ``state_dict()``
reading the shards from any thread, and on ``set_all_reduce_hook`` serving every
mesh of a module) and is never imported by the runtime; torchft is imported when
:func:`enable_torchft` is called.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DeviceMesh, DTensor

from ._runtime import FSDPModule

if TYPE_CHECKING:
    from torchft.manager import Manager
    from torchft.optim import OptimizerWrapper

__all__ = [
    "Timeouts",
    "TorchFTSetup",
    "check_timeouts",
    "enable_torchft",
    "load_shard_state_dict",
    "shard_state_dict",
    "torchft_timeouts",
]


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


def _meshes(model: nn.Module) -> list[DeviceMesh]:
    """The meshes of the model's sharded parameters (several with per-parameter meshes)."""
    meshes: dict[int, DeviceMesh] = {}
    for p in model.parameters():
        if isinstance(p, DTensor):
            meshes.setdefault(id(p.device_mesh), p.device_mesh)
    return list(meshes.values())


def _group_rank_and_size(meshes: list[DeviceMesh]) -> tuple[int, int]:
    """This rank's index and the size of the group's data-parallel mesh: the largest
    1-D mesh (with per-parameter meshes, experts may sit on a smaller one)."""
    one_d = [m for m in meshes if m.ndim == 1]
    if meshes and not one_d:
        raise ValueError(
            "enable_torchft expects each replica group to shard over a 1-D mesh "
            f"(torchft replicates across groups), got meshes of {[m.ndim for m in meshes]} dims"
        )
    if not one_d:
        return 0, 1
    mesh = max(one_d, key=lambda m: m.size())
    return mesh.get_local_rank(), mesh.size()


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
    # model.state_dict() holds the shards even while a forward or backward runs on
    # another thread (named_parameters() would then show the unsharded parameters).
    model_sd = {
        name: (t.to_local() if isinstance(t, DTensor) else t).detach()
        for name, t in model.state_dict().items()
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
    tensors = model.state_dict(keep_vars=True)
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


# [Note: torchft timeouts]
# A step's cross-group all-reduce runs inside backward, in the all-reduce hook, and
# waits up to the torchft process group's timeout when a peer group died; the
# manager's timeout bounds the commit vote among a group's ranks and the transfer of
# a recovering group's state; the quorum timeout, how long a group waits for the
# others at the start of a step. Each failure must be caught by the layer meant to
# absorb it before the next layer gives up:
#   process_group <= manager: a rank that voted waits for its peers still in a
#       failing all-reduce;
#   manager <= quorum: a group at the quorum waits for groups still finishing a
#       failed step;
#   manager < replica_group: a rank already in the group's next collective (its
#       all-reduce or state transfer done) waits for a peer still in one; were the
#       group's own timeout shorter, a healthy group would crash instead of
#       skipping the step.
# The lighthouse's heartbeat timeout should be shorter than the quorum timeout, so
# that a dead group is dropped before the quorum gives up on it.


@dataclass(frozen=True)
class Timeouts:
    """Timeouts for a torchft job, consistent by :func:`check_timeouts`.

    Attributes:
        process_group: ``torchft.ProcessGroupGloo(timeout=)`` (or NCCL): the
            longest a cross-group all-reduce may block.
        manager: ``torchft.Manager(timeout=)``: the commit vote, recovery transfers.
        quorum: ``torchft.Manager(quorum_timeout=)``: waiting for the other groups.
        replica_group: ``torch.distributed.init_process_group(timeout=)`` of each
            replica group (the process group its mesh is built on).
    """

    process_group: timedelta
    manager: timedelta
    quorum: timedelta
    replica_group: timedelta


def torchft_timeouts(collective: timedelta, *, quorum: timedelta | None = None) -> Timeouts:
    """Consistent timeouts from the longest a cross-group all-reduce may take.

    Args:
        collective: the torchft process group's and the manager's timeout.
        quorum: the quorum timeout (default ``2 * collective``); it should also exceed
            the time of a training step.

    Raises:
        ValueError: ``quorum`` shorter than ``collective``.
    """
    timeouts = Timeouts(
        process_group=collective,
        manager=collective,
        quorum=2 * collective if quorum is None else quorum,
        replica_group=2 * collective,
    )
    check_timeouts(timeouts)
    return timeouts


def check_timeouts(timeouts: Timeouts) -> None:
    """Raises ``ValueError``, naming the setting to change, unless ``process_group <=
    manager <= quorum`` and ``manager < replica_group`` (see :class:`Timeouts`)."""
    t = timeouts
    if t.process_group > t.manager:
        raise ValueError(
            f"torchft's process group timeout ({t.process_group}) exceeds the Manager's "
            f"timeout ({t.manager}): set Manager(timeout=) to at least {t.process_group}, "
            "or use fsdp_compose.ft.torchft_timeouts()"
        )
    if t.manager > t.quorum:
        raise ValueError(
            f"the Manager's quorum_timeout ({t.quorum}) is shorter than its timeout "
            f"({t.manager}): set Manager(quorum_timeout=) to at least {t.manager}, or use "
            "fsdp_compose.ft.torchft_timeouts()"
        )
    if t.replica_group <= t.manager:
        raise ValueError(
            f"the replica group's process group timeout ({t.replica_group}) is not longer "
            f"than the Manager's timeout ({t.manager}): a rank would time out in the "
            "group's next collective while a peer still waits on torchft. Pass "
            f"init_process_group(timeout=) above {t.manager} (e.g. {2 * t.manager}), or "
            "use fsdp_compose.ft.torchft_timeouts()"
        )


def _timeouts_in_use(manager: Manager, meshes: list[DeviceMesh]) -> Timeouts | None:
    """The timeouts ``manager`` and the replica group's process groups were built with
    (torchft and c10d keep them in private attributes), or None if unreadable."""
    try:
        group_timeouts = [
            group._get_backend(torch.device(mesh.device_type)).options._timeout
            for mesh in meshes
            for group in mesh.get_all_groups()
        ]
        return Timeouts(
            process_group=manager._pg._timeout,
            manager=manager._timeout,
            quorum=manager._quorum_timeout,
            replica_group=min(group_timeouts, default=timedelta.max),
        )
    except (AttributeError, RuntimeError):
        return None


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

    Sets an all-reduce hook on every ``FSDPModule`` in ``model``, for each of its
    meshes (per-parameter meshes included), that averages the reduced gradient
    shard across the replica groups of the current quorum (``manager.allreduce``);
    registers :func:`shard_state_dict` and :func:`load_shard_state_dict` with the
    manager for recovery (the first runs on torchft's quorum thread, possibly
    during a forward, and issues no collective); and wraps the optimizer in
    torchft's ``OptimizerWrapper``. Checks the timeouts in use with
    :func:`check_timeouts` first.

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

    Raises:
        ValueError: bad indices, a model not sharded over a 1-D mesh, or timeouts
            that are not consistent (the message names the setting to change).
    """
    from torchft.optim import OptimizerWrapper

    if not 0 <= replica_group < num_replica_groups:
        raise ValueError(f"replica_group must be in [0, {num_replica_groups}), got {replica_group}")
    modules = _fsdp_modules(model)
    if not modules:
        raise ValueError("enable_torchft needs a model sharded with fully_shard")
    meshes = _meshes(model)
    group_rank, group_size = _group_rank_and_size(meshes)
    in_use = _timeouts_in_use(manager, meshes)
    if in_use is not None:
        check_timeouts(in_use)

    def all_reduce_across_groups(output: torch.Tensor) -> None:
        # The manager averages over the participating groups; on error it records
        # the failure and the step is not committed (should_commit is False).
        manager.allreduce(output, reduce_op=dist.ReduceOp.AVG).wait()

    for module in modules:
        # Rank i of every group holds the same shards, on every mesh: one hook serves all.
        module.set_all_reduce_hook(all_reduce_across_groups)
    manager.register_state_dict_fn(
        state_dict_key,
        lambda sd: load_shard_state_dict(model, optimizer, sd),
        lambda: shard_state_dict(model, optimizer),
    )
    return TorchFTSetup(
        optimizer=OptimizerWrapper(manager, optimizer),
        dp_rank=replica_group * group_size + group_rank,
        dp_size=num_replica_groups * group_size,
    )
