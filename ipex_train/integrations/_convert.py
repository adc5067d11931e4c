"""What the trainer integrations share: converting a model before its optimizers exist, giving every process
rank 0's exact fp32 weights, and the loop options the step inside backward cannot honour."""
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


def refuse_step_in_backward_options(owner: str, options: str, accumulation: tuple[str, int],
                                    clipping: tuple[str, float | None], world_size: int) -> None:
    """Raise ValueError for a trainer option ``step_in_backward`` cannot honour. Each backward steps and frees every
    grad: no accumulation over several backwards, no clipping by the global grad norm, nothing left for DDP to
    reduce. ``options`` names where the trainer's options live; ``accumulation`` and ``clipping`` are its
    (option name, value)."""
    (acc_name, acc), (clip_name, clip) = accumulation, clipping
    if acc > 1:
        raise ValueError(f"{owner}: step_in_backward makes each backward one optimizer step; {options}({acc_name}="
                         f"{acc}) needs several backwards per step: set it to 1 or turn step_in_backward off")
    if clip:
        raise ValueError(f"{owner}: step_in_backward frees each grad inside backward, so clipping by the global grad "
                         f"norm is impossible; {options}({clip_name}={clip}) asks for it: turn clipping or "
                         "step_in_backward off")
    if world_size > 1:
        raise ValueError(f"{owner}: step_in_backward steps each parameter before DistributedDataParallel's "
                         f"all-reduce; it cannot run with {world_size} processes: train in one process or turn it "
                         "off")
