"""Whole-matrix optimizers on parameters sharded by ``fully_shard``.

Importing ``fsdp_compose`` registers sharded steps for ``torch.optim.Muon``
(bit-identical to single-device Muon) and ``torch.optim.Adafactor`` with
fsdp_compose's optimizer hook: user code builds these optimizers from
``model.parameters()`` exactly as on one device. :func:`map_full_matrices` is the
extension point for other whole-matrix optimizers (Shampoo, SOAP, ...): it runs a
function on each full matrix on one owner rank and scatters the result back.
See [Note: owner compute for whole-matrix optimizers] in ``_exchange.py``.
"""

from __future__ import annotations

from . import _adafactor, _muon  # noqa: F401 - register the sharded steps
from ._api import map_full_matrices, matrix_owners

__all__ = ["map_full_matrices", "matrix_owners"]
