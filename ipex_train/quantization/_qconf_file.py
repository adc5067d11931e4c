"""The qconf summary: the calibration result as a list of per-op dicts, saved as human-editable JSON (seed 002).

One entry per op, in id order::

    {"id": 0, "name": "conv1", "type": "conv2d", "algorithm": "min_max", "weight_granularity": "per_channel",
     "post_op": "relu", "input_scales": [0.027], "input_zero_points": [125], "output_scales": [0.016],
     "output_zero_points": [0], "weight_scales": [[...one per output channel...]], "weight_quant_range": [-128, 127],
     "input_quantized_dtypes": ["uint8"], "output_quantized_dtypes": ["uint8"], "inputs_quantized": [true],
     "outputs_quantized": [true], "inputs_flow": [null], "outputs_flow": ["conv1.output0"]}

Editable: scales and zero points, ``inputs_quantized`` (false on any input keeps the op fp32), ``outputs_quantized``
(false: the op dequantizes its result), ``post_op`` (null or "relu": whether the relu that reads the op's output
is computed inside the int8 kernel), the weight scales and range. ``id``, ``name``, ``type`` and the flows describe
the model and must match it. Input scales serve when an input arrives in fp32 (an int8 input keeps its own scale);
output scales are those of the op's int8 result, except for an in-place add (``out += identity``), which writes
into its first input at that input's scale.
"""
from __future__ import annotations

import json

ACT_DTYPE = "uint8"
WEIGHT_RANGES = ([-128, 127], [-64, 63])
_STRUCTURE = ("id", "name", "type", "inputs_flow", "outputs_flow")
# The accepted scales. The int8 kernels work in float32 on products of up to three scales: the requantization
# multiplier input_scale * weight_scale / output_scale and the bias scale input_scale * weight_scale. Keeping every
# scale within 2**+-42 keeps those products within 2**+-126, the normal float32 range, so no combination of
# accepted scales underflows to zero or a denormal, or overflows. Calibration gives scales of at least 2**-23
# (torch's observers floor them at float32 eps); 2**42 lets activations reach 255 * 2**42 (about 1e15).
SCALE_MIN, SCALE_MAX = 2.0 ** -42, 2.0 ** 42


def entry(op, qconfig, bits: int) -> dict:
    """The summary entry of one calibrated op (scales null where the op never ran)."""
    ran = op.calls > 0
    fused = bool(op.relu_fusable)
    out_obs = op.relu_obs if fused else op.out_obs
    ins = [_qparams(o) if ran else (None, None) for o in op.in_obs]
    out = _qparams(out_obs) if ran else (None, None)
    weight = op.module is not None
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    return {
        "id": op.id, "name": op.name, "type": op.kind, "algorithm": qconfig.algorithm,
        "weight_granularity": qconfig.weight_granularity if weight else None,
        "post_op": "relu" if fused else None,
        "input_scales": [s for s, _ in ins], "input_zero_points": [z for _, z in ins],
        "output_scales": [out[0]], "output_zero_points": [out[1]],
        "weight_scales": [qconfig.weight_qparams(op.module.weight, bits)] if weight else [],
        "weight_quant_range": [lo, hi] if weight else None,
        "input_quantized_dtypes": [ACT_DTYPE] * op.n_inputs, "output_quantized_dtypes": [ACT_DTYPE],
        "inputs_quantized": [ran] * op.n_inputs, "outputs_quantized": [ran and not op.mutated_in_place],
        "inputs_flow": list(op.inputs_flow), "outputs_flow": [f"{op.name}.output0"],
    }


def _qparams(obs):
    scale, zp = obs.calculate_qparams()
    return float(scale.reshape(-1)[0]), int(zp.reshape(-1)[0])


def int8(e: dict) -> bool:
    """Whether the op of this (validated) entry runs int8."""
    return all(e["inputs_quantized"])


def save(summary: list[dict], path) -> None:
    """Write the summary as indented JSON."""
    with open(path, "w") as f:
        json.dump(summary, f, indent=1)
        f.write("\n")


def load(path, ops) -> list[dict]:
    """Read a summary and check it against the model's ops; ValueError naming the first mismatch."""
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"load_qconf_summary: {path} is not valid JSON ({e})") from None
    if not isinstance(data, list):
        raise ValueError(f"load_qconf_summary: {path} must hold a JSON list of op entries, got "
                         f"{type(data).__name__}")
    validate(data, ops, f"load_qconf_summary: {path}")
    return data


def validate(summary: list, ops, caller: str) -> None:
    """Check a summary against the model's ops: the one check that load_qconf_summary, save_qconf_summary and
    convert() share, so a summary one of them accepts is accepted by all. ValueError naming ``caller``, the op and
    the key of the first problem, and what would be accepted."""
    for i, op in enumerate(ops):
        if i >= len(summary):
            raise ValueError(f"{caller} has {len(summary)} ops, this model has {len(ops)}; the first missing one "
                             f"is op {i} ({op.name!r})")
        _check(summary[i], op, i, caller)
    if len(summary) > len(ops):
        raise ValueError(f"{caller} has {len(summary)} ops, this model has {len(ops)}; op {len(ops)} "
                         f"({summary[len(ops)].get('name')!r}) is not in the model")


def _check(e, op, i, caller) -> None:
    where = f"{caller}: op {i} ({op.name!r})"
    if not isinstance(e, dict):
        raise ValueError(f"{where}: entry must be a JSON object, got {type(e).__name__}")
    want = {"id": i, "name": op.name, "type": op.kind, "inputs_flow": list(op.inputs_flow),
            "outputs_flow": [f"{op.name}.output0"]}
    for key in _STRUCTURE:
        if e.get(key) != want[key]:
            raise ValueError(f"{where}: {key} is {e.get(key)!r} in the file but {want[key]!r} in this model")
    _check_sides(e, op, where)
    if e.get("algorithm") not in ("min_max", "histogram"):
        raise ValueError(f"{where}: algorithm must be \"min_max\" or \"histogram\", got {e.get('algorithm')!r}")
    if e.get("post_op") not in (None, "relu"):
        raise ValueError(f"{where}: post_op must be null or \"relu\", got {e.get('post_op')!r}")
    if op.module is not None:
        _check_weight(e, op, where)


def _check_sides(e, op, where: str) -> None:
    """The per-input and per-output lists: quantized flags, dtypes, scales and zero points."""
    n = {"input": op.n_inputs, "output": 1}
    for side in ("input", "output"):
        for key, check in ((f"{side}s_quantized" if side == "input" else "outputs_quantized", _bool),
                           (f"{side}_quantized_dtypes", _dtype), (f"{side}_scales", _scale),
                           (f"{side}_zero_points", _zero_point)):
            values = e.get(key)
            if not isinstance(values, list) or len(values) != n[side]:
                raise ValueError(f"{where}: {key} must be a list of {n[side]}, got {values!r}")
            nullable = key.endswith(("scales", "zero_points")) and not int8(e)
            for k, v in enumerate(values):
                if not (nullable and v is None) and not check(v):
                    raise ValueError(f"{where}: {key}[{k}] = {v!r} is not {check.__doc__}")


def _check_weight(e, op, where: str) -> None:
    """The weight's quantization range, scales and their granularity against the module's output channels."""
    rng = e.get("weight_quant_range")
    if rng not in WEIGHT_RANGES:
        raise ValueError(f"{where}: weight_quant_range must be one of {WEIGHT_RANGES}, got {rng!r}")
    channels = op.module.weight.shape[0]
    scales = e.get("weight_scales")
    if (not isinstance(scales, list) or len(scales) != 1 or not isinstance(scales[0], list)
            or len(scales[0]) not in (1, channels)):
        raise ValueError(f"{where}: weight_scales must be [[one scale per output channel ({channels}) or one]]")
    granularity = "per_channel" if len(scales[0]) == channels and channels > 1 else "per_tensor"
    if e.get("weight_granularity") not in ("per_channel", "per_tensor") or (
            e["weight_granularity"] != granularity and channels > 1):
        raise ValueError(f"{where}: weight_granularity {e.get('weight_granularity')!r} does not match "
                         f"{len(scales[0])} weight scale(s) for {channels} output channels")
    for k, v in enumerate(scales[0]):
        if not _scale(v):
            raise ValueError(f"{where}: weight_scales[0][{k}] = {v!r} is not {_scale.__doc__}")


def _bool(v):
    """true or false"""
    return isinstance(v, bool)


def _dtype(v):
    """"uint8" (the only activation type the int8 kernels take)"""
    return v == ACT_DTYPE


def _scale(v):
    """a positive number in [2**-42, 2**42] (about 2.3e-13 to 4.4e12)"""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and SCALE_MIN <= v <= SCALE_MAX


def _zero_point(v):
    """an integer in 0..255"""
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 255
