"""Errors of failed collectives that say why they failed: a peer (crashed, timed
out, issued something else) or this rank's own call (a dtype or device the backend
refuses). An extension: it replaces the core's plain message through
``_collectives.explain_failure`` when imported.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import _collectives, _compat

# [Note: why a collective failed]
# A collective fails either because of the other ranks -- one crashed (its
# connections close or reset), or stopped issuing or issued something else (this
# rank times out waiting, or a checking backend reports the mismatch) -- or
# because of this rank's own call: a dtype the backend does not support, no
# backend for the tensors' device. Only the first kind gets the hint about peers
# and mismatched collectives; the second says what the backend refused, so that
# nobody hunts for a crashed peer that does not exist.
# Backends word these differently (gloo: "Connection closed by peer", "Timed out
# waiting ... for recv"; NCCL: "ncclRemoteError", "Watchdog caught collective
# operation timeout", "communicator was aborted"); the signs below cover them.
_PEER_SIGNS = (
    "closed by peer",
    "reset by peer",
    "connection closed",
    "connection reset",
    "connection refused",
    "broken pipe",
    "timed out",
    "timeout",
    "remote process",
    "remote worker",
    "remoteerror",
    "network error",
    "communicator was aborted",
    # the ranks issued different collectives (TORCH_DISTRIBUTED_DEBUG=DETAIL, gloo)
    "mismatch",
    "doesn't match expected size",
)


def peer_may_have_failed(exc: BaseException) -> bool:
    """Whether ``exc`` (raised by a collective) can come from another rank: a lost
    connection or a timeout, see [Note: why a collective failed]."""
    text = str(exc).lower()
    return any(sign in text for sign in _PEER_SIGNS)


def explain_failure(
    what: str,
    exc: BaseException,
    tensor: torch.Tensor | None = None,
    group: dist.ProcessGroup | None = None,
) -> RuntimeError:
    """The error to raise for a failed collective ``what``; ``tensor`` and ``group``
    (where known) name the dtype, device and backend involved."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    head = f"fsdp_compose: {what} failed on rank {rank}: {exc}\n"
    if peer_may_have_failed(exc):
        return RuntimeError(
            head + "A peer rank may have crashed or timed out, or the ranks issued different "
            "collectives; run with FSDP_COMPOSE_DEBUG_COLLECTIVES=1 to compare the ranks' "
            "collectives."
        )
    return RuntimeError(head + _local_cause(exc, tensor, group))


def _local_cause(
    exc: BaseException, tensor: torch.Tensor | None, group: dist.ProcessGroup | None
) -> str:
    text = str(exc).lower()
    backend = "process group's backend"
    if group is not None:
        backend += f" ({_compat.backend_name(group)})"
    device = tensor.device.type if tensor is not None else "these"
    dtype = str(tensor.dtype).removeprefix("torch.") if tensor is not None else "this dtype"
    if "no backend type associated with device type" in text:
        return (
            f"This rank's call was refused, not a peer's: the {backend} has no backend for "
            f"{device} tensors. Create the process group with a backend for that device (e.g. "
            'init_process_group("gloo") for CPU, "cpu:gloo,cuda:nccl" for both) or build the '
            "mesh on a device its backend serves."
        )
    if "scalar type" in text or "dtype" in text or "data type" in text:
        return (
            f"This rank's call was refused, not a peer's: the {backend} does not support this "
            f"collective on {dtype} tensors. Use a dtype it supports for communication, e.g. "
            "MixedPrecisionPolicy(param_dtype=..., reduce_dtype=...), or a backend that supports "
            f"{dtype}."
        )
    if any(sign in text for sign in ("support", "not implemented", "unimplemented")):
        return (
            f"This rank's call was refused, not a peer's: the {backend} does not implement this "
            f"collective ({dtype} tensors on {device}). fsdp_compose needs all-gather into one "
            "tensor, reduce-scatter of one tensor and all-reduce (gloo, NCCL and UCC have them); "
            "or supply your own with set_custom_all_gather / set_custom_reduce_scatter."
        )
    return (
        f"The {backend} raised this on this rank ({dtype} tensors on {device}); it does not "
        "look like a lost connection or a timeout, so a failed peer is an unlikely cause."
    )


_collectives.explain_failure = explain_failure
