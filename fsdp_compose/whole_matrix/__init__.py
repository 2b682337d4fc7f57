"""Whole-matrix optimizers on parameters sharded by ``fully_shard``.

``torch.optim.Muon`` (bit-identical to single-device Muon) and
``torch.optim.Adafactor`` get a sharded step with
:func:`fsdp_compose.enable_sharded_step`: each whole matrix is updated on one
owner rank. :func:`map_full_matrices` is the extension point for other
whole-matrix optimizers (Shampoo, SOAP, ...): it runs a function on each full
matrix on one owner rank and scatters the result back. See [Note: owner compute
for whole-matrix optimizers] in ``_exchange.py``.
"""

from __future__ import annotations

from ._api import map_full_matrices, matrix_owners

__all__ = ["map_full_matrices", "matrix_owners"]
