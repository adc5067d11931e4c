"""Causal attention over packed sequences: several documents one after the other in a row, each attending only to
itself (block-diagonal causal), as transformers' ``DataCollatorWithFlattening`` produces them. The tiled kernel reads
one number per query, the first key of its document, and skips the tiles outside the diagonal blocks."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import _op


def _check_int(name: str, value) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dtype.is_floating_point or value.dtype.is_complex \
            or value.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {type(value).__name__}"
                        f"{'' if not isinstance(value, torch.Tensor) else ' of ' + str(value.dtype)}")
    return value.to(device="cpu", dtype=torch.int64)


def _starts_from_positions(batch: int, seq: int, position_ids) -> torch.Tensor:
    pos = _check_int("position_ids", position_ids)
    if pos.dim() == 1:
        pos = pos.unsqueeze(0)
    if pos.dim() != 2 or pos.shape[1] != seq or pos.shape[0] not in (1, batch):
        raise ValueError(f"position_ids must have shape (batch, seq) = ({batch}, {seq}) or (1, {seq}), got "
                         f"{tuple(position_ids.shape)}")
    pos = pos.expand(batch, seq)
    # A document starts where the position does not continue the previous one (transformers' rule for packed rows).
    index = torch.arange(seq, dtype=torch.int64).expand(batch, seq)
    new = torch.ones(batch, seq, dtype=torch.bool)
    new[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    return torch.where(new, index, torch.zeros_like(index)).cummax(dim=1).values


def _starts_from_lengths(batch: int, seq: int, cu_seqlens) -> torch.Tensor:
    cu = _check_int("cu_seqlens", cu_seqlens)
    if cu.dim() != 1 or cu.numel() < 2 or cu[0].item() != 0 or cu[-1].item() != batch * seq \
            or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"cu_seqlens must be a 1-D nondecreasing tensor from 0 to batch * seq = {batch * seq}, got "
                         f"{cu.tolist() if cu.numel() <= 16 else tuple(cu.shape)}")
    lengths = cu[1:] - cu[:-1]
    flat = torch.repeat_interleave(cu[:-1], lengths)
    starts = flat.view(batch, seq) - (torch.arange(batch, dtype=torch.int64) * seq).unsqueeze(1)
    if bool((starts < 0).any()):
        raise ValueError("cu_seqlens: a document crosses the end of a batch row; each row must hold whole documents")
    return starts


def document_starts(batch: int, seq: int, *, cu_seqlens=None, position_ids=None, window: int | None = None):
    """The first key each query may attend to, as an int32 tensor of shape (batch, seq).

    Give exactly one of ``cu_seqlens`` (1-D cumulative document lengths over the flattened batch, from 0 to
    batch * seq, as flash-attention kwargs carry them) or ``position_ids`` ((batch, seq) or (1, seq); a document starts
    wherever a position does not continue the previous one, e.g. restarts at 0). ``window`` additionally limits each
    query to the ``window`` most recent keys (sliding-window attention).
    """
    if (cu_seqlens is None) == (position_ids is None):
        raise ValueError("document_starts: give exactly one of cu_seqlens and position_ids")
    if cu_seqlens is not None:
        starts = _starts_from_lengths(batch, seq, cu_seqlens)
    else:
        starts = _starts_from_positions(batch, seq, position_ids)
    if window is not None:
        if not isinstance(window, int) or isinstance(window, bool) or window < 1:
            raise ValueError(f"window must be a positive int, got {window!r}")
        starts = torch.maximum(starts, torch.arange(seq, dtype=torch.int64) - window + 1)
    return starts.to(torch.int32).contiguous()


def _keep_mask(starts: torch.Tensor, seq: int) -> torch.Tensor:
    """The boolean (batch, 1, seq, seq) mask of block-diagonal causal attention (for torch's attention)."""
    j = torch.arange(seq)
    i = j.unsqueeze(1)
    return ((j <= i) & (j >= starts.to(torch.int64).unsqueeze(-1))).unsqueeze(1)


def attend_causal(query, key, value, doc_starts, attn_mask=None, dropout_p: float = 0.0, scale=None,
                  enable_gqa: bool = False):
    """Causal attention restricted per query to keys from ``doc_starts`` (int32 (batch, seq), or None for plain
    causal), combined with ``attn_mask`` (boolean or additive, broadcastable to (batch, heads, seq, seq), or None).
    Computed by the tiled kernel where it runs, else by torch with the equivalent mask."""
    from . import _additive, _ops, _tiles_run, supports  # the package imports this module

    b, _, s, _ = query.shape
    if key.shape[2] != s:
        raise ValueError(f"causal attention over packed sequences needs as many keys as queries, got {s} queries "
                         f"and {key.shape[2]} keys")
    if doc_starts is None and attn_mask is None:  # plain causal: the package's rule picks the kernel
        from . import scaled_dot_product_attention

        return scaled_dot_product_attention(query, key, value, dropout_p=dropout_p, is_causal=True, scale=scale,
                                            enable_gqa=enable_gqa)
    plain_ok = supports(query, key, value, attn_mask, dropout_p, False, scale, enable_gqa)
    if plain_ok and _tiles_run(query, value):
        scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
        seed = _ops.dropout_seed(dropout_p)
        mask = None if attn_mask is None else _additive(attn_mask)
        return _op.flash_forward(query.contiguous(), key.contiguous(), value.contiguous(), mask, doc_starts,
                                 float(dropout_p), True, float(scale), seed)
    keep = _keep_mask(doc_starts if doc_starts is not None else torch.zeros(b, s, dtype=torch.int32), s)
    if attn_mask is None:
        mask = keep
    elif attn_mask.dtype == torch.bool:
        mask = keep & attn_mask
    else:
        mask = attn_mask.masked_fill(~keep, -math.inf)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout_p, scale=scale,
                                          enable_gqa=enable_gqa)


def packed_attention(query, key, value, *, cu_seqlens=None, position_ids=None, dropout_p: float = 0.0, scale=None,
                     enable_gqa: bool = False, window: int | None = None):
    """Causal attention within each document of rows that pack several documents (no attention across documents),
    equal to running each document alone.

    query (batch, heads, seq, dim), key/value (batch, kv_heads, seq, dim) as for
    ``torch.nn.functional.scaled_dot_product_attention``; the documents are given by exactly one of ``cu_seqlens`` or
    ``position_ids`` (see :func:`document_starts`); ``window``: sliding-window attention within the documents.
    bf16 CPU inputs with head dims that are multiples of 16 run on the tiled kernel (on CPUs with AVX-512 BF16);
    anything else runs torch's attention with the equivalent (batch, 1, seq, seq) boolean mask.
    """
    if not isinstance(query, torch.Tensor) or query.dim() != 4:
        raise ValueError("packed_attention: query must be a 4-D tensor (batch, heads, seq, dim)")
    starts = document_starts(query.shape[0], query.shape[2], cu_seqlens=cu_seqlens, position_ids=position_ids,
                             window=window)
    return attend_causal(query, key, value, starts, None, dropout_p, scale, enable_gqa)
