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


def test_a_tensor_learning_rate_under_the_guards_flag_steps_bit_for_bit_as_a_number_without_it():
    # A captured step (vit/train/graph.py) gives LARS its learning rate as a 0-d tensor, refilled each step, and the
    # guard's decision as `found_inf`: 0 steps exactly as the plain run does; 1 (NaN gradients, step 3) is the step the
    # plain run never takes.
    def trained(flagged: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        w, b = torch.nn.Parameter(torch.randn(5, 7)), torch.nn.Parameter(torch.randn(7))
        opt = LARS([{"params": [w], "weight_decay": 0.05}, {"params": [b]}], momentum=0.9, trust_coefficient=0.02)
        if flagged:
            opt.found_inf = torch.zeros(())
            for group in opt.param_groups:
                group["lr"] = torch.zeros((), dtype=torch.float64)  # as StepGraph's on a CPU
        g = torch.Generator().manual_seed(1)
        for i in range(8):
            bad = i == 3
            grads = [torch.randn(p.shape, generator=g) * (float("nan") if bad else 1.0) for p in (w, b)]
            for group, scale in zip(opt.param_groups, (0.5, 1.0)):
                if flagged:
                    group["lr"].fill_(0.3 / (i + 1) * scale)
                else:
                    group["lr"] = 0.3 / (i + 1) * scale
            if flagged:
                opt.found_inf.fill_(float(bad))
            if flagged or not bad:
                step(opt, [w, b], grads)
        return [w.detach(), b.detach(), opt.state[w]["mu"], opt.state[b]["mu"]]

    plain, flagged = trained(False), trained(True)
    assert all(torch.isfinite(t).all() for t in flagged)
    assert all(torch.equal(a, b) for a, b in zip(plain, flagged))


def test_a_raised_flag_leaves_the_weights_and_the_momentum_as_they_were():
    w, b = torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))
    start = [w.detach().clone(), b.detach().clone()]
    opt = LARS([w, b], lr=0.5, momentum=0.9, trust_coefficient=0.1)
    nan = [torch.full((4, 3), float("nan")), torch.full((3,), float("inf"))]
    opt.found_inf = torch.ones(())
    step(opt, [w, b], nan)  # a first step, before any momentum: mu stays zeros
    assert torch.equal(w.detach(), start[0]) and torch.equal(b.detach(), start[1])
    assert all(torch.equal(opt.state[p].get("mu", torch.zeros_like(p)), torch.zeros_like(p)) for p in (w, b))
    opt.found_inf = torch.zeros(())
    step(opt, [w, b], [torch.ones(4, 3), torch.ones(3)])
    assert not torch.equal(w.detach(), start[0]) and not torch.equal(b.detach(), start[1])  # a lowered flag steps
    kept = [t.detach().clone() for t in (w, b, opt.state[w]["mu"], opt.state[b]["mu"])]
    opt.found_inf.fill_(1.0)
    step(opt, [w, b], nan)
    assert all(torch.equal(a, k) for a, k in zip((w, b, opt.state[w]["mu"], opt.state[b]["mu"]), kept))
