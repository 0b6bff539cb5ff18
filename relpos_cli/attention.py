"""Attention kernels. Which one runs depends on what the scheme needs and the device, never on its name.

Backends (``model.attn_backend``):

- ``sdpa``: fused causal SDPA when the scheme adds no score bias; otherwise SDPA with an additive
  (causal-masked) bias, cached per (q_len, k_len, device, dtype) while it cannot change (a
  distance or index-pair bias with no gradient being recorded, or no trainable parameter).
- ``flex``: FlexAttention with a causal ``block_mask`` and a ``score_mod`` computing the scheme's
  ``score_formula`` where it gives one for the call (ALiBi always; FIRE without
  gradients), else, for a bias declared a function of the distance i - j only, reading the
  scheme's (H, T) distance table: no L x L tensor. Compiled, cached per shape. A token-difference
  bias D_i - D_j (FoX) is a ``score_mod`` reading the (B, H, T) values without gradients; with
  gradients flex runs it as ``chunked``. Other index-pair and content biases (Shaw, CoPE; FIRE
  with gradients) have no such form: flex runs them as ``chunked``. torch 2.13 has no CPU
  backward for flex, so on CPU it only runs without gradients.
- ``chunked``: query blocks, each against the keys up to its last query. A distance bias is read
  in place from its (H, T) table as a strided view (no bias tensor, nothing compiled); a content
  bias with a far bias (Shaw, CoPE) is built only near the diagonal when no gradient is recorded
  on CPU; a token-difference bias is one row of key values per block (a query's own D_i shifts its
  whole row, which softmax ignores), broadcast over the block's queries; other biases are built per
  block, (block x L): memory-linear.
- ``eager``: explicit logits + mask + softmax; the reference every other backend is tested against.
- ``fused``: the fused Triton kernel the scheme's declaration calls for (relpos_cli/kernels): a
  table of the distance (ALiBi, T5, KERPLE, Sandwich; FIRE up to its threshold), a token-difference
  bias under softmax (FoX), stick-breaking's weights (``weight_rule``), Shaw's clipped distances,
  CoPE's gate count or DAPE's MLP over the heads (``content_rule``), forward and backward, on CUDA;
  a call the kernel cannot serve (positions that are not consecutive, FIRE past its threshold,
  DAPE's training in fp32 on CUDA, bf16 under Triton's interpreter) runs as auto would. Tested
  against eager under Triton's interpreter on CPU (float32) and on an H100 (docs/results/gpu.md).
- ``auto`` (default): fused SDPA without bias. On CUDA, the fused kernel where one H100 measured
  it faster (fused_is_faster: training, but for ALiBi's formula; without gradients, past SDPA's
  dense lengths, the schemes flex cannot serve). Otherwise SDPA + bias while training on CPU; without
  gradients, chunked for a distance bias, a token-difference bias or a content bias with a far
  bias on CPU at every length (the fastest there, compile included: see resolve_backend), and elsewhere SDPA + bias at
  short lengths, flex for a distance table, a score formula or token differences on CUDA, chunked
  for other biases at long lengths; flex for training on CUDA when the bias is a distance table.

What a scheme's bias depends on is its declaration (``PositionScheme.bias_input``, and
``has_far_bias`` for a content bias), never a property inferred from the numbers it returns.
A scheme whose weights are not a softmax (``normalises = False``: stick-breaking) gets them as
exp(logits + bias) on every backend: whole (eager, sdpa) or one block of queries at a time
(chunked, flex, auto at long lengths), since SDPA and flex kernels normalise by construction.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from relpos_cli import kernels
from relpos_cli.compile_cache import use_relpos_compile_cache
from relpos_cli.errors import RelposError
from relpos_cli.extension import Extension
from relpos_cli.positions.base import BiasInput, PositionScheme, records_gradient

BACKEND_NAMES = ("auto", "sdpa", "flex", "chunked", "eager", "fused")
DENSE_BYTES = 64 * 2**20  # auto: no-grad attention whose dense (B, H, Tq, Tk) fp32 logits would exceed
# this runs in query blocks instead (flex / chunked)
BLOCK_BYTES = 16 * 2**20  # chunked: one (B, H, block, Tk) fp32 bias block at most this big. Each block
# builds a few such tensors (the bias, its causal copy, the scheme's intermediates): 16 MiB kept a
# 16384-token FIRE evaluation at 1.2-1.4x NoPE's peak RSS where 64 MiB gave 2.0x (README, Speed)
DISTANCE_BLOCK = 512  # chunked with a distance table: queries per SDPA call (no bias tensor, so no memory
# bound); blocks skip the keys after them, so the masked half costs ~1/(2 x blocks) of the work
NEAR_BYTES = 4 * 2**20  # windowed: one block's near bias at most this big. A content bias builds several
# tensors that size (CoPE: gates, their counts, two lookups): 16 MiB took a 16384-token CoPE evaluation
# to 1.50x NoPE's peak RSS, 4 MiB to 1.12x (README, Speed)
# SDPA's CPU flash kernel, which also returns each query's log-sum-exp (B, H, Tq) (SDPA drops it),
# recording no gradient for it: what merges attention over two sets of keys, without gradients
_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def causal_additive_mask(bias: Tensor) -> Tensor:
    """bias (..., Tq, Tk) -> same with -inf where the key lies after the query.

    Queries are taken to be the last Tq of the Tk positions (Tq == Tk in training)."""
    tq, tk = bias.shape[-2:]
    future = torch.ones(tq, tk, dtype=torch.bool, device=bias.device).triu(tk - tq + 1)
    return bias.masked_fill(future, float("-inf"))


def sdpa_mask(bias: Tensor, dtype: torch.dtype) -> Tensor:
    """A bias broadcastable to (B, H, Tq, Tk) -> SDPA's causal attn_mask, always 4-D: given a 3-D
    (H, Tq, Tk) mask, CPU SDPA (torch 2.13) leaves its fused flash kernel for the unfused math path
    (2.7x the time forward + backward at B 16, H 8, T 256; scripts/bench.py, README "Speed"). A new
    tensor, not a view of one: torch.compile (2.13, CPU) corrupted memory when the cached mask was a
    reshape view (train.compile with ALiBi: a segfault saving the compiled backward, or garbage shapes)."""
    return causal_additive_mask(bias[None] if bias.dim() == 3 else bias).to(dtype)


def eager_attention(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, normalise: bool = True) -> Tensor:
    """Reference path. q (B, H, Tq, Dh), the last Tq of the keys k, v (B, H, Tk, Dh); bias
    broadcastable to (B, H, Tq, Tk) or None. normalise=False: weights exp(logits), no softmax."""
    logits = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])  # (B, H, Tq, Tk)
    if bias is not None:
        logits = logits + bias
    logits = causal_additive_mask(logits)
    return (torch.softmax(logits, dim=-1) if normalise else torch.exp(logits)) @ v


# ---- FlexAttention: compiled once, block masks cached per shape -----------------------------------
_flex_state: dict = {}


def flex_available() -> bool:
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:  # torch < 2.5
        return False
    return True


def _compiled_flex() -> Callable:
    if "fn" not in _flex_state:
        from torch.nn.attention.flex_attention import flex_attention

        use_relpos_compile_cache()
        _flex_state["fn"] = torch.compile(flex_attention, dynamic=False)
    return _flex_state["fn"]


def _recompile_limit() -> contextlib.AbstractContextManager:
    """One compiled flex kernel per (shape, score_mod code); eager flex would materialise the scores,
    so a flex call may compile more shapes than dynamo's default of 8 before it falls back to eager.
    Patched around relpos's own calls only: the host process's dynamo settings stay its own."""
    return torch._dynamo.config.patch(recompile_limit=max(torch._dynamo.config.recompile_limit, 64))


def causal_block_mask(q_len: int, k_len: int, device: torch.device, block: int = 128, *, near: int = 0,
                      far: int | None = None, offset: int | None = None):
    """BlockMask of the pairs whose distance d = q_idx + offset - kv_idx lies in [near, far) (far None:
    no bound), built from the block grid. offset is the position of the first query, keys being at
    0..k_len-1: by default k_len - q_len, the queries the last q_len of the k_len positions. The
    defaults give causal attention; eval-time extensions take a window's band [0, W) and the pairs
    past it, [W, None) (_flex_near_and_far).

    create_block_mask would evaluate the mask at every (q, k) pair: a q_len x k_len tensor (GBs at
    16k) that would defeat memory-linear evaluation. Here only (q_len/block) x (k_len/block)."""
    from torch.nn.attention.flex_attention import BlockMask

    offset = k_len - q_len if offset is None else offset
    q_first = torch.arange(0, q_len, block, device=device)  # first query of each q block
    q_last = (q_first + block - 1).clamp(max=q_len - 1)
    k_first = torch.arange(0, k_len, block, device=device)
    k_last = (k_first + block - 1).clamp(max=k_len - 1)
    whole = ((q_last - q_first + 1) == block)[:, None] & ((k_last - k_first + 1) == block)[None, :]
    nearest = q_first[:, None] + offset - k_last[None, :]  # (q blocks, k blocks): each block's least distance
    farthest = q_last[:, None] + offset - k_first[None, :]  # and its greatest
    # full: every pair in the band; ragged edge blocks stay partial so the mask_mod runs there
    full = (nearest >= near) & whole
    seen = farthest >= near
    if far is not None:
        full &= farthest < far
        seen &= nearest < far
    partial = seen & ~full

    def as_blocks(mask: Tensor) -> tuple[Tensor, Tensor]:
        count = mask.sum(-1).to(torch.int32)[None, None]  # (1, 1, q blocks)
        order = torch.argsort((~mask).to(torch.int8), dim=-1, stable=True).to(torch.int32)[None, None]
        return count, order  # order: the visible kv blocks first, ascending

    def in_band(b, h, q_idx, kv_idx):
        distance = q_idx + offset - kv_idx
        return distance >= near if far is None else (distance >= near) & (distance < far)

    return BlockMask.from_kv_blocks(
        *as_blocks(partial), *as_blocks(full), BLOCK_SIZE=block, mask_mod=in_band, seq_lengths=(q_len, k_len)
    )


def _cached_block_mask(q_len: int, k_len: int, device: torch.device, near: int = 0, far: int | None = None,
                       offset: int | None = None):
    """causal_block_mask, built once per shape and band: every layer of a model reads the same one."""
    key = (q_len, k_len, str(device), near, far, offset)
    masks = _flex_state.setdefault("masks", {})
    if key not in masks:
        masks[key] = causal_block_mask(q_len, k_len, device, near=near, far=far, offset=offset)
    return masks[key]


def _lse_request() -> dict:
    """flex_attention's keyword asking for the log-sum-exp: return_aux where torch has AuxRequest
    (return_lse then warns as deprecated), return_lse before it."""
    try:
        from torch.nn.attention.flex_attention import AuxRequest
    except ImportError:
        return {"return_lse": True}
    return {"return_aux": AuxRequest(lse=True)}


def _run_flex(q: Tensor, k: Tensor, v: Tensor, score_mod: Callable | None, block_mask, lse: bool = False):
    """FlexAttention q (B, H, Tq, Dh) against k, v (B, H, Tk, Dh) under block_mask: traced into the
    graph inside torch.compile (train.compile, no graph break), else the kernel compiled per shape.
    lse=True -> (output, log-sum-exp (B, H, Tq), natural log: flex converts its kernel's base 2)."""
    kwargs = {"score_mod": score_mod, "block_mask": block_mask, "kernel_options": flex_kernel_options(q),
              **(_lse_request() if lse else {})}
    if torch.compiler.is_compiling():
        from torch.nn.attention.flex_attention import flex_attention as traced_flex

        out = traced_flex(q, k, v, **kwargs)
    else:
        with _recompile_limit():
            out = _compiled_flex()(q, k, v, **kwargs)
    if not lse:
        return out
    y, aux = out
    return y, aux if isinstance(aux, Tensor) else aux.lse


def flex_attention(q: Tensor, k: Tensor, v: Tensor, score_mod: Callable | None) -> Tensor:
    if q.device.type == "cpu" and records_gradient(q):
        raise RelposError("model.attn_backend=flex cannot train on CPU (torch has no CPU backward for it); use auto or sdpa")
    return _run_flex(q, k, v, score_mod, _cached_block_mask(q.shape[-2], k.shape[-2], q.device))


def flex_kernel_options(q: Tensor) -> dict | None:
    """Triton tile settings for flex on CUDA. Under bf16 autocast, torch 2.11's default tiles for a
    head size of 64 (three pipeline stages) ask for 240 KiB of shared memory, past an H100's 227 KiB,
    and the kernel fails to compile. Two stages fit and cost nothing measurable (H100, d_model 768,
    12 heads, seq 1024, fwd+bwd: bf16 8.5 ms/step; fp32 36.4 ms against 36.7 ms with the defaults)."""
    return {"num_stages": 2} if q.is_cuda else None


def chunked_attention(
    q: Tensor, k: Tensor, v: Tensor, bias_block: Callable[[int, int], Tensor], block: int | None = None,
    normalise: bool = True,
) -> Tensor:
    """Causal attention one block of queries at a time: peak memory block x Tk instead of Tq x Tk.

    bias_block(start, stop) -> bias for query rows [start, stop) against keys [0, stop),
    broadcastable to (B, H, stop - start, stop): later keys are masked for every query of the block.
    normalise=False: weights exp(logits + bias) as they are (PositionScheme.normalises)."""
    B, H, T, _ = q.shape
    block = block or max(1, BLOCK_BYTES // (4 * B * H * T))
    out = []
    for start in range(0, T, block):
        stop = min(T, start + block)
        bias = bias_block(start, stop)
        bias = bias.expand(*bias.shape[:-2], stop - start, stop)
        queries = q[:, :, start:stop]
        if not normalise:
            out.append(eager_attention(queries, k[:, :, :stop], v[:, :, :stop], bias, normalise=False))
        elif start and not q.is_cuda and not records_gradient(queries, k, v, bias):
            out.append(_earlier_keys_then_own(queries, k[:, :, :stop], v[:, :, :stop], bias, start))
        else:
            out.append(F.scaled_dot_product_attention(queries, k[:, :, :stop], v[:, :, :stop], attn_mask=sdpa_mask(bias, q.dtype)))
    return torch.cat(out, dim=2)  # (B, H, T, Dh)


def _earlier_keys_then_own(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, start: int) -> Tensor:
    """One block of queries [start, stop) against keys [0, stop), on CPU without gradients, in two
    parts: keys [0, start) precede every query of the block, so their bias goes to the kernel as it
    is, a view; only the block's own keys [start, stop) need the causal mask, a (block x block) copy.
    Masking the whole (block x stop) bias cost a copy of it per block: 4 s of a FIRE layer's 26 at
    L = 16384 (README, Speed)."""
    B, H = q.shape[:2]
    bias = bias.expand(B, H, *bias.shape[-2:])  # the flash kernel takes a 4-D mask (strided views included)
    return _near_and_far_keys(q, k, v, start, sdpa_mask(bias[..., start:], q.dtype), bias[..., :start].to(q.dtype))


def _near_and_far_keys(q: Tensor, k: Tensor, v: Tensor, split: int, near_mask: Tensor,
                       far_mask: Tensor | None = None, far_shift: Tensor | None = None) -> Tensor:
    """Queries q (B, H, Tq, Dh), the last Tq of the keys, attend with the CPU flash kernel to keys
    [split, Tk) under near_mask (causal) and to keys [0, split), which every query sees, under
    far_mask (or none) with each query's logits shifted by far_shift (B, H, Tq) (or not). The two
    partial softmaxes merge by their log-sum-exps, each weighted by its share of the whole."""
    y, lse = _FLASH_CPU(q, k[:, :, split:], v[:, :, split:], attn_mask=near_mask)  # (B, H, Tq, Dh), (B, H, Tq)
    if split == 0:
        return y
    y_far, lse_far = _FLASH_CPU(q, k[:, :, :split], v[:, :, :split], attn_mask=far_mask)
    if far_shift is not None:
        lse_far = lse_far + far_shift
    return _merge_by_lse(y, lse, y_far, lse_far)


def _merge_by_lse(y: Tensor, lse: Tensor, y_other: Tensor, lse_other: Tensor) -> Tensor:
    """Attention over two disjoint sets of keys -> attention over both: each partial output
    (B, H, Tq, Dh) weighted by its share of the whole softmax, from the log-sum-exps (B, H, Tq)."""
    return torch.lerp(y, y_other, torch.sigmoid(lse_other - lse)[..., None].to(y.dtype))


def _attend_with_lse(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor | None, bias: Tensor | None) -> tuple[Tensor, Tensor]:
    """q (B, H, Tq, Dh) against k, v (B, H, Tk, Dh), pairs outside `allowed` (Tq, Tk) dropped and
    `bias` (broadcastable to (B, H, Tq, Tk)) added -> (output, log-sum-exp (B, H, Tq)); a query with
    no allowed key gets output 0 and log-sum-exp -inf, so it weighs nothing in _merge_by_lse."""
    B, H, Tq, _ = q.shape
    mask = None
    if allowed is not None or bias is not None:
        mask = q.new_zeros(()) if bias is None else bias.to(q.dtype)
        if allowed is not None:
            mask = torch.where(allowed, mask, float("-inf"))
        mask = mask.expand(B, H, Tq, k.shape[-2])
    if not q.is_cuda and not records_gradient(q, k, v, *([] if mask is None else [mask])):
        y, lse = _FLASH_CPU(q, k, v, attn_mask=mask)
    else:  # explicit (Tq x Tk) logits: a block of queries at a time, so memory-linear still
        logits = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        logits = logits if mask is None else logits + mask
        lse = torch.logsumexp(logits, dim=-1)
        y = (torch.softmax(logits, dim=-1).nan_to_num(0.0)) @ v
    if allowed is not None:  # the CPU kernel reports 0, not -inf, for a query whose keys are all masked
        lse = lse.masked_fill(~allowed.any(-1), float("-inf"))
    return y, lse


def extended_attention(ext: Extension, scheme: PositionScheme, layer: int, q: Tensor, k: Tensor, v: Tensor,
                       positions: Tensor) -> Tensor:
    """Causal attention under an eval-time extension `ext` (relpos_cli/extension.py), q, k, v
    (B, H, T, Dh) not yet rotated, positions (T,) consecutive.

    Pairs at distance d = i - j below the extension's window (near) see q and k at their positions;
    pairs further apart (far), with every key or only the first `sinks`, see them at the
    extension's far positions (rotate_apart, score_bias at those positions): two score sets merged
    per key by the window. One block of queries [s, e) at a time against three key ranges, whose
    partial softmaxes merge by log-sum-exp: near keys [s - W + 1, e) under a (block x (block + W))
    mask; keys [0, s - W + 1), far from every query of the block, with no mask; the band
    [s - W + 1, e - W + 1) between, under a (block x block) mask. No (T x T) tensor; a bias scheme's
    bias is built per range, at most (block x T). On CUDA a scheme with no bias runs as two
    FlexAttention passes instead (extension_runs_flex, _flex_near_and_far)."""
    B, H, T, _ = q.shape
    offsets = positions - positions[0]
    if int(offsets[-1]) != T - 1:
        raise RelposError("eval-time extension methods need consecutive positions 0..L-1 (not randomized ones)")
    window = ext.window
    n_far = T if ext.sinks is None else min(ext.sinks, T)
    far_q_pos, far_k_pos = ext.far_positions(positions)
    far_k_pos = far_k_pos[:n_far]
    q_near, k_near = scheme.rotate(layer, q, k, positions) if scheme.uses_rotation else (q, k)
    q_far, k_far = q, k[:, :, :n_far]
    if scheme.uses_rotation and n_far and T > window:
        q_far, k_far = scheme.rotate_apart(layer, q_far, k_far, far_q_pos, far_k_pos)
    if extension_runs_flex(scheme, q, k, v):
        return _flex_near_and_far(q_near, k_near, q_far, k_far, v, window)
    with_bias = scheme.uses_score_bias
    block = DISTANCE_BLOCK
    # a block's biases span at most block + window + far keys (the sinks: a bias scheme has no other far keys)
    while with_bias and block > 1 and 4 * B * H * block * (block + window + n_far) > BLOCK_BYTES:
        block //= 2

    def part(queries: Tensor, keys: Tensor, s: int, e: int, lo: int, hi: int, q_pos: Tensor, k_pos: Tensor,
             allowed: Tensor | None) -> tuple[Tensor, Tensor]:
        bias = scheme.score_bias(layer, queries[:, :, s:e], keys[:, :, lo:hi], q_pos[s:e], k_pos[lo:hi]) if with_bias else None
        return _attend_with_lse(queries[:, :, s:e], keys[:, :, lo:hi], v[:, :, lo:hi], allowed, bias)

    out = []
    for s in range(0, T, block):
        e = min(T, s + block)
        lo = max(0, s - window + 1)  # keys before lo are far from every query of the block
        distance = offsets[s:e, None] - offsets[None, lo:e]  # (block, e - lo)
        y, lse = part(q_near, k_near, s, e, lo, e, positions, positions, (distance >= 0) & (distance < window))
        hi = min(n_far, max(0, e - window))  # far keys: [0, hi); [0, min(lo, hi)) far from every query
        far_ranges = [(0, min(lo, hi), None)]
        if hi > lo:
            far_ranges.append((lo, hi, distance[:, : hi - lo] >= window))
        for start, stop, allowed in far_ranges:
            if stop > start:
                y_far, lse_far = part(q_far, k_far, s, e, start, stop, far_q_pos, far_k_pos, allowed)
                y, lse = _merge_by_lse(y, lse, y_far, lse_far), torch.logaddexp(lse, lse_far)
        out.append(y)
    return torch.cat(out, dim=2)  # (B, H, T, Dh)


# Devices on which extended_attention runs a scheme with no score bias as two FlexAttention passes.
# CUDA: SDPA returns no log-sum-exp there, so the block path computes explicit (block x Tk) logits in
# eager PyTorch; on one H100 (bf16, SmolLM2-135M, 50 examples at each of 4k..32k) eval-task took
# ~22 s for plain RoPE and was cut off at 150 s, unfinished, for Self-Extend, ReRoPE and a sink window.
# Not CPU: compiled flex returns no log-sum-exp there (torch 2.13), and the CPU flash kernel, which
# does, serves the block path.
FLEX_EXTENSION_DEVICES = ("cuda",)


FLEX_MIN_HEAD_DIM = 16  # torch/_inductor/kernel/flex: "NYI: embedding dimension ... must be at least 16"


def extension_runs_flex(scheme: PositionScheme, q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether extended_attention runs as two FlexAttention passes (_flex_near_and_far): on a
    FLEX_EXTENSION_DEVICES device, for a scheme with no score bias (q and k at two sets of positions
    are all each part needs; a bias at the far positions would need a score_mod per part, so the sink
    windows of bias schemes keep the block path) and without gradients (the methods are eval-time;
    a call that records one keeps the block path, whose backward is autograd's through plain ops), at
    a head size flex compiles for on CUDA (torch's inductor lowering refuses one below 16)."""
    return (q.device.type in FLEX_EXTENSION_DEVICES and not scheme.uses_score_bias and flex_available()
            and q.shape[-1] >= FLEX_MIN_HEAD_DIM and not records_gradient(q, k, v, *scheme.parameters()))


def _flex_near_and_far(q_near: Tensor, k_near: Tensor, q_far: Tensor, k_far: Tensor, v: Tensor, window: int) -> Tensor:
    """Attention under an eval-time extension as two FlexAttention passes, merged by their
    log-sum-exps; no (T x T) tensor, no eager logits. q_near, k_near, v, q_far (B, H, T, Dh): q and k
    at their positions and q at the far positions; k_far (B, H, n_far, Dh): the keys any far pair
    can take (all T, or the sinks), at the far positions.

    Near pairs 0 <= i - j < W: a band of the block grid. Far pairs i - j >= W with j < n_far: only
    queries [W, T) have one, each at least key 0, so no query of that pass is left with no key (and
    no -inf log-sum-exp to merge). At T = 32768 in 128-token blocks, W = 4096 (Self-Extend, ReRoPE):
    7,920 + 25,200 blocks, 1.01x one causal pass's 32,896; 4 sinks + W = 8188: 14,560 + 224, 0.45x."""
    T, n_far = q_near.shape[-2], k_far.shape[-2]
    near = _cached_block_mask(T, T, q_near.device, far=window)
    if T <= window or n_far == 0:  # no far pair
        return _run_flex(q_near, k_near, v, None, near)
    y, lse = _run_flex(q_near, k_near, v, None, near, lse=True)  # (B, H, T, Dh), (B, H, T)
    far = _cached_block_mask(T - window, n_far, q_near.device, near=window, offset=window)
    y_far, lse_far = _run_flex(q_far[:, :, window:], k_far, v[:, :, :n_far], None, far, lse=True)  # (B, H, T - W, ...)
    merged = _merge_by_lse(y[:, :, window:], lse[:, :, window:], y_far, lse_far)
    return torch.cat([y[:, :, :window], merged], dim=2)  # (B, H, T, Dh)


def sliding_window_attention(q: Tensor, k: Tensor, v: Tensor, window: int,
                             bias_block: Callable[[int, int, int], Tensor] | None = None) -> Tensor:
    """Causal attention in which query i sees only the keys j with i - j < window: Mistral's and
    Qwen2's sliding attention (transformers masking_utils.sliding_window_overlay: kv_idx > q_idx -
    window). q, k, v (B, H, T, Dh); one block of queries [s, e) at a time against its keys [s - window
    + 1, e), so time and memory grow as T x (block + window), gradients included. bias_block(s, e, lo)
    -> the scheme's bias for queries [s, e) and keys [lo, e), or None for no bias."""
    B, H, T, _ = q.shape
    block = DISTANCE_BLOCK
    while block > 1 and 4 * B * H * block * (block + window) > BLOCK_BYTES:
        block //= 2
    out = []
    for s in range(0, T, block):
        e = min(T, s + block)
        lo = max(0, s - window + 1)  # keys before lo are out of every query's window
        distance = torch.arange(s, e, device=q.device)[:, None] - torch.arange(lo, e, device=q.device)[None, :]
        mask = torch.zeros(distance.shape, dtype=q.dtype, device=q.device)
        mask = mask.masked_fill((distance < 0) | (distance >= window), float("-inf"))  # (e - s, e - lo)
        if bias_block is not None:
            mask = (bias_block(s, e, lo) + mask).to(q.dtype)
        mask = mask.expand(B, H, *mask.shape[-2:])  # a 4-D mask keeps CPU SDPA on its fused kernel (sdpa_mask)
        out.append(F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, lo:e], v[:, :, lo:e], attn_mask=mask))
    return torch.cat(out, dim=2)  # (B, H, T, Dh)


def distance_table_attention(q: Tensor, k: Tensor, v: Tensor, table: Tensor, block: int | None = None) -> Tensor:
    """Causal attention adding table[h, i - j] (table (H, T) over distances 0..T-1), one block of
    queries at a time, with no bias tensor built: memory-linear, nothing to compile.

    The bias is Toeplitz in (i, j). With the keys in reverse order (j' = T-1-j; attention does not
    depend on the order of its keys) it is a Hankel matrix, bias[i, j'] = ext[h, i + j' + 1] with
    ext = [-inf x T | table]: a strided view of ext (strides 1, 1) that SDPA reads in place, the
    -inf half masking the future keys. q, k, v: (B, H, T, Dh), queries and keys at the same positions."""
    B, H, T, _ = q.shape
    block = block or DISTANCE_BLOCK
    ext = torch.cat([table.new_full((H, T), float("-inf")), table], dim=1).to(q.dtype)  # (H, 2T)
    k, v = k.flip(2), v.flip(2)  # key j at index T-1-j
    out = []
    for start in range(0, T, block):
        stop = min(T, start + block)
        # queries [start, stop) see keys [0, stop), reversed: indices [T - stop, T)
        bias = ext.as_strided((1, H, stop - start, stop), (0, ext.stride(0), 1, 1), ext.storage_offset() + start + T - stop + 1)
        keys = slice(T - stop, T)
        out.append(F.scaled_dot_product_attention(q[:, :, start:stop], k[:, :, keys], v[:, :, keys], attn_mask=bias))
    return torch.cat(out, dim=2)  # (B, H, T, Dh)


def windowed_content_attention(
    q: Tensor, k: Tensor, v: Tensor, near_bias: Callable[[int, int, int], Tensor], far_keys: Callable[[int, int], int],
    far_bias: Callable[[int, int], Tensor], block: int | None = None, normalise: bool = True,
) -> Tensor:
    """Causal attention with a content bias that depends on the query alone on keys far from it
    (PositionScheme.has_far_bias), one block of queries [s, e) at a time, on CPU without gradients.

    Keys [0, n) add the same far value c_i to each query of the block, so the CPU flash kernel
    attends to them with no mask and c_i shifts that part's log-sum-exp. Keys [n, e) get their bias
    as a (block x (e - n)) tensor; a block whose near bias would exceed NEAR_BYTES is split in two.
    The two partial softmaxes merge by their log-sum-exps, so no (block x L) tensor is built
    unless the far keys start at the first one. far_keys(s, e) -> n; near_bias(s, e, n) -> bias of
    queries [s, e) against keys [n, e), broadcastable to (B, H, e - s, e - n); far_bias(s, e) -> c
    of queries [s, e), (B, H, e - s). normalise=False (stick-breaking): the near keys' weights are
    exp(logits + bias) as they are, and far keys are left out, their far bias being -inf."""
    B, H, T, _ = q.shape

    def attend_block(start: int, stop: int) -> list[Tensor]:
        near = far_keys(start, stop)
        if stop - start > 1 and 4 * B * H * (stop - start) * (stop - near) > NEAR_BYTES:  # the near bias, fp32
            middle = (start + stop) // 2
            return attend_block(start, middle) + attend_block(middle, stop)
        if not normalise:
            return [eager_attention(q[:, :, start:stop], k[:, :, near:stop], v[:, :, near:stop], near_bias(start, stop, near),
                                    normalise=False)]
        mask = sdpa_mask(near_bias(start, stop, near).expand(B, H, stop - start, stop - near), q.dtype)
        far_shift = far_bias(start, stop) if near else None
        return [_near_and_far_keys(q[:, :, start:stop], k[:, :, :stop], v[:, :, :stop], near, mask, far_shift=far_shift)]

    block = block or DISTANCE_BLOCK
    out = [y for start in range(0, T, block) for y in attend_block(start, min(T, start + block))]
    return torch.cat(out, dim=2)  # (B, H, T, Dh)


# ---- choosing and running a backend ---------------------------------------------------------------
def check_sliding_window(scheme: PositionScheme, window: int | None) -> None:
    """RelposError (one line) unless the scheme's attention can run in a sliding window: softmax
    over the window's keys with a bias of each pair alone, its positions or its own q and k (Shaw,
    DAPE: content_bias_per_pair). A bias that reads the keys between a pair (CoPE's gates, FoX's
    cumulative forgets) would lose the ones the window drops, and stick-breaking is no softmax; no
    pretrained family pairs a window with either."""
    if window is None:
        return
    if not scheme.normalises or not scheme.bias_per_pair:
        why = ("replaces softmax" if not scheme.normalises
               else f"has a bias that reads the keys between a query and its key ({scheme.bias_input.value})")
        raise RelposError(f"model.sliding_window runs softmax attention over each query's window with a bias of each "
                          f"(query, key) pair alone; pos={scheme.name} {why}")


def has_distance_table(scheme: PositionScheme) -> bool:
    return scheme.bias_input is BiasInput.DISTANCE


def has_score_mod(scheme: PositionScheme) -> bool:
    """A bias flex reads from a small tensor: a distance table or per-token values."""
    return scheme.bias_input in (BiasInput.DISTANCE, BiasInput.TOKEN_DIFFERENCE)


CONTENT_KERNELS = {"gate_count": "cope_attention", "head_mlp": "dape_attention", "clipped_distance": "shaw_attention"}


def fused_kernel(scheme: PositionScheme) -> str | None:
    """The fused Triton kernel (relpos_cli/kernels) the scheme's declaration calls for: a bias of
    the distance, computed per score where it is linear in it with fixed slopes (linear_distance_slopes)
    and read from a table otherwise (or an index-pair bias that can be one, pair_bias_as_distances), a token-difference
    bias under softmax (FoX), stick-breaking's weights, or a content bias whose rule has a kernel
    (CONTENT_KERNELS); None for the others."""
    if scheme.normalises and has_distance_table(scheme) and scheme.overrides("linear_distance_slopes"):
        return "linear_distance_attention"
    if scheme.normalises and (has_distance_table(scheme) or scheme.overrides("pair_bias_as_distances")):
        return "distance_attention"
    if scheme.bias_input is BiasInput.TOKEN_DIFFERENCE and scheme.normalises:
        return "forgetting_attention"
    if scheme.weight_rule == "stick_breaking":
        return "stickbreaking_attention"
    return CONTENT_KERNELS.get(scheme.content_rule)


def check_backend(backend: str, device: torch.device | None = None, scheme: PositionScheme | None = None) -> None:
    """RelposError (one line) for a backend that cannot run the scheme (when given) or on the device
    (when given), checked before a command writes anything: fused runs the Triton kernel the
    scheme's declaration calls for (a scheme with no score bias runs SDPA), on CUDA (or under
    TRITON_INTERPRET=1)."""
    if backend != "fused":
        return
    if scheme is not None and scheme.uses_score_bias and fused_kernel(scheme) is None:
        raise RelposError(f"model.attn_backend=fused has no fused kernel for pos={scheme.name}: there are kernels for a "
                          f"bias of the distance (and fire's), a token-difference bias (fox), stick-breaking weights, "
                          f"Shaw's and CoPE's biases and DAPE over a distance base (pos.base=alibi, kerple_log, ...); "
                          f"use auto")
    if device is not None and not kernels.available(device.type == "cuda"):
        raise RelposError("model.attn_backend=fused runs Triton kernels on CUDA (or under TRITON_INTERPRET=1 with "
                          "triton installed); use auto")


def fused_attention(scheme: PositionScheme, layer: int, q: Tensor, k: Tensor, v: Tensor, positions: Tensor,
                    layer_input: Tensor | None, consecutive: bool | None) -> Tensor | None:
    """model.attn_backend=fused: the scheme's fused Triton kernel, on CUDA (or under Triton's
    interpreter). q, k, v (B, H, T, Dh) -> (B, H, T, Dh); gradients flow through the kernel.
    An index-pair bias that is no table of distances for this call (FIRE past its threshold) runs,
    without gradients, on the kernel that computes it per score from the scheme's
    normalised_log_distance_grid. None where no kernel can serve the call, which then runs as auto
    would: the kernels read distances off indices, so a scheme that reads positions needs
    consecutive ones (not train.randomized_positions or PoSE), FIRE past its threshold trains
    elsewhere, DAPE's tiles must fit a GPU's shared memory, and Triton's interpreter computes no bf16
    tiles (eval.precision=bf16 on CPU; kernels.serves)."""
    check_backend("fused", q.device, scheme)
    name = fused_kernel(scheme)
    if scheme.reads_positions and not consecutive:
        return None
    needs_grad = records_gradient(q, *scheme.parameters())
    if not kernels.serves(name, q, needs_grad):
        return None
    call = fused_call(scheme, name, layer, q, positions, layer_input, needs_grad)
    if call is None:
        return None
    kernel, inputs = call
    return getattr(kernels, kernel)(q, k, v, *inputs)


def fused_call(scheme: PositionScheme, name: str, layer: int, q: Tensor, positions: Tensor,
               layer_input: Tensor | None, needs_grad: bool) -> tuple[str, tuple] | None:
    """(kernel, what it takes after q, k, v) for this layer's call: kernel `name` (fused_kernel's) with
    fused_inputs'; where an index-pair bias is no table of distances for the call (FIRE past its
    threshold) and no gradient is wanted, fire_attention with the scheme's normalised_log_distance_grid
    and the positions; None where neither serves."""
    inputs = fused_inputs(scheme, name, layer, q, positions, layer_input)
    if inputs is not None:
        return name, inputs
    if not needs_grad and scheme.overrides("normalised_log_distance_grid"):
        grid = scheme.normalised_log_distance_grid(layer)
        if grid is not None:
            return "fire_attention", (*grid, positions)
    return None


def fused_inputs(scheme: PositionScheme, name: str, layer: int, q: Tensor, positions: Tensor,
                 layer_input: Tensor | None) -> tuple | None:
    """What kernel `name` (fused_kernel's) takes after q, k, v for this layer: the (H, T) table of
    distances (up to where the bias stops changing, distance_bias_flat_from: T5's max_distance),
    FoX's (B, H, T) cumulative log forget gates, stick-breaking's attend_current, or the scheme's
    kernel_inputs; None where the index-pair bias is no table of distances (FIRE past L)."""
    if name == "distance_attention":
        if has_distance_table(scheme):
            flat_from = scheme.distance_bias_flat_from()
            length = positions.shape[0]  # consecutive (fused_attention): distances 0..T-1
            table = scheme.pass_distance_table(layer, length if flat_from is None else min(flat_from + 1, length),
                                               positions.device)
        else:
            table = scheme.pair_bias_as_distances(layer, positions)  # (H, T) or None
        # float32 whatever autocast made of it (FIRE's MLP gives bf16 under bf16 autocast): the kernel adds it in float32
        return None if table is None else (table.float(),)
    if name == "linear_distance_attention":
        return (scheme.linear_distance_slopes(layer).float(),)  # float32 in a model cast to 16 bits too
    if name == "forgetting_attention":
        return (scheme.token_values(layer, layer_input),)
    if name == "stickbreaking_attention":
        return (scheme.attends_to_itself,)
    return scheme.kernel_inputs(layer, q)


def fused_is_faster(scheme: PositionScheme, q: Tensor, training: bool) -> bool:
    """Whether auto runs the scheme's fused kernel for this CUDA call. Measured on one H100 (docs/results/gpu.md:
    the 125M bench model in bf16 autocast, training at 1024 tokens, evaluating one 16k window): the kernel
    wherever it serves the call, except where flex computes the bias per score as fast or faster: a score
    formula that trains (ALiBi: the kernel, reading a table, trained at 0.97x flex's rate and evaluated in 1.7x
    its time; linear_distance_attention, which computes ALiBi's bias per score instead, is untimed), and
    without gradients a score formula, token differences read in place in float32 (FoX: in bf16 the kernel took
    1.06x flex's time at 43ed42b) or a distance table in float32 (T5, KERPLE: 1.07-1.11x flex's time at 16k,
    commit 43ed42b; FIRE's long windows pass its threshold, where its own kernel, fire_attention, serves
    untimed). Training through a table with a gradient (T5, KERPLE: 1.7-2.0x flex's rate; FoX 1.6x SDPA's
    with its dense bias), evaluating a distance table in 16 bits (43ed42b: T5 in 0.50x flex's time at 16k and 0.37x at 64k, its far key tiles
    reading one entry; KERPLE 0.85x and 0.82x), FoX's token differences in 16 bits (one H200, 0b1c743, bf16:
    0.96x flex's time at 16k and 0.95x at 64k, and a first call of 1.7 s against flex's 3.3 s; in float32
    unmeasured) and the schemes flex cannot serve (stick-breaking, CoPE, DAPE, Shaw: 1.7-8.8x the rate of auto's
    old choices in training, an evaluation 3 to over 650x shorter) go to the kernel."""
    name = fused_kernel(scheme)
    if name is None or not kernels.available(True) or not kernels.serves(name, q, training):
        return False
    if torch.compiler.is_compiling() and name == "distance_attention" and not has_distance_table(scheme):
        # an index-pair bias is a table of distances only up to a threshold (FIRE's): asking reads the device,
        # a graph break per layer in a compiled model
        return False
    if training:
        return scheme.score_formula(0) is None  # (FIRE gives none while training)
    if q.dtype in (torch.bfloat16, torch.float16):
        if has_distance_table(scheme):
            return not scheme.has_score_formula  # ALiBi's formula: flex, as above
        if scheme.bias_input is BiasInput.TOKEN_DIFFERENCE:
            return True  # FoX, since its kernel's unmasked walks (H200, 0b1c743)
    return not (has_score_mod(scheme) or scheme.has_score_formula)


def resolve_backend(requested: str, scheme: PositionScheme, q: Tensor, fused: bool = True) -> str:
    """The backend that runs for this call: `requested` unless it is auto. fused=False: not the
    fused kernel (the call it was asked for cannot take it)."""
    if requested != "auto":
        return requested
    if not scheme.uses_score_bias:
        return "sdpa"
    B, H, T, _ = q.shape
    dense_fits = 4 * B * H * T * T <= DENSE_BYTES  # SDPA with a mask materialises these logits
    # inside torch.compile (train.compile) a kernel is one opaque op of the graph (kernels/_ops.py), the same
    # kernel as eagerly: the same choice
    if (fused and q.is_cuda and (records_gradient(q) or not dense_fits)
            and fused_is_faster(scheme, q, records_gradient(q))):
        return "fused"
    # a score formula of an index-pair bias (FIRE) counts on CUDA only: on CPU, chunked beats a compile per length
    flex_fits = (has_score_mod(scheme) or (scheme.has_score_formula and q.is_cuda)) and flex_available()
    if records_gradient(q):  # flex trains a distance table only (see token_difference_score_mod)
        return "flex" if q.is_cuda and has_distance_table(scheme) and flex_fits else "sdpa"
    if (has_score_mod(scheme) or scheme.has_far_bias) and not q.is_cuda:
        # no-grad on CPU, measured (README, Speed): SDPA reading the distance table
        # in place beats SDPA + a cached dense bias at every length (256: 3x) and compiled flex at 16k
        # (flex: 1.6x the time per call, plus ~20 s compiling each new length; 11 s from the disk cache);
        # a bias built only near the diagonal keeps even the training length's batch of windows small
        return "chunked"
    if dense_fits:
        return "sdpa"
    return "flex" if flex_fits else "chunked"


def distance_score_mod(table: Tensor, offsets: Tensor | None = None) -> Callable:
    """FlexAttention score_mod adding table[h, q_idx - kv_idx], table (H, T) over distances 0..T-1;
    with `offsets` (T,) (positions - positions[0], not consecutive) table[h, offsets[q] - offsets[kv]].

    The lookup is a captured tensor indexed by (h, computed index): Inductor's pointwise lowering
    of score_mods gets that right (evaluating a formula per element and then picking the head
    miscompiles gathers in torch 2.13, checked against eager)."""

    def distance_mod(score, b, h, q_idx, kv_idx):
        # masked (future) pairs have negative distances: clamp keeps the lookup in bounds
        return score + table[h, (q_idx - kv_idx).clamp(min=0)]

    def offset_distance_mod(score, b, h, q_idx, kv_idx):
        return score + table[h, (offsets[q_idx] - offsets[kv_idx]).clamp(min=0)]

    return distance_mod if offsets is None else offset_distance_mod


def formula_score_mod(formula: Callable[[Tensor, Tensor, Tensor], Tensor], positions: Tensor) -> Callable:
    """FlexAttention score_mod adding a scheme's score_formula(head, i, j) at the query's and the
    key's positions, positions (T,) read per score (a gather from one vector): the bias is computed,
    not read from a table."""

    def formula_mod(score, b, h, q_idx, kv_idx):
        return score + formula(h, positions[q_idx], positions[kv_idx])

    return formula_mod


def token_difference_score_mod(values: Tensor) -> Callable:
    """FlexAttention score_mod adding values[b, h, q] - values[b, h, kv], values (B, H, T). Forward
    only: flex's backward cannot lower two lookups into one tensor that needs gradients (torch 2.11,
    CUDA: "multiple indexing operations on the same tensor"; neither a clone nor a detached copy of
    the queries' values got past it), so a token-difference bias trains on the chunked path.

    The values (FoX's float64 cumulative log gates, thousands deep in a long window, where float32
    keeps ~1e-3) reach the kernel as two float32 tensors, high and low parts: the high parts of two
    near tokens are close, so their float32 difference is exact (Sterbenz), and the low parts carry
    the rest, so D_i - D_j keeps float64's precision where the weights are."""
    high = values.float()
    low = (values - high.to(values.dtype)).float()  # zeros for float32 values

    def token_difference_mod(score, b, h, q_idx, kv_idx):
        return score + ((high[b, h, q_idx] - high[b, h, kv_idx]) + (low[b, h, q_idx] - low[b, h, kv_idx]))

    return token_difference_mod


def key_values_bias(values: Tensor, start: int, stop: int, dtype: torch.dtype) -> Tensor:
    """A token-difference bias for queries [start, stop) against keys [0, stop), values (B, H, T), in
    `dtype`. In float32 (or wider): D_start - D_j for every query of the block, (B, H, 1, stop), a
    broadcast row; query i's true bias D_i - D_j differs by D_i - D_start, the same for all of its
    keys, which softmax ignores. In a 16-bit dtype that row loses the near keys: D_start - D_i
    reaches hundreds deep in a block, where bf16 steps by 2-4, so each query gets its own D_i - D_j,
    (B, H, stop - start, stop), small where its weights are (the block's copy SDPA's mask makes anyway)."""
    if dtype.itemsize >= 4:
        return (values[..., start, None] - values[..., :stop])[:, :, None].to(dtype)
    return (values[..., start:stop, None] - values[..., None, :stop]).to(dtype)


class BiasCache:
    """Causal-masked additive bias per (q_len, k_len, device, dtype) for one layer.

    Only biases declared a function of positions alone (distance or index pair) are cached, and
    only while they cannot change: either no gradient is being recorded or the scheme has no
    trainable parameter. The stamp (identity + in-place version counter of every scheme tensor)
    invalidates the entry when a parameter or buffer is updated. The entry holds the positions
    tensor it was built for and is used only for that very tensor (the model passes one tensor per
    length for 0..T-1), so positions drawn anew (train.randomized_positions) rebuild it."""

    def __init__(self) -> None:
        self.entries: dict = {}

    @staticmethod
    def _stamp(scheme: PositionScheme) -> tuple:
        return tuple((id(t), t._version) for t in (*scheme.parameters(), *scheme.buffers()))

    def get(self, scheme: PositionScheme, layer: int, q: Tensor, k: Tensor, positions: Tensor,
            layer_input: Tensor | None = None) -> Tensor:
        def build() -> Tensor:
            return sdpa_mask(scheme.score_bias(layer, q, k, positions, layer_input=layer_input), q.dtype)

        # compiled (train.compile), the bias is part of the graph: an entry written on the first call would fail
        # its guards and compile the graph again; positions made under torch.inference_mode have no version
        # counter to stamp an entry with
        if (torch.compiler.is_compiling() or scheme.bias_input.reads_input or records_gradient(*scheme.parameters())
                or positions.is_inference()):
            return build()
        key = (q.shape[-2], k.shape[-2], q.device, q.dtype)
        stamp = (self._stamp(scheme), positions._version)
        hit = self.entries.get(key)
        if hit is None or hit[0] != stamp or hit[1] is not positions:
            self.entries = {key: (stamp, positions, build())}  # one length at a time: old lengths are freed
        return self.entries[key][2]


def attend(
    backend: str, scheme: PositionScheme, layer: int, q: Tensor, k: Tensor, v: Tensor, positions: Tensor,
    cache: BiasCache, layer_input: Tensor | None = None, window: int | None = None, extension: Extension | None = None,
    consecutive: bool | None = None,
) -> Tensor:
    """Causal attention with the scheme's score bias. q, k, v: (B, H, T, Dh) -> (B, H, T, Dh).

    Args:
        backend: model.attn_backend (resolve_backend picks one for auto).
        positions: (T,) increasing: consecutive (arange + offset) except under train.randomized_positions or PoSE.
        cache: the layer's BiasCache (SDPA with a dense bias).
        layer_input: (B, T, D), what the attention layer projected q, k, v from (a token-difference bias reads it).
        window: the layer's sliding attention window (a query sees the keys at distance < window; None =
            every earlier key), run by sliding_window_attention whatever the backend once the length
            exceeds it; check_sliding_window says which schemes it takes.
        extension: the eval-time method the model was built with (relpos_cli/extension.EvalMethod);
            under it q and k come unrotated and the extension's own path runs, whatever the backend.
        consecutive: whether positions are 0..T-1 plus an offset, as the model knows (its default
            positions); None reads it off the tensor, a device sync (and a graph break under torch.compile).
    """
    if window is not None and q.shape[-2] > window:
        bias_block = (lambda s, e, lo: scheme.score_bias(layer, q[:, :, s:e], k[:, :, lo:e], positions[s:e], positions[lo:e])) \
            if scheme.uses_score_bias else None
        return sliding_window_attention(q, k, v, window, bias_block)
    if extension is not None:
        return extended_attention(extension, scheme, layer, q, k, v, positions)
    backend = resolve_backend(backend, scheme, q)
    if not scheme.uses_score_bias:
        return unbiased_attention(backend, q, k, v)
    if backend == "fused":
        if consecutive is None and scheme.reads_positions:
            consecutive = are_consecutive(positions)
        out = fused_attention(scheme, layer, q, k, v, positions, layer_input, consecutive)
        if out is not None:
            return out
        backend = resolve_backend("auto", scheme, q, fused=False)
    if backend == "eager":
        return eager_attention(q, k, v, scheme.score_bias(layer, q, k, positions, layer_input=layer_input), scheme.normalises)
    if backend == "sdpa" and scheme.normalises:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=cache.get(scheme, layer, q, k, positions, layer_input))
    if scheme.bias_input is BiasInput.TOKEN_DIFFERENCE:  # flex, chunked
        return token_difference_attention(backend, scheme.token_values(layer, layer_input), q, k, v)
    if backend == "flex" and scheme.normalises and (formula := scheme.score_formula(layer)) is not None:
        return flex_attention(q, k, v, formula_score_mod(formula, positions))
    if has_distance_table(scheme) and backend in ("flex", "chunked") and scheme.normalises:
        if consecutive is None:
            consecutive = are_consecutive(positions)
        if backend == "flex" or consecutive:
            return distance_bias_attention(backend, scheme, layer, q, k, v, positions, consecutive)
    return query_block_attention(backend, scheme, layer, q, k, v, positions)


def are_consecutive(positions: Tensor) -> bool:
    """Whether positions (T,) are 0..T-1 plus an offset (a device sync)."""
    return int(positions[-1] - positions[0]) + 1 == positions.shape[0]


def unbiased_attention(backend: str, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Causal attention with no score bias, on `backend` (resolved): fused SDPA unless asked otherwise."""
    if backend == "eager":
        return eager_attention(q, k, v, None)
    if backend == "chunked":
        return chunked_attention(q, k, v, lambda s, e: q.new_zeros(1, 1, e - s, e))
    if backend == "flex":
        return flex_attention(q, k, v, None)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def token_difference_attention(backend: str, values: Tensor, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """A bias D_i - D_j of per-token values (B, H, T) (FoX): flex's score_mod without gradients, else
    query blocks with no bias tensor but the block's own (block x block) causal part."""
    if backend == "flex" and not records_gradient(q, values):
        return flex_attention(q, k, v, token_difference_score_mod(values))
    return chunked_attention(q, k, v, lambda s, e: key_values_bias(values, s, e, q.dtype), block=DISTANCE_BLOCK)


def distance_bias_attention(backend: str, scheme: PositionScheme, layer: int, q: Tensor, k: Tensor, v: Tensor,
                            positions: Tensor, consecutive: bool) -> Tensor:
    """A bias of the distance i - j alone, read from the scheme's (H, T) table: a flex score_mod, or
    (chunked, consecutive positions) a Toeplitz bias read in place by SDPA. Positions that are not
    consecutive (randomized training positions) index the table through their offsets (flex only)."""
    if consecutive:  # the distances are 0..T-1
        table = scheme.pass_distance_table(layer, positions.shape[0], positions.device)  # (H, T)
        return flex_attention(q, k, v, distance_score_mod(table)) if backend == "flex" else distance_table_attention(q, k, v, table)
    offsets = positions - positions[0]
    table = scheme.pass_distance_table(layer, int(offsets[-1]) + 1, positions.device)  # (H, span)
    return flex_attention(q, k, v, distance_score_mod(table, offsets))


def query_block_attention(backend: str, scheme: PositionScheme, layer: int, q: Tensor, k: Tensor, v: Tensor,
                          positions: Tensor) -> Tensor:
    """Any other bias, one block of queries at a time (memory-linear): weights that are no softmax
    (stick-breaking) whole under sdpa, a content bias with a far bias near the diagonal only (CPU,
    no gradients), everything else built per (block x T)."""
    def rows(s: int, e: int) -> Tensor:  # the bias of queries [s, e) against keys [0, e)
        return scheme.score_bias(layer, q[:, :, s:e], k[:, :, :e], positions[s:e], positions[:e])

    far_free = scheme.has_far_bias and not q.is_cuda and not records_gradient(q, *scheme.parameters())
    if not scheme.normalises and (backend == "sdpa" or not far_free):  # whole (sdpa) or per query block
        return chunked_attention(q, k, v, rows, block=q.shape[-2] if backend == "sdpa" else None, normalise=False)
    if far_free:
        return windowed_content_attention(
            q, k, v,
            lambda s, e, n: scheme.score_bias(layer, q[:, :, s:e], k[:, :, n:e], positions[s:e], positions[n:e]),
            lambda s, e: scheme.far_keys(layer, q[:, :, s:e], k[:, :, :e], positions[s:e], positions[:e]),
            lambda s, e: scheme.far_bias(layer, q[:, :, s:e], positions[s:e]),
            normalise=scheme.normalises,
        )
    return chunked_attention(q, k, v, rows)
