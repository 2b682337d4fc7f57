"""A small Shampoo optimizer built on ``fsdp_compose.whole_matrix.map_full_matrices``.

Shampoo preconditions each matrix gradient ``G`` (m × n) from both sides:
``L += G Gᵀ``, ``R += Gᵀ G``, update ``= L^(-1/4) G R^(-1/4)``. That needs the
*full* ``G``, which no rank holds when the parameter is sharded by ``fully_shard``.
``map_full_matrices`` gathers each gradient onto one owner rank (owners balanced
by cost), runs ``precondition`` there and scatters the rows of the result back,
so the same class runs on one device (plain tensors) and on sharded parameters,
with the same result. ``L`` and ``R`` (m × m and n × n) live on the owner only.

Run the parity check on 2 CPU processes::

    torchrun --nproc-per-node 2 examples/shampoo.py
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from fsdp_compose.whole_matrix import map_full_matrices


def inverse_root(matrix: torch.Tensor, root: int) -> torch.Tensor:
    """``matrix^(-1/root)`` of a symmetric positive definite matrix."""
    eigenvalues, eigenvectors = torch.linalg.eigh(matrix)
    return eigenvectors @ torch.diag(eigenvalues.clamp(min=1e-12).pow(-1.0 / root)) @ eigenvectors.T


class Shampoo(torch.optim.Optimizer):
    """Shampoo for 2-D parameters (plain or sharded by ``fully_shard``).

    Args:
        params: 2-D parameters (or parameter groups).
        lr: learning rate.
        eps: initial diagonal of the preconditioner statistics ``L`` and ``R``.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-2, eps: float = 1e-4) -> None:
        super().__init__(params, {"lr": lr, "eps": eps})
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 2:
                    raise ValueError(
                        f"Shampoo here handles 2-D parameters; got shape {tuple(p.shape)}"
                    )
        # (L, R) per parameter, on the owner of that matrix only (not in state_dict()).
        self.statistics: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for gi, group in enumerate(self.param_groups):
            indexed = [(pi, p) for pi, p in enumerate(group["params"]) if p.grad is not None]

            def precondition(
                i: int,
                grad: torch.Tensor,
                gi: int = gi,
                indexed: list = indexed,
                group: dict = group,
            ) -> torch.Tensor:
                # Runs on the owner of matrix i, with the full (m, n) gradient.
                key = (gi, indexed[i][0])
                if key not in self.statistics:
                    m, n = grad.shape
                    eps = group["eps"]
                    self.statistics[key] = (
                        eps * torch.eye(m, dtype=grad.dtype),
                        eps * torch.eye(n, dtype=grad.dtype),
                    )
                left, right = self.statistics[key]
                left.add_(grad @ grad.T)
                right.add_(grad.T @ grad)
                return inverse_root(left, 4) @ grad @ inverse_root(right, 4)

            updates = map_full_matrices([p.grad for _, p in indexed], precondition)
            for (_, p), update in zip(indexed, updates):
                p.add_(update, alpha=-group["lr"])  # elementwise: fine on DTensors
        return loss


def main() -> None:
    """Shampoo on a sharded stack of Linear layers vs the same optimizer on one
    process, fed the same full gradients."""
    import copy
    import os

    import torch.distributed as dist
    from launch import finish
    from torch.distributed.tensor import distribute_tensor

    from fsdp_compose import fully_shard

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 30, bias=False), torch.nn.Linear(30, 7, bias=False)
    )
    reference = copy.deepcopy(model)
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    model(torch.randn(2, 16)).sum().backward()  # first forward/backward: lazy init
    opt, ref_opt = Shampoo(model.parameters(), lr=0.05), Shampoo(reference.parameters(), lr=0.05)
    for step in range(3):
        torch.manual_seed(step)
        for p, rp in zip(model.parameters(), reference.parameters()):
            rp.grad = torch.randn(rp.shape)  # the same full gradient everywhere
            p.grad = distribute_tensor(rp.grad, p.device_mesh, p.placements)
        opt.step()
        ref_opt.step()
    worst = max(
        (p.full_tensor() - rp).abs().max().item()
        for p, rp in zip(model.parameters(), reference.parameters())
    )
    if dist.get_rank() == 0:
        print(f"Shampoo on {dist.get_world_size()} ranks vs one process: max |diff| = {worst:.2e}")
    finish()
    if worst > 1e-6 and os.environ.get("FSDP_COMPOSE_EXAMPLE_CHECK", "1") == "1":
        raise SystemExit(1)


if __name__ == "__main__":
    main()
