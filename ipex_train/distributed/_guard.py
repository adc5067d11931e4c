"""Refuse to step an optimizer whose parameters the model no longer holds.

``fully_shard`` (FSDP2) after optimize() replaces the model's parameters with new DTensor parameters; the optimizer
keeps stepping the old ones, which never get a grad again, so training silently changes nothing. optimize()
registers :func:`guard` on the optimizer it returns: at its first step it checks that every parameter it was
given is still one of the model's (one pass over the parameters, once) and raises otherwise, before anything is
stepped.
"""
from __future__ import annotations

import weakref

import torch
from torch import nn


def guard(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Check at ``optimizer``'s first step that its current parameters that were ``model``'s still are."""
    ids = {id(p) for p in model.parameters()}
    # Tensors given to the optimizer from elsewhere are not the model's to lose.
    watched_ids = [id(p) for g in optimizer.param_groups for p in g["params"] if id(p) in ids]
    model_ref = weakref.ref(model)
    handle = None

    def check(opt, args, kwargs):
        model = model_ref()
        if model is None:
            handle.remove()
            return
        now = {id(p) for p in model.parameters()}
        held = {id(p) for g in opt.param_groups for p in g["params"]}
        lost = sum(i not in now for i in watched_ids if i in held)
        if lost:
            raise RuntimeError(f"optimizer.step(): {lost} of the optimizer's parameters are no longer parameters "
                               "of the model (fully_shard, or a load_state_dict(assign=True), replaced them after "
                               "optimize()); stepping would train nothing. With FSDP2: fully_shard every block "
                               "and the root first, build the optimizer from model.parameters(), then call "
                               "optimize(model, optimizer, dtype=..., inplace=True)")
        handle.remove()  # checked once; a refused step is checked again

    handle = optimizer.register_step_pre_hook(check)
