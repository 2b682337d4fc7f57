"""Small models exercising corner cases of sharding (importable by rank processes)."""

from __future__ import annotations

import torch
import torch.nn as nn


class OddShapes(nn.Module):
    """Parameters whose dim 0 is not divisible by, or smaller than, the world size."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(13, 7)  # weight (7, 13), bias (7,)
        self.b = nn.Linear(7, 3)  # weight (3, 7), bias (3,)
        self.c = nn.Linear(3, 1)  # weight (1, 3), bias (1,)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 3))  # (3,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        h = torch.tanh(self.b(h)) * self.scale
        return self.c(h).squeeze(-1)


class Stack(nn.Module):
    """Sequential odd-shaped layers, one unit each, plus a root-owned head."""

    def __init__(self, n: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(13, 13), nn.Tanh()) for _ in range(n))
        self.head = OddShapes()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class FrozenAndIgnored(nn.Module):
    """A unit with a frozen parameter and an ignored one."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.trainable = nn.Linear(8, 8)
        self.ignored = nn.Linear(8, 8)
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.frozen(x))
        x = torch.relu(self.trainable(x)) + self.ignored(x)
        return self.out(x).squeeze(-1)


class Reuse(nn.Module):
    """One unit called several times in one forward."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 10)
        self.shared = nn.Sequential(nn.Linear(10, 10), nn.Tanh())
        self.out = nn.Linear(10, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for _ in range(3):
            x = self.shared(x)
        return self.out(x).squeeze(-1)


class Wrapper(nn.Module):
    """A root that owns no parameters: every parameter is in the wrapped model."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.gpt = inner

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.gpt(idx)


class SharedWeightBlocks(nn.Module):
    """ALBERT-style sharing: blocks 0, 1 and 3 use one ``mix`` weight (tied
    Linear weights), block 2 has its own; each block has an unshared layer too."""

    def __init__(self, width: int = 16, n: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(6, width)
        self.blocks = nn.ModuleList(_MixBlock(width) for _ in range(n))
        for i in (1, 3):
            self.blocks[i].mix.weight = self.blocks[0].mix.weight
        self.out = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x).squeeze(-1)


class _MixBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.own = nn.Linear(width, width)
        self.mix = nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.mix(torch.tanh(self.own(x))))
