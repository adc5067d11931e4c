"""ipex_train.optim.Lamb and Lars (fused kernel and the plain-torch path) against per-tensor implementations
written here from the papers' update rules, in float64, over several steps with weight decay, two parameter groups
and the edge rules: a tensor with a zero norm (a zero-initialised bias; a step with a zero grad) takes a trust ratio
or local lr of 1, and a large trust ratio is used as it is (neither rule clips it).

LAMB: You et al. 2019, "Large Batch Optimization for Deep Learning: Training BERT in 76 minutes", Algorithm 2 with
the scaling function phi the identity. LARS: You, Gitman and Ginsburg 2017, "Large Batch Training of Convolutional
Networks", Algorithm 1, with an epsilon added to the local lr's denominator."""
import pytest
import torch

from ipex_train.optim import Lamb, Lars

STEPS = 5
# fp32 steps against float64 ones: the update is computed in fp32 (the norms in double), so the difference is a few
# fp32 roundings of each step, relative to the weight's size.
TOL = dict(rtol=2e-6, atol=2e-6)


def paper_lamb(w, grads, lr, betas, eps, weight_decay, bias_correction):
    """Algorithm 2 on one tensor: the weights after one step per grad in ``grads``, with the trust ratio of each."""
    b1, b2 = betas
    x, m, v, ratios = w.double(), torch.zeros_like(w, dtype=torch.float64), torch.zeros_like(w, dtype=torch.float64), []
    for t, g in enumerate(grads, start=1):
        g = g.double()
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        m_hat, v_hat = (m / (1 - b1**t), v / (1 - b2**t)) if bias_correction else (m, v)
        r = m_hat / (v_hat.sqrt() + eps)
        direction = r + weight_decay * x
        x_norm, d_norm = x.norm().item(), direction.norm().item()
        ratio = x_norm / d_norm if x_norm > 0 and d_norm > 0 else 1.0
        ratios.append(ratio)
        x = x - lr * ratio * direction
    return x, ratios


def paper_lars(w, grads, lr, momentum, weight_decay, eeta, epsilon):
    """Algorithm 1 on one tensor: the weights after one step per grad in ``grads``, with the local lr of each."""
    x, velocity, ratios = w.double(), torch.zeros_like(w, dtype=torch.float64), []
    for g in grads:
        g = g.double()
        x_norm, g_norm = x.norm().item(), g.norm().item()
        local = eeta * x_norm / (g_norm + weight_decay * x_norm + epsilon) if x_norm > 0 and g_norm > 0 else 1.0
        ratios.append(local)
        velocity = momentum * velocity + lr * local * (g + weight_decay * x)
        x = x - velocity
    return x, ratios


def case():
    """Initial tensors, their grads per step (step 2 of the third tensor has a zero grad), and their indices per
    group: a matrix, a zero bias, a matrix with a zero-grad step, a large-weights vector (trust ratio in the tens)."""
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(24, 16, generator=gen), torch.zeros(16), torch.randn(5, 7, generator=gen) * 0.1,
               torch.randn(40, generator=gen) * 50]
    grads = [[torch.randn(w.shape, generator=gen) * s for w in weights] for s in (1.0, 0.5, 2.0, 1.0, 0.3)]
    grads[1][2] = torch.zeros_like(weights[2])
    return weights, grads, ([0, 3], [1, 2])


LAMB_GROUPS = (dict(lr=2e-2, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, bias_correction=True),
               dict(lr=5e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, bias_correction=False))
LARS_GROUPS = (dict(lr=0.5, momentum=0.9, weight_decay=1e-3, eeta=1e-2, epsilon=1e-8),
               dict(lr=0.2, momentum=0.5, weight_decay=5e-2, eeta=5e-3, epsilon=0.0))


def run(cls, groups, fused):
    weights, grads, split = case()
    params = [w.clone().requires_grad_() for w in weights]
    opt = cls([dict(params=[params[i] for i in idx], **hp) for idx, hp in zip(split, groups)], fused=fused)
    for step in grads:
        for p, g in zip(params, step):
            p.grad = g.clone()
        opt.step()
    return weights, grads, split, params


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "reference"])
@pytest.mark.parametrize("name", ["lamb", "lars"])
def test_matches_the_paper(name, fused):
    cls, paper, groups = (Lamb, paper_lamb, LAMB_GROUPS) if name == "lamb" else (Lars, paper_lars, LARS_GROUPS)
    weights, grads, split, params = run(cls, groups, fused)
    ratios = {}
    for idx, hp in zip(split, groups):
        for i in idx:
            want, ratios[i] = paper(weights[i], [step[i] for step in grads], **hp)
            moved = (want - weights[i].double()).abs().mean().item()
            assert moved > 100 * TOL["atol"], f"tensor {i} moved only {moved:.2e}"
            torch.testing.assert_close(params[i].detach().double(), want, **TOL, msg=lambda m, i=i: f"tensor {i}: {m}")
    # The edge rules were exercised: a ratio of 1 for the zero bias's first step and (Lars: Lamb's moments keep
    # the direction nonzero) for the zero-grad step; Lamb's trust ratio far above 1 for the large-weights tensor.
    assert ratios[1][0] == 1.0
    if name == "lars":
        assert ratios[2][1] == 1.0
    else:
        assert min(ratios[3]) > 30
