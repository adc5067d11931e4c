"""Checks every native-policy module route's tests share: detaching restores the class's forwards and the model's
output, attaching again routes again, and a pickled routed model runs."""
import pickle

import torch
from op_names import OpNames

import ipex_train.compute_policy as cp


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
