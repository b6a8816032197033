"""vit.train.lars.LARS against the update worked out by hand, and the optimiser a config's `optim.name=lars` builds."""

import torch

from vit.config import OptimConfig
from vit.train.optim import make_optimizer, param_groups
from vit.train.lars import LARS


def step(optimizer, params, grads):
    for p, g in zip(params, grads):
        p.grad = g.clone()
    optimizer.step()


def test_two_steps_of_a_matrix_match_the_numbers_worked_by_hand():
    # w = [3, 4] (norm 5), grad = [0.6, 0.8] (norm 1), trust coefficient 0.1: trust = 0.1 * 5 / 1 = 0.5.
    w = torch.nn.Parameter(torch.tensor([[3.0, 4.0]]))
    opt = LARS([w], lr=1.0, momentum=0.9, trust_coefficient=0.1)
    g = torch.tensor([[0.6, 0.8]])
    step(opt, [w], [g])
    # mu = 0.5 * g = [0.3, 0.4]; w = [3, 4] - mu
    torch.testing.assert_close(w.detach(), torch.tensor([[2.7, 3.6]]))
    step(opt, [w], [g])
    # ||w|| = 4.5, trust = 0.45; mu = 0.9 * [0.3, 0.4] + 0.45 * [0.6, 0.8] = [0.54, 0.72]
    torch.testing.assert_close(w.detach(), torch.tensor([[2.16, 2.88]]))


def test_weight_decay_momentum_and_trust_ratio_follow_the_formula():
    torch.manual_seed(0)
    w0 = torch.randn(4, 3)
    grads = [torch.randn(4, 3), torch.randn(4, 3)]
    lr, wd, momentum, eta = 0.3, 0.05, 0.9, 0.02
    w = torch.nn.Parameter(w0.clone())
    opt = LARS([{"params": [w], "weight_decay": wd}], lr=lr, momentum=momentum, trust_coefficient=eta)
    for g in grads:
        step(opt, [w], [g])
    # By hand, in float64: d = g + wd * w; trust = eta * ||w|| / ||d||; mu = momentum * mu + trust * d; w -= lr * mu.
    ref, mu = w0.double(), torch.zeros(4, 3, dtype=torch.float64)
    for g in grads:
        d = g.double() + wd * ref
        mu = momentum * mu + eta * ref.norm() / d.norm() * d
        ref = ref - lr * mu
    torch.testing.assert_close(w.detach().double(), ref, rtol=1e-5, atol=1e-6)


def test_vectors_take_plain_sgd_steps_without_decay_or_trust_ratio():
    b = torch.nn.Parameter(torch.tensor([1.0, -2.0, 0.5]))
    # A weight decay in the group does not reach 1-D tensors (biases, norm parameters).
    opt = LARS([{"params": [b], "weight_decay": 0.5}], lr=0.1, momentum=0.9, trust_coefficient=0.001)
    g1, g2 = torch.tensor([1.0, 2.0, -1.0]), torch.tensor([0.5, 0.0, 1.0])
    step(opt, [b], [g1])
    torch.testing.assert_close(b.detach(), torch.tensor([1.0, -2.0, 0.5]) - 0.1 * g1)
    step(opt, [b], [g2])
    torch.testing.assert_close(b.detach(), torch.tensor([1.0, -2.0, 0.5]) - 0.1 * g1 - 0.1 * (0.9 * g1 + g2))


def test_a_zero_matrix_or_zero_gradient_takes_an_unscaled_step():
    # ||w|| = 0 would make the trust ratio 0 and a zero-initialised layer could never move: the ratio is 1 instead.
    w = torch.nn.Parameter(torch.zeros(2, 2))
    opt = LARS([w], lr=0.5, momentum=0.9)
    step(opt, [w], [torch.ones(2, 2)])
    torch.testing.assert_close(w.detach(), torch.full((2, 2), -0.5))
    v = torch.nn.Parameter(torch.ones(2, 2))
    opt = LARS([v], lr=0.5, momentum=0.9)
    step(opt, [v], [torch.zeros(2, 2)])
    assert torch.equal(v.detach(), torch.ones(2, 2))


def test_a_parameter_without_gradient_is_left_alone():
    w, frozen = torch.nn.Parameter(torch.ones(2, 2)), torch.nn.Parameter(torch.ones(2, 2))
    opt = LARS([w, frozen], lr=0.5)
    w.grad = torch.ones(2, 2)
    opt.step()
    assert torch.equal(frozen.detach(), torch.ones(2, 2)) and not opt.state[frozen]
    assert not torch.equal(w.detach(), torch.ones(2, 2))


def test_optim_name_lars_builds_lars_with_the_configs_momentum_and_no_decay_on_vectors():
    model = torch.nn.Sequential(torch.nn.BatchNorm1d(8, affine=False), torch.nn.Linear(8, 3))
    cfg = OptimConfig(name="lars", momentum=0.8, weight_decay=0.1)
    opt = make_optimizer(param_groups(model, cfg.weight_decay), cfg, torch.device("cpu"))
    assert isinstance(opt, LARS)
    decay = {id(p): (g["weight_decay"], g["momentum"]) for g in opt.param_groups for p in g["params"]}
    assert decay[id(model[1].weight)] == (0.1, 0.8)
    assert decay[id(model[1].bias)] == (0.0, 0.8)
