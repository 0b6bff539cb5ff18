"""Pre-norm causal decoder whose position scheme comes from the registry (nanoGPT-style)."""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from relpos_cli.attention import BACKEND_NAMES, BiasCache, attend
from relpos_cli.errors import RelposError
from relpos_cli.positions import build_scheme
from relpos_cli.positions.base import TOKEN_EMBEDDING_STD, ModelShape, PositionScheme


class CausalSelfAttention(nn.Module):
    def __init__(self, layer: int, d_model: int, n_heads: int, dropout: float):
        super().__init__()
        self.layer = layer
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)  # fused: one matmul for q, k, v
        self.proj = nn.Linear(d_model, d_model, bias=False)
        self.dropout = nn.Dropout(dropout)
        self.bias_cache = BiasCache()  # plain attribute: not a parameter, not in the state dict

    def forward(self, x: Tensor, positions: Tensor, scheme: PositionScheme, backend: str) -> Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_heads, D // self.n_heads).permute(2, 0, 3, 1, 4)  # 3 x (B, H, T, Dh)
        if scheme.uses_rotation and scheme.eval_extension is None:  # an eval-time extension rotates in attention
            q, k = scheme.rotate(self.layer, q, k, positions)
        y = attend(backend, scheme, self.layer, q, k, v, positions, self.bias_cache, layer_input=x)  # (B, H, T, Dh)
        return self.dropout(self.proj(y.transpose(1, 2).reshape(B, T, D)))


class MLP(nn.Module):
    def __init__(self, d_model: int, mlp_ratio: int, dropout: float):
        super().__init__()
        self.up = nn.Linear(d_model, mlp_ratio * d_model, bias=False)
        self.down = nn.Linear(mlp_ratio * d_model, d_model, bias=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.down(F.gelu(self.up(x))))


class Block(nn.Module):
    def __init__(self, layer: int, d_model: int, n_heads: int, mlp_ratio: int, dropout: float):
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(layer, d_model, n_heads, dropout)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model, mlp_ratio, dropout)

    def forward(self, x: Tensor, positions: Tensor, scheme: PositionScheme, backend: str) -> Tensor:
        x = x + self.attn(self.norm1(x), positions, scheme, backend)
        return x + self.mlp(self.norm2(x))


class Transformer(nn.Module):
    def __init__(
        self,
        vocab_size: int,
        shape: ModelShape,
        pos_cfg: Mapping[str, Any],
        mlp_ratio: int = 4,
        dropout: float = 0.0,
        attn_backend: str = "auto",
    ):
        super().__init__()
        if attn_backend not in BACKEND_NAMES:
            raise RelposError(f"unknown model.attn_backend {attn_backend!r}; choose one of: {', '.join(BACKEND_NAMES)}")
        self.shape = shape
        self.attn_backend = attn_backend
        self.tok_emb = nn.Embedding(vocab_size, shape.d_model)
        self.scheme = build_scheme(pos_cfg, shape)
        self.blocks = nn.ModuleList(
            Block(i, shape.d_model, shape.n_heads, mlp_ratio, dropout) for i in range(shape.n_layers)
        )
        self.norm = nn.LayerNorm(shape.d_model)
        self.lm_head = nn.Linear(shape.d_model, vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight  # tied, as in GPT-2
        self._positions: Tensor | None = None
        self._init_weights()

    def _init_weights(self) -> None:
        for name, p in self.named_parameters():
            if name.startswith("scheme."):
                continue  # each scheme initialises its own parameters
            if p.dim() == 2:
                # residual projections scaled by depth (GPT-2)
                std = TOKEN_EMBEDDING_STD
                if name.endswith(("proj.weight", "down.weight")):
                    std /= math.sqrt(2 * self.shape.n_layers)
                nn.init.normal_(p, std=std)

    def default_positions(self, length: int, device: torch.device) -> Tensor:
        """0..length-1, the same tensor on every call for a length: attention's bias cache is keyed
        by the positions tensor itself."""
        cached = self._positions
        if cached is None or cached.shape[0] != length or cached.device != device:
            cached = self._positions = torch.arange(length, device=device)
        return cached

    def forward(self, tokens: Tensor, at: Tensor | None = None, positions: Tensor | None = None) -> Tensor:
        """tokens (B, T) -> logits (B, T, V); with `at` ((B, T) bool) only the logits where it is
        true, (N, V): scoring a few answer tokens of long examples never holds (B, T, V) logits.
        positions (T,): increasing indices shared by the batch (train.randomized_positions);
        default 0..T-1."""
        if positions is None:
            positions = self.default_positions(tokens.shape[1], tokens.device)
        x = self.scheme.embed(self.tok_emb(tokens), positions)  # (B, T, D)
        for block in self.blocks:
            x = block(x, positions, self.scheme, self.attn_backend)
        x = self.norm(x)
        return self.lm_head(x if at is None else x[at])

    def loss(self, tokens: Tensor, targets: Tensor, reduction: str = "mean", positions: Tensor | None = None) -> Tensor:
        """Cross-entropy in nats; reduction="none" keeps the (B, T) shape."""
        logits = self(tokens, positions=positions)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction=reduction)
        return loss.view_as(targets) if reduction == "none" else loss

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def build_model(cfg: Mapping[str, Any], vocab_size: int) -> Transformer:
    """Model from a composed run config (model, pos, train.seq_len)."""
    m = cfg["model"]
    if m["d_model"] % m["n_heads"]:
        raise RelposError(f"model.d_model={m['d_model']} is not divisible by model.n_heads={m['n_heads']}")
    shape = ModelShape(m["d_model"], m["n_heads"], m["n_layers"], cfg["train"]["seq_len"])
    return Transformer(
        vocab_size,
        shape,
        cfg["pos"],
        mlp_ratio=m.get("mlp_ratio", 4),
        dropout=m.get("dropout", 0.0),
        attn_backend=m.get("attn_backend", "auto"),
    )
