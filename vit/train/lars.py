"""LARS (You et al. 2017), the optimiser MAE's linear probe uses with large batches."""

from __future__ import annotations

import torch


class LARS(torch.optim.Optimizer):
    """SGD with momentum whose step for each weight matrix is scaled by ||w|| / ||grad||.

    1-D tensors (biases, norm parameters) take plain SGD steps, as in MAE's linear probe.

    As fused AdamW and SGD do, a step skips its update where the device flag `found_inf` (a 0-d tensor, set by the
    non-finite-loss guard) is 1: the weights and the momentum keep their values, and the host never reads the flag, so
    the step can be captured in a CUDA graph. A group's `lr` is a number or a 0-d tensor on the parameters' device.
    """

    def __init__(self, params, lr: float = 0.0, weight_decay: float = 0.0, momentum: float = 0.9, trust_coefficient: float = 0.001):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum, trust_coefficient=trust_coefficient))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        found = getattr(self, "found_inf", None)
        keep = None if found is None else found == 0  # a 0-d bool on the device
        for group in self.param_groups:
            lr = group["lr"] if keep is None else torch.where(keep, group["lr"], 0.0)  # a skipped step moves by 0 * mu
            for p in group["params"]:
                if p.grad is None:
                    continue
                d_p = p.grad
                if p.ndim > 1:
                    d_p = d_p.add(p, alpha=group["weight_decay"])
                    param_norm, update_norm = torch.norm(p), torch.norm(d_p)
                    trust = torch.where((param_norm > 0) & (update_norm > 0), group["trust_coefficient"] * param_norm / update_norm,
                                        torch.ones_like(param_norm))  # fmt: skip
                    d_p = d_p.mul(trust)
                state = self.state[p]
                if "mu" not in state:
                    state["mu"] = torch.zeros_like(p)
                mu = state["mu"]
                if keep is None:
                    mu.mul_(group["momentum"]).add_(d_p)
                else:  # selected, not multiplied by the flag: a skipped step's gradient may hold NaN or inf
                    torch.where(keep, mu.mul(group["momentum"]).add_(d_p), mu, out=mu)
                if torch.is_tensor(lr):
                    p.addcmul_(mu, lr, value=-1)  # p - lr * mu, rounded once as `add_(mu, alpha=-lr)` rounds it
                else:
                    p.add_(mu, alpha=-lr)
        return loss
