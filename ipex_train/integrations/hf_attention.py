"""ipex_train's attention as a transformers attention implementation: importing this module registers
``attn_implementation="ipex_train"`` with transformers' ``AttentionInterface`` (and its mask interface), so that
Llama-, Qwen2- and Mistral-family models built with it call :mod:`ipex_train.attention` directly::

    import ipex_train.integrations.hf_attention  # noqa: F401  (registers "ipex_train")
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="ipex_train")

Like transformers' flash-attention implementations, it receives no dense mask: causal attention runs without one
(tiles above the diagonal are skipped), packed batches (``DataCollatorWithFlattening``: position ids restarting at 0,
or ``cu_seq_lens_q`` kwargs) run block-diagonal per document, a padding mask is read per key, and a model's sliding
window limits each query's keys. Calls it cannot compute go to torch's attention with the equivalent mask, so the
results are those of ``attn_implementation="sdpa"`` up to bf16 rounding. Models that call
``torch.nn.functional.scaled_dot_product_attention`` themselves are routed by ``ipex_train.optimize``'s native
compute policy instead.
"""
from __future__ import annotations

import math

import torch

from .. import attention

NAME = "ipex_train"

__all__ = ["NAME", "register", "ipex_train_attention_forward"]


def _same_dtype(query, key, value):
    # HF Llama fed fp32 embeddings computes its rotary embedding in fp32: query/key fp32 beside a bf16 value.
    dtypes = {query.dtype, key.dtype, value.dtype}
    if dtypes == {torch.bfloat16, torch.float32}:
        return query.to(torch.bfloat16), key.to(torch.bfloat16), value.to(torch.bfloat16)
    return query, key, value


def _is_packed(position_ids, seq: int) -> bool:
    if not isinstance(position_ids, torch.Tensor) or position_ids.shape[-1] != seq or seq < 2:
        return False
    pos = position_ids.reshape(-1, seq)
    return bool((pos[:, 1:] != pos[:, :-1] + 1).any())


def _starts(kwargs, attention_mask, batch: int, seq: int, window):
    """First key per query (int32 (batch, seq)) for packed documents and/or a sliding window; None for plain causal."""
    cu = kwargs.get("cu_seq_lens_q")
    position_ids = kwargs.get("position_ids")
    if cu is not None:
        return attention.document_starts(batch, seq, cu_seqlens=cu, window=window)
    if attention_mask is None and _is_packed(position_ids, seq):
        return attention.document_starts(batch, seq, position_ids=position_ids, window=window)
    if window is not None:
        return attention.document_starts(batch, seq, position_ids=torch.arange(seq), window=window)
    return None


def _key_mask(attention_mask, batch: int, keys: int):
    """A 2-D padding mask (batch, keys), nonzero = attend, as a boolean (batch, 1, 1, keys) mask."""
    if attention_mask.shape != (batch, keys):
        raise ValueError(f"ipex_train attention: a 2-D attention_mask must have shape (batch, keys) = "
                         f"({batch}, {keys}), got {tuple(attention_mask.shape)}")
    return attention_mask.to(device="cpu").bool().view(batch, 1, 1, keys)


def _dense_mask(attention_mask, batch: int, s: int, t: int, causal: bool, window):
    """The boolean (batch, 1, s, t) mask of a call with a key cache (queries are the last s of t positions)."""
    j = torch.arange(t)
    i = torch.arange(t - s, t).unsqueeze(1)
    keep = (j <= i) if causal else torch.ones(s, t, dtype=torch.bool)
    if window is not None:
        keep = keep & (j > i - window)
    keep = keep.view(1, 1, s, t)
    if attention_mask is not None:
        keep = keep & _key_mask(attention_mask, batch, t)
    return keep.expand(batch, 1, s, t)


def ipex_train_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                                 scaling: float | None = None, is_causal: bool | None = None,
                                 sliding_window: int | None = None, **kwargs):
    """transformers' attention-function signature: query (batch, heads, seq, dim), key/value (batch, kv_heads,
    keys, dim); returns (output (batch, seq, heads, dim), None) (attention weights are not computed)."""
    query, key, value = _same_dtype(query, key, value)
    batch, heads, s, _ = query.shape
    t = key.shape[2]
    gqa = heads != key.shape[1]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    window = sliding_window if isinstance(sliding_window, int) and sliding_window < t else None
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4:
        # A dense mask the caller built (transformers passes it through): used as it is, as sdpa would.
        out = attention.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                                     scale=scaling, enable_gqa=gqa)
    elif causal and s == t and s > 1:
        starts = _starts(kwargs, attention_mask, batch, s, window)
        key_mask = None if attention_mask is None else _key_mask(attention_mask, batch, t)
        out = attention.attend_causal(query, key, value, starts, key_mask, dropout, scaling, gqa)
    else:
        mask = None
        if attention_mask is not None or (causal and s > 1) or window is not None:
            mask = _dense_mask(attention_mask, batch, s, t, causal and s > 1, window)
        out = attention.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout,
                                                     scale=scaling if scaling is not None
                                                     else 1.0 / math.sqrt(query.shape[-1]), enable_gqa=gqa)
    return out.transpose(1, 2).contiguous(), None


def register(name: str = NAME) -> None:
    """Registers the attention function (and transformers' flash-attention mask preparation, which passes no dense
    mask) under ``name`` with transformers; done for ``"ipex_train"`` when this module is imported."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(name, ipex_train_attention_forward)
    AttentionMaskInterface.register(name, flash_attention_mask)


register()
