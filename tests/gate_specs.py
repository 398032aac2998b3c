"""SPECs for the comm-gate tests: a model, and the same model after a change that adds
communication (an op without a sharding rule in the middle of the chain)."""
from __future__ import annotations

import torch
import torch.nn as nn

from shardc.tools.models import MLPChain


class _WithScan(MLPChain):
    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        x = self.layers[0](x)
        x = torch.logcumsumexp(x, dim=-1)  # no sharding rule: gathered, run replicated
        for layer in self.layers[1:]:
            x = layer(torch.nn.functional.gelu(x))
        return nn.functional.mse_loss(x, target)


def mlp() -> tuple[nn.Module, tuple]:
    torch.manual_seed(0)
    return MLPChain(dim=16, layers=4), (torch.randn(16, 16), torch.randn(16, 16))


def mlp_with_extra_collective() -> tuple[nn.Module, tuple]:
    torch.manual_seed(0)
    return _WithScan(dim=16, layers=4), (torch.randn(16, 16), torch.randn(16, 16))
