"""Fewer copies than torch's FSDP2, the same collectives and the same numbers.

``benchmarks/copies.py`` counts, under a ``TorchDispatchMode``, the copy ops and
the bytes they write in one training step (forward, backward, AdamW step) of the
example GPT, for fsdp_compose and for torch's FSDP2 on the same model, mesh and
data in the same job, and the collectives under ``CommDebugMode``. fsdp_compose
must copy no more bytes in no more copy ops, issue the same collectives, and end
the step with bit-identical parameters. With a cast (``param_dtype``) or a dim > 0
shard it copies strictly fewer bytes: one fused cast-and-pack instead of a cast
then a pack, and rank chunks written straight into the unsharded parameters
instead of through a temporary.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest
from dist_utils import run_distributed

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
)
import copies


def _job(case: str) -> dict[str, Any]:
    return copies._count_rank(copies.CASES[case], "tiny")


@pytest.mark.parametrize("case", list(copies.CASES))
def test_copies_and_bytes_at_most_fsdp2s(case: str) -> None:
    for r in run_distributed(_job, 2, case, timeout=300):
        ours, theirs = r["fsdp_compose"], r["fsdp2"]
        assert ours["collectives"] == theirs["collectives"], (
            ours["collectives"],
            theirs["collectives"],
        )
        assert any("all_gather" in k or "allgather" in k for k in ours["collectives"]), ours
        assert r["bit_identical"]
        (ops, nbytes), (ops2, nbytes2) = copies.totals(ours), copies.totals(theirs)
        # the counter sees FSDP2's copy-out and reduce-scatter packing
        assert theirs["ops"].get("fsdp.split_with_sizes_copy", 0) > 0, theirs["ops"]
        assert theirs["ops"].get("fsdp.chunk_cat", 0) > 0, theirs["ops"]
        detail = (ours["ops"], ours["bytes"], theirs["ops"], theirs["bytes"])
        # strictly fewer bytes in every case: in float32 at least the one-parameter
        # units (embedding, LM head) send their shards' storage without a copy-in
        assert ops <= ops2 and nbytes < nbytes2, detail


def _layout_job() -> list[Any]:
    """Each local shard's storage offset and storage bytes, fsdp_compose's and FSDP2's,
    after fully_shard, after a step, and for a meta-initialized model after
    ``to_empty`` and a forward."""
    import torch
    import torch.nn as nn
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    from fsdp_compose import fully_shard

    def build(shard: Any, meta: bool) -> nn.Module:
        torch.manual_seed(0)
        with torch.device("meta" if meta else "cpu"):
            model = nn.Sequential(nn.Embedding(11, 6), nn.Linear(6, 7), nn.Linear(7, 3))
        for m in model:
            shard(m)
        shard(model)
        if meta:
            model.to_empty(device="cpu")
        return model

    rows: list[Any] = []
    for when in ("fully_shard", "step", "to_empty"):
        models = [build(f, meta=when == "to_empty") for f in (fully_shard, fsdp2_fully_shard)]
        for model in models if when != "fully_shard" else ():
            model[1:](model[0](torch.arange(4))).sum().backward()
        for (name, p), q in zip(models[0].named_parameters(), models[1].parameters()):
            a, b = p._local_tensor, q._local_tensor  # type: ignore[attr-defined]
            rows.append(
                (
                    f"{when} {name}",
                    a.storage_offset(),
                    b.storage_offset(),
                    a.untyped_storage().nbytes(),
                    b.untyped_storage().nbytes(),
                )
            )
    # Copy ops of an explicit unshard: the embedding's unit sends its stored shard and
    # gathers in place (none); the first Linear's packs two shards (the copy-in: a
    # cat, or with padding a foreach copy) and copies the gathered rows out (two).
    for unit in models[0][:2]:
        with copies.CopyCounter() as counter:
            unit.unshard()  # type: ignore[operator]
        unit.reshard()  # type: ignore[operator]
        rows.append(dict(counter.ops))
    return rows


def test_local_shards_laid_out_as_fsdp2s() -> None:
    """As FSDP2's, every local shard starts a storage of its padded chunk (what a
    one-parameter unit's all-gather sends as is), also after meta init."""
    for rows in run_distributed(_layout_job, 2, timeout=120):
        *layout, embedding_copies, linear_copies = rows
        for name, offset, offset2, nbytes, nbytes2 in layout:
            assert (offset, nbytes) == (offset2, nbytes2) == (0, nbytes2), name
        assert embedding_copies == {}, embedding_copies
        assert sum(linear_copies.values()) == 2, linear_copies
