"""A finite value with a non-finite gradient, as an overflowing term of a user's loss gives: shared by the non-finite
step tests of ``fit`` and of the service."""

from __future__ import annotations

import math

import torch


class InfiniteGradient(torch.autograd.Function):
    """The identity whose derivative is infinite."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad * math.inf
