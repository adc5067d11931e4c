"""Checks every native-policy module route's tests share: detaching restores the class's forwards and the model's
output, attaching again routes again, and a pickled routed model runs; the emulated policy routes nothing; the
optimize() call, the training loop and the native-policy marker the route tests use."""
import pickle

import pytest
import torch
from op_names import OpNames

import ipex_train
import ipex_train.compute_policy as cp

# The routes belong to the native bf16 compute policy: their tests skip where this CPU (no AVX-512 BF16) or
# IPEX_TRAIN_BF16_COMPUTE selects the emulated one.
native = pytest.mark.skipif(cp.resolve() != "native", reason="the route belongs to the native bf16 compute policy "
                            "(this CPU or IPEX_TRAIN_BF16_COMPUTE selects the emulated one)")


def optimized(model, policy="native", lr=0.05):
    """``(model, optimizer)`` from optimize(bf16, ``bf16_compute=policy``) over an SGD (momentum 0.9) of ``model``'s
    trainable parameters."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr, momentum=0.9)
    return ipex_train.optimize(model, opt, dtype=torch.bfloat16, bf16_compute=policy)


def emulated_does_not_route(model, modules_of, train_step, op_name):
    """``model`` optimized under the emulated policy: none of ``modules_of(model)`` (not empty) has an instance-level
    forward, and ``train_step(model, optimizer)`` never calls ``op_name``."""
    model, opt = optimized(model, policy="emulated")
    modules = modules_of(model)
    assert modules and not any("forward" in vars(m) for m in modules)
    with OpNames() as ops:
        train_step(model, opt)
    assert op_name not in ops.names


def detach_restores_and_attach_again(model, modules, routes, op_name, output):
    """``model`` routed under the native policy; ``modules`` the ones the route took, ``routes`` its predicate,
    ``op_name`` its op as OpNames records it, ``output(model)`` a floating tensor the routed modules feed."""
    assert modules and all(routes(m) is False for m in modules)  # already routed
    with torch.no_grad():
        routed = output(model)
    cp.attached(model).remove()
    assert all("forward" not in vars(m) and routes(m) for m in modules)
    with OpNames() as ops, torch.no_grad():
        plain = output(model)
    assert op_name not in ops.names
    assert (routed.float() - plain.float()).abs().max().item() <= 2**-5 * plain.float().abs().max().item()
    handle = cp.attach(model, "native")
    assert all("forward" in vars(m) for m in modules)
    copy_ = pickle.loads(pickle.dumps(model))
    assert torch.isfinite(output(copy_).float()).all()
    handle.remove()


def train(model, opt, loss_fn, steps):
    """``steps`` plain optimizer steps on ``loss_fn(model)``; the losses as floats."""
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def assert_trained_alike(routed, unrouted, model, ref_model, start):
    """A routed and an unrouted run from the same ``start`` state dict agree: each step's loss within 1%, each
    parameter within 5% of its scale (its largest magnitude, or 20x its largest change, whichever is larger). The
    routes round at other points than torch's ops (one rounding where autograd rounds twice), so not bit for bit."""
    assert len(routed) == len(unrouted)
    for a, b in zip(routed, unrouted):
        assert abs(a - b) <= 1e-2 * abs(b)
    ref_params = dict(ref_model.named_parameters())
    for name, p in model.named_parameters():
        q, s = ref_params[name].float(), start[name].float()
        scale = max(q.abs().max().item(), (q - s).abs().max().item() * 20)
        assert (p.float() - q).abs().max().item() <= 0.05 * scale + 1e-6, name
