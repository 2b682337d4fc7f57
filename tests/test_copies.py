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
        assert ops <= ops2 and nbytes <= nbytes2, detail
        if case != "fp32 Shard(0)":
            assert nbytes < nbytes2, detail
