"""Attention kernels. Which one runs depends on what the scheme needs, never on its name."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor


def causal_additive_mask(bias: Tensor) -> Tensor:
    """bias (..., Tq, Tk) -> same with -inf where the key lies after the query.

    Queries are taken to be the last Tq of the Tk positions (Tq == Tk in training)."""
    tq, tk = bias.shape[-2:]
    future = torch.ones(tq, tk, dtype=torch.bool, device=bias.device).triu(tk - tq + 1)
    return bias.masked_fill(future, float("-inf"))


def sdpa_attention(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None) -> Tensor:
    """q, k, v: (B, H, T, Dh); bias broadcastable to (B, H, T, T) or None -> (B, H, T, Dh)."""
    if bias is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_additive_mask(bias).to(q.dtype))


def eager_attention(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None) -> Tensor:
    """Reference path: explicit logits, mask and softmax. Same contract as sdpa_attention."""
    logits = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])  # (B, H, T, T)
    if bias is not None:
        logits = logits + bias
    logits = causal_additive_mask(logits)
    return torch.softmax(logits, dim=-1) @ v


BACKENDS = {"sdpa": sdpa_attention, "eager": eager_attention}
