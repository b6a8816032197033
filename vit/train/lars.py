"""LARS (You et al. 2017), the optimiser MAE's linear probe uses with large batches."""

from __future__ import annotations

import torch


class LARS(torch.optim.Optimizer):
    """SGD with momentum whose step for each weight matrix is scaled by ||w|| / ||grad||.

    1-D tensors (biases, norm parameters) take plain SGD steps, as in MAE's linear probe.
    """

    def __init__(self, params, lr: float = 0.0, weight_decay: float = 0.0, momentum: float = 0.9, trust_coefficient: float = 0.001):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum, trust_coefficient=trust_coefficient))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                d_p = p.grad
                if p.ndim > 1:
                    d_p = d_p.add(p, alpha=group["weight_decay"])
                    param_norm, update_norm = torch.norm(p), torch.norm(d_p)
                    trust = torch.where((param_norm > 0) & (update_norm > 0), group["trust_coefficient"] * param_norm / update_norm, torch.ones_like(param_norm))
                    d_p = d_p.mul(trust)
                state = self.state[p]
                if "mu" not in state:
                    state["mu"] = torch.zeros_like(p)
                mu = state["mu"]
                mu.mul_(group["momentum"]).add_(d_p)
                p.add_(mu, alpha=-group["lr"])
        return loss
