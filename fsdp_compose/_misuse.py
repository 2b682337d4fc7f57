"""Misuse detection: mistakes that would otherwise hang or train silently wrong.

* Ranks whose models differ (a parameter more, another shape) are caught at lazy
  init by comparing a digest of every unit's parameter names, shapes and dtypes
  across each data-parallel group; without it they would hang or exchange
  mismatched data at the first all-gather.
* An optimizer that holds tensors fsdp_compose does not train is caught at its
  first ``step()``: the original parameters that ``fully_shard`` replaced (the
  optimizer was built before ``fully_shard``), or the unsharded parameters the
  root registers between forward and backward (built after a forward). torch's
  FSDP2 silently never updates the sharded parameters in both cases.
"""

from __future__ import annotations

import hashlib
import pickle
import warnings
import weakref
from typing import Any

import torch
import torch.distributed as dist

from . import _compat, _hooks, _missing_root, _optim
from ._unit import Unit

REPLACED_BY = "_fsdp_compose_replaced_by"  # set on original parameters by fully_shard

_live_units: weakref.WeakSet[Unit] = weakref.WeakSet()
_checked_optimizers: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = (
    weakref.WeakKeyDictionary()
)
_hook_installed = False


def _all_gather_bytes(
    payload: bytes, group: dist.ProcessGroup, device: torch.device
) -> list[bytes]:
    """Gathers every rank's ``payload`` with tensor collectives. torch's object
    collectives (``all_gather_object``) need NumPy, which torch does not require;
    the error they would raise here would hide the one being reported."""
    mine = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    sizes = torch.empty(group.size(), dtype=torch.int64, device=device)
    size = torch.tensor([mine.numel()], dtype=torch.int64, device=device)
    _compat.all_gather_into_tensor(sizes, size, group, async_op=False)
    lengths = [int(n) for n in sizes.tolist()]
    longest = max(lengths)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: mine.numel()] = mine
    gathered = torch.empty(group.size() * longest, dtype=torch.uint8, device=device)
    _compat.all_gather_into_tensor(gathered, padded, group, async_op=False)
    rows = gathered.view(group.size(), longest).cpu()
    return [bytes(rows[i, :n].tolist()) for i, n in enumerate(lengths)]


def _is_fake_backend(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` is torch's ``fake`` backend, whose collectives return
    at once without communicating (dry runs of a large world in one process)."""
    return _compat.backend_name(group) == "fake"


# ---------------------------------------------------------------------------
# same model on every rank
# ---------------------------------------------------------------------------


def _settings(u: Unit) -> tuple[tuple[str, str], ...]:
    """The unit settings that change its collectives' sizes or dtypes."""
    mp = u.mp_policy
    return (
        ("mp_policy.param_dtype", str(mp.param_dtype)),
        ("mp_policy.reduce_dtype", str(mp.reduce_dtype)),
        ("reshard_after_forward", str(u.reshard_after_forward)),
        ("offload_policy", "CPUOffloadPolicy" if u.offload else "none"),
    )


def _describe(
    units: list[Unit],
) -> list[tuple[str, list[tuple[str, tuple[int, ...], str, bool]], Any]]:
    return [
        (
            u.name,
            [
                (p.fqn, tuple(p.orig_size), str(p.orig_dtype), bool(p.sharded_param.requires_grad))
                for p in u.params
            ],
            _settings(u),
        )
        for u in units
    ]


def _first_difference(mine: list[Any], theirs: list[Any]) -> str:
    if len(mine) != len(theirs):
        return f"{len(mine)} units here vs {len(theirs)} there"
    for (name_a, params_a, settings_a), (name_b, params_b, settings_b) in zip(mine, theirs):
        if name_a != name_b:
            return f"unit {name_a!r} here vs {name_b!r} there"
        for (key, a), (_, b) in zip(settings_a, settings_b):
            if a != b:
                return f"unit {name_a!r}: {key}={a} here vs {b} there"
        if len(params_a) != len(params_b):
            return f"unit {name_a!r} has {len(params_a)} parameters here vs {len(params_b)} there"
        for a, b in zip(params_a, params_b):
            if a != b:
                return f"parameter {a[0]!r}: shape {a[1]} {a[2]} here vs {b[0]!r} shape {b[1]} {b[2]} there"
    return "no difference found in the descriptions"


def verify_same_structure(units: list[Unit]) -> None:
    """Raises on every rank if the ranks of a data-parallel group built different
    models (one small all-gather per group, once at lazy init)."""
    if not units or not dist.is_initialized():
        return
    description = _describe(units)
    digest = int.from_bytes(hashlib.sha256(repr(description).encode()).digest()[:7], "little")
    groups: dict[int, tuple[dist.ProcessGroup, torch.device]] = {}
    for u in units:
        for group in (u.mesh_info.shard_group, u.mesh_info.replicate_group):
            # The fake backend (dry runs) has no peers to compare with.
            if group is not None and group.size() > 1 and not _is_fake_backend(group):
                groups.setdefault(id(group), (group, u.mesh_info.device))
    for group, device in groups.values():
        mine = torch.tensor([digest], dtype=torch.int64, device=device)
        gathered = torch.empty(group.size(), dtype=torch.int64, device=device)
        _compat.all_gather_into_tensor(gathered, mine, group, async_op=False)
        digests = gathered.tolist()
        if len(set(digests)) == 1:
            continue
        descriptions = [
            pickle.loads(blob)
            for blob in _all_gather_bytes(pickle.dumps(description), group, device)
        ]
        ranks = dist.get_process_group_ranks(group)
        me = dist.get_rank()
        other = (
            next(i for i, d in enumerate(digests) if d != digest)
            if digest != digests[0]
            else next(i for i, d in enumerate(digests) if d != digests[0])
        )
        detail = _first_difference(description, descriptions[other])
        raise RuntimeError(
            f"fsdp_compose: the ranks of data-parallel group {ranks} built different models, so "
            f"their collectives would not match. Rank {me} vs rank {ranks[other]}: {detail}. "
            "Build the same model (same config, same fully_shard calls and arguments) on every "
            "rank."
        )
    verify_same_replicas(units)


def verify_same_replicas(units: list[Unit]) -> None:
    """HSDP: raises on every rank if the replicas of a shard hold different values
    at the first forward (e.g. ranks seeded differently), which would otherwise
    train silently apart. One float64 checksum per unit, all-gathered across the
    replicate group."""
    hsdp = [
        u
        for u in units
        if u.mesh_info.replicate_group is not None
        and u.mesh_info.replicate_size > 1
        and not _is_fake_backend(u.mesh_info.replicate_group)  # dry run: no replicas
    ]
    groups: dict[int, list[Unit]] = {}
    for u in hsdp:
        groups.setdefault(id(u.mesh_info.replicate_group), []).append(u)
    for members in groups.values():
        group = members[0].mesh_info.replicate_group
        assert group is not None
        device = members[0].mesh_info.device
        with torch.no_grad():
            sums = torch.stack(
                [
                    torch.stack(
                        [p.local_shard.detach().double().abs().sum() for p in u.params]
                    ).sum()
                    + torch.stack([p.local_shard.detach().double().sum() for p in u.params]).sum()
                    for u in members
                ]
            ).to(device)
        gathered = torch.empty(group.size() * len(members), dtype=torch.float64, device=device)
        _compat.all_gather_into_tensor(gathered, sums, group, async_op=False)
        rows = gathered.view(group.size(), len(members)).cpu()
        differ = [
            u.name for i, u in enumerate(members) if not bool((rows[:, i] == rows[0, i]).all())
        ]
        if differ:
            ranks = dist.get_process_group_ranks(group)
            raise RuntimeError(
                f"fsdp_compose: the HSDP replicas {ranks} hold different parameter values at the "
                f"first forward in units {differ}, so they would train apart. Initialize the "
                "model identically on every rank (same seed before building it, or load the "
                "same checkpoint) before the first forward."
            )


# ---------------------------------------------------------------------------
# optimizer built at the wrong time
# ---------------------------------------------------------------------------


def register_units(units: list[Unit]) -> None:
    for u in units:
        _live_units.add(u)
    _install_optimizer_hook()


def _install_optimizer_hook() -> None:
    global _hook_installed
    if _hook_installed:
        return
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    register_optimizer_step_pre_hook(_on_optimizer_step)
    _hook_installed = True


def _on_optimizer_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    _check_optimizer(optimizer, args, kwargs)
    _missing_root.check_no_plain_params_with_sharded(optimizer, list(_live_units))
    warn_if_gradient_sync_left_off(optimizer)
    # Checked: this step and later ones may run the sharded update (fsdp_compose's
    # own step hooks, see [Note: sharded steps run inside step hooks] in _optim).
    _optim.accelerate(optimizer)


def _check_optimizer(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    count = sum(len(g["params"]) for g in optimizer.param_groups)
    if _checked_optimizers.get(optimizer) == count:
        return  # already checked these parameters
    unsharded = {
        id(p.unsharded_param): (u, p)
        for u in list(_live_units)
        for p in u.params
        if p.unsharded_param is not None
    }
    for group in optimizer.param_groups:
        for param in group["params"]:
            replaced = getattr(param, REPLACED_BY, None)
            if replaced is not None:
                raise RuntimeError(
                    f"fsdp_compose: {type(optimizer).__name__} holds a parameter of shape "
                    f"{tuple(param.shape)} that fully_shard({replaced}) replaced by a sharded "
                    "DTensor, so this optimizer would never update the model. Create the optimizer "
                    "after fully_shard, from model.parameters()."
                )
            hit = unsharded.get(id(param))
            if hit is not None:
                unit, p = hit
                raise RuntimeError(
                    f"fsdp_compose: {type(optimizer).__name__} holds the unsharded parameter "
                    f"{p.fqn!r} of unit {unit.name!r}, which fsdp_compose registers on the module "
                    "only while it is gathered (the root keeps its parameters from forward until "
                    "backward); updates to it are discarded. Create the optimizer right after "
                    "fully_shard (before the first forward), or after a backward, so that "
                    "model.parameters() returns the sharded parameters."
                )
    _checked_optimizers[optimizer] = count


# ---------------------------------------------------------------------------
# gradient sync left off
# ---------------------------------------------------------------------------

_warned_sync_off = False


def warn_if_gradient_sync_left_off(optimizer: torch.optim.Optimizer) -> None:
    """Warns once if ``optimizer.step()`` finds no gradient on any parameter
    sharded by fsdp_compose while some unit has gradient sync turned off: the
    usual cause is ``set_requires_gradient_sync(False)`` (gradient accumulation)
    never turned back on, so the step silently updates nothing."""
    global _warned_sync_off
    if _warned_sync_off:
        return
    off = [u for u in list(_live_units) if not u.requires_gradient_sync]
    if not off:
        return
    # The optimizer may hold the DTensors or, during a local step, their local
    # tensors (see [Note: local optimizer steps]); the DTensors keep the .grad.
    held_ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
    held = [
        p.sharded_param
        for u in list(_live_units)
        for p in u.params
        if id(p.sharded_param) in held_ids or id(p.local_shard) in held_ids
    ]
    if not held or any(p.grad is not None for p in held):
        return
    _warned_sync_off = True
    names = ", ".join(repr(u.name) for u in off[:3]) + (" ..." if len(off) > 3 else "")
    warnings.warn(
        f"fsdp_compose: {type(optimizer).__name__}.step() found no gradient on any sharded "
        f"parameter while gradient sync is off for units {names}: their gradients stay "
        "unsharded and unreduced, so this step updates nothing. Call "
        "model.set_requires_gradient_sync(True) before the last backward of each step "
        "(warned once).",
        stacklevel=3,
    )


def _on_root_init(units: list[Unit]) -> None:
    verify_same_structure(units)
    register_units(units)


_hooks.root_init_checks.append(_on_root_init)
