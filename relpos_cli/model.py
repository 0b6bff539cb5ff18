"""Pre-norm causal decoder whose position scheme comes from the registry (nanoGPT-style)."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from relpos_cli.attention import BACKEND_NAMES, BiasCache, attend, check_backend, check_sliding_window
from relpos_cli.errors import RelposError
from relpos_cli.extension import EvalMethod, Extension, check_method
from relpos_cli.positions import build_scheme
from relpos_cli.positions.base import TOKEN_EMBEDDING_STD, ModelShape, PositionScheme
from relpos_cli.settings import model_option_defaults


LOSS_CHUNK_BYTES = 32 * 2**20  # evaluation: fp32 logits of at most this many bytes at once (token_losses)


class CausalSelfAttention(nn.Module):
    def __init__(self, layer: int, d_model: int, n_heads: int, dropout: float, n_kv_heads: int | None = None,
                 qkv_bias: bool = False, proj_bias: bool = False, window: int | None = None):
        super().__init__()
        self.layer = layer
        self.window = window  # sliding attention: the keys at distance < window; None = every earlier key
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads or n_heads
        head_dim = d_model // n_heads
        # fused: one matmul for q (n_heads) and k, v (n_kv_heads each), in that order
        self.qkv = nn.Linear(d_model, (n_heads + 2 * self.n_kv_heads) * head_dim, bias=qkv_bias)
        self.proj = nn.Linear(d_model, d_model, bias=proj_bias)
        self.dropout = nn.Dropout(dropout)
        self.bias_cache = BiasCache()  # plain attribute: not a parameter, not in the state dict

    def heads(self, x: Tensor, positions: Tensor, scheme: PositionScheme,
              extension: Extension | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """x (B, T, D) -> q, k, v (B, H, T, Dh) as attention takes them: key/value heads repeated for
        their query heads, q and k rotated by the scheme (not under an eval-time extension, which
        rotates each pair in attention). What inspect recomputes the logits from."""
        B, T, D = x.shape
        H, KV, Dh = self.n_heads, self.n_kv_heads, D // self.n_heads
        q, k, v = self.qkv(x).split([H * Dh, KV * Dh, KV * Dh], dim=-1)  # (B, T, H*Dh), 2 x (B, T, KV*Dh)
        q = q.view(B, T, H, Dh).transpose(1, 2)  # (B, H, T, Dh)
        k = k.view(B, T, KV, Dh).transpose(1, 2)  # (B, KV, T, Dh)
        v = v.view(B, T, KV, Dh).transpose(1, 2)
        if KV != H:  # grouped-query attention: each key/value head serves H / KV query heads
            k, v = k.repeat_interleave(H // KV, dim=1), v.repeat_interleave(H // KV, dim=1)  # (B, H, T, Dh)
        if scheme.uses_rotation and extension is None:
            q, k = scheme.rotate(self.layer, q, k, positions)
        return q, k, v

    def forward(self, x: Tensor, positions: Tensor, scheme: PositionScheme, backend: str,
                extension: Extension | None = None, consecutive: bool | None = None) -> Tensor:
        B, T, D = x.shape
        q, k, v = self.heads(x, positions, scheme, extension)
        y = attend(backend, scheme, self.layer, q, k, v, positions, self.bias_cache, layer_input=x,
                   window=self.window, extension=extension, consecutive=consecutive)  # (B, H, T, Dh)
        return self.dropout(self.proj(y.transpose(1, 2).reshape(B, T, D)))


ACTIVATIONS = {"gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


class MLP(nn.Module):
    """gelu / gelu_tanh: down(act(up x)); swiglu: down(silu(gate x) * up x) (Llama)."""

    def __init__(self, d_model: int, hidden: int, dropout: float, kind: str = "gelu", bias: bool = False):
        super().__init__()
        self.gated = kind == "swiglu"
        if self.gated:
            self.gate = nn.Linear(d_model, hidden, bias=bias)
        self.up = nn.Linear(d_model, hidden, bias=bias)
        self.down = nn.Linear(hidden, d_model, bias=bias)
        self.act = F.silu if self.gated else ACTIVATIONS[kind]
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        h = self.act(self.gate(x)) * self.up(x) if self.gated else self.act(self.up(x))
        return self.dropout(self.down(h))


def make_norm(kind: str, d_model: int, eps: float) -> nn.Module:
    return nn.RMSNorm(d_model, eps=eps) if kind == "rmsnorm" else nn.LayerNorm(d_model, eps=eps)


@dataclass(frozen=True)
class BlockOptions:
    """How a block is built beyond its width (model.* keys; defaults: relpos's own model)."""

    mlp_hidden: int
    dropout: float = 0.0
    n_kv_heads: int | None = None
    mlp: str = "gelu"
    norm: str = "layernorm"
    norm_eps: float = 1e-5
    attn_bias: bool = False
    proj_bias: bool = False
    mlp_bias: bool = False
    parallel_residual: bool = False
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] | None = None  # the layers with the window; None = every layer

    def window(self, layer: int) -> int | None:
        on = self.sliding_layers is None or layer in self.sliding_layers
        return self.sliding_window if on else None


class Block(nn.Module):
    def __init__(self, layer: int, d_model: int, n_heads: int, options: BlockOptions):
        super().__init__()
        o = options
        self.parallel_residual = o.parallel_residual
        self.norm1 = make_norm(o.norm, d_model, o.norm_eps)
        self.attn = CausalSelfAttention(layer, d_model, n_heads, o.dropout, o.n_kv_heads, o.attn_bias, o.proj_bias,
                                        o.window(layer))
        self.norm2 = make_norm(o.norm, d_model, o.norm_eps)
        self.mlp = MLP(d_model, o.mlp_hidden, o.dropout, o.mlp, o.mlp_bias)

    def forward(self, x: Tensor, positions: Tensor, scheme: PositionScheme, backend: str,
                extension: Extension | None = None, consecutive: bool | None = None) -> Tensor:
        """consecutive: whether positions are 0..T-1 plus an offset (attention.attend)."""
        attn = self.attn(self.norm1(x), positions, scheme, backend, extension, consecutive)
        if self.parallel_residual:  # both branches read the block's input (GPT-NeoX)
            return x + attn + self.mlp(self.norm2(x))
        x = x + attn
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
        block: BlockOptions | None = None,
        embed_norm: bool = False,
        tie_embeddings: bool = True,
        method: EvalMethod | None = None,
    ):
        """method: how positions are used at evaluation (relpos_cli/extension.EvalMethod), part of
        the model it is built with; None: as trained."""
        super().__init__()
        if attn_backend not in BACKEND_NAMES:
            raise RelposError(f"unknown model.attn_backend {attn_backend!r}; choose one of: {', '.join(BACKEND_NAMES)}")
        block = block or BlockOptions(mlp_hidden=mlp_ratio * shape.d_model, dropout=dropout)
        self.shape = shape
        self.attn_backend = attn_backend
        self.tok_emb = nn.Embedding(vocab_size, shape.d_model)
        self.emb_norm = make_norm(block.norm, shape.d_model, block.norm_eps) if embed_norm else None
        self.method = method or EvalMethod()
        self.scheme = build_scheme(pos_cfg, shape, self.method.rope_scaling)
        check_sliding_window(self.scheme, block.sliding_window)
        check_backend(attn_backend, scheme=self.scheme)
        check_method(self.method, self.scheme, block.sliding_window)
        self.sliding_window = block.sliding_window
        self.blocks = nn.ModuleList(Block(i, shape.d_model, shape.n_heads, block) for i in range(shape.n_layers))
        self.norm = make_norm(block.norm, shape.d_model, block.norm_eps)
        self.lm_head = nn.Linear(shape.d_model, vocab_size, bias=False)
        if tie_embeddings:
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
        for module in self.modules():
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)  # linear biases (family options) start at 0, as GPT-2's

    def default_positions(self, length: int, device: torch.device) -> Tensor:
        """0..length-1, the same tensor on every call for a length: attention's bias cache is keyed
        by the positions tensor itself. Compiled (train.compile), a tensor of the graph: the cache
        filled on the first call would fail that call's guards and compile the loss a second time."""
        if torch.compiler.is_compiling():
            return torch.arange(length, device=device)
        cached = self._positions
        if cached is None or cached.shape[0] != length or cached.device != device:
            cached = self._positions = torch.arange(length, device=device)
        return cached

    def hidden(self, tokens: Tensor, positions: Tensor | None = None) -> Tensor:
        """tokens (B, T) -> the final normed hidden states (B, T, D) that the output head reads."""
        consecutive = positions is None  # the default 0..T-1; given positions may be anything increasing
        if positions is None:
            positions = self.default_positions(tokens.shape[1], tokens.device)
        x = self.tok_emb(tokens)  # (B, T, D)
        if self.emb_norm is not None:
            x = self.emb_norm(x)
        # compiled, no per-pass state is kept (FIRE's reads would break the graph, as would the generator
        # behind a scheme's context manager)
        with contextlib.nullcontext() if torch.compiler.is_compiling() else self.scheme.forward_pass(positions):
            x = self.scheme.embed(x, positions)
            for block in self.blocks:
                x = block(x, positions, self.scheme, self.attn_backend, self.method.extension, consecutive or None)
        return self.norm(x)

    def forward(self, tokens: Tensor, at: Tensor | None = None, positions: Tensor | None = None) -> Tensor:
        """tokens (B, T) -> logits (B, T, V); with `at` ((B, T) bool) only the logits where it is
        true, (N, V): scoring a few answer tokens of long examples never holds (B, T, V) logits.
        positions (T,): increasing indices shared by the batch (train.randomized_positions);
        default 0..T-1."""
        x = self.hidden(tokens, positions)
        return self.lm_head(x if at is None else x[at])

    def loss(self, tokens: Tensor, targets: Tensor, reduction: str = "mean", positions: Tensor | None = None) -> Tensor:
        """Cross-entropy in nats; reduction="none" keeps the (B, T) shape."""
        logits = self(tokens, positions=positions)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction=reduction)
        return loss.view_as(targets) if reduction == "none" else loss

    def token_losses(self, tokens: Tensor, targets: Tensor, chunk_bytes: int = LOSS_CHUNK_BYTES) -> Tensor:
        """Cross-entropy per token (B, T) in nats, the logits made a chunk of rows at a time: never
        (B, T, V) at once (32k tokens of a 49k vocabulary are 6.4 GB of fp32 logits). Evaluation's
        path; training keeps `loss`, whose single matmul its numbers were measured with."""
        x = self.hidden(tokens).flatten(0, 1)  # (B*T, D)
        flat_targets = targets.flatten()
        rows = max(1, chunk_bytes // (4 * self.lm_head.out_features))
        losses = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
        for start in range(0, x.shape[0], rows):
            logits = self.lm_head(x[start : start + rows]).float()  # (rows, V)
            losses[start : start + rows] = F.cross_entropy(logits, flat_targets[start : start + rows], reduction="none")
        return losses.view_as(targets)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def model_shape(model_cfg: Mapping[str, Any], train_cfg: Mapping[str, Any]) -> ModelShape:
    """What a scheme knows of the model it is built for, from a run's model and train settings."""
    return ModelShape(model_cfg["d_model"], model_cfg["n_heads"], model_cfg["n_layers"], train_cfg["seq_len"],
                      train_cfg.get("position_skip") or train_cfg.get("randomized_positions"))


def build_model(cfg: Mapping[str, Any], vocab_size: int, method: EvalMethod | None = None) -> Transformer:
    """Model from a composed run config (model, pos, train.seq_len). model.vocab_size, when set,
    is the embedding's size (a pretrained model's, which may exceed its tokenizer's vocabulary).
    method: how a trained model uses positions at evaluation (extension.eval_method); None: as trained."""
    m = {**model_option_defaults(), **cfg["model"]}
    if m["d_model"] % m["n_heads"]:
        raise RelposError(f"model.d_model={m['d_model']} is not divisible by model.n_heads={m['n_heads']}")
    if m["vocab_size"] is not None and vocab_size > m["vocab_size"]:
        raise RelposError(f"the tokenizer has {vocab_size} tokens but model.vocab_size={m['vocab_size']}: "
                          f"its vocabulary does not fit the embedding")
    shape = model_shape(m, cfg["train"])
    block = BlockOptions(
        mlp_hidden=m["mlp_hidden"] or m.get("mlp_ratio", 4) * m["d_model"], dropout=m.get("dropout", 0.0),
        **{k: m[k] for k in ("n_kv_heads", "mlp", "norm", "norm_eps", "attn_bias", "proj_bias", "mlp_bias",
                             "parallel_residual", "sliding_window")},
        sliding_layers=None if m["sliding_layers"] is None else tuple(m["sliding_layers"]),
    )
    return Transformer(
        m["vocab_size"] or vocab_size,
        shape,
        cfg["pos"],
        attn_backend=m.get("attn_backend", "auto"),
        block=block,
        embed_norm=m["embed_norm"],
        tie_embeddings=m["tie_embeddings"],
        method=method,
    )
