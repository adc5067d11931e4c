"""What the trainer integrations share: converting a model before its optimizers exist, and giving every process
rank 0's exact fp32 weights."""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ..config import OptimizeConfig
from ..frontend import optimize


def convert_model(model: nn.Module, config: OptimizeConfig) -> None:
    """Convert ``model`` in place as ``optimize(model, optimizer, inplace=True, config=config)`` would, before any
    optimizer exists (a trainer wraps the model in DDP, or evaluates it, first).

    optimize() converts a training model only together with an optimizer; it is given a throwaway SGD over every
    parameter (its returned optimizer is dropped). A later ``optimize(model, optimizer, inplace=True)`` with the
    real optimizer finds the model converted and optimizes only the optimizer. The model's train/eval mode is
    kept. A model optimize() already trains is left as it is (optimize() checks that the dtype agrees).
    """
    params = list(model.parameters())
    if not params:
        return
    was_training = model.training
    # The throwaway optimizer must not hook parameters (step_in_backward) nor take a per-optimizer option.
    config = dataclasses.replace(config, step_in_backward=False, optimizer_state_dtype=None)
    model.train()
    try:
        optimize(model, torch.optim.SGD(params, lr=0.0), inplace=True, config=config)
    finally:
        model.train(was_training)


def broadcast_fp32_weights(model: nn.Module) -> None:
    """Give every process rank 0's exact weights: DDP's own broadcast at wrap time copies only the bf16 tops,
    which would leave different residuals (hence different fp32 weights) on ranks seeded differently."""
    state = model.state_dict()  # fp32 values of the low-precision parameters, aliases of the others
    for value in state.values():
        if isinstance(value, torch.Tensor):
            torch.distributed.broadcast(value, src=0)
    model.load_state_dict(state)  # re-splits the fp32 values into top + residual
