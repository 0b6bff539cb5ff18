"""How a fused kernel's forward and backward become one differentiable call, two ways: eagerly through a
torch.autograd.Function, and inside torch.compile (train.compile) through a torch.library custom op,
which the compiled graph keeps as one opaque node whose fake gives its outputs' shapes, with the
backward a second op that autograd reaches through register_autograd.

Why the op: torch.compile would otherwise trace the Function and its host code, launching Triton
kernels from inside the graph, which is untested on a GPU and impossible under Triton's interpreter
(dynamo traced into the interpreter's numpy code and died); an op is never traced into, so a compiled
model runs the same kernels as an eager one, and CPU tests can compile it. Why not the op eagerly too:
a custom op's dispatch costs about twice a Function's on the host (16 against 8 us a call on this
project's CPU), per layer and step, and tests/kernel_compile_probe.py runs the host code on meta
tensors, which an op would hand to its fake instead.

Reference: PyTorch's "Python Custom Operators" tutorial (torch.library.custom_op, register_fake,
register_autograd), https://pytorch.org/tutorials/advanced/python_custom_ops.html.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from relpos_cli.kernels._launch import Tiles, kernel_layout, token_major


def fused_function(name: str, forward: Callable, forward_fake: Callable, backward: Callable,
                   tensors: int) -> Callable[..., Tensor]:
    """The call (*inputs) -> out of a kernel pair, differentiable in its first `tensors` inputs.

    Args:
        name: the ops' name, relpos::<name> and relpos::<name>_backward (one registration per process).
        forward: (*inputs) -> (out, *state); inputs are `tensors` tensors, q, k, v (B, H, T, Dh) first
            as _launch.kernel_layout leaves them (the call makes them so), the others contiguous as the
            caller makes them, then options (ints, None, bools); annotated, torch.library reads its
            schema off the annotations. out: laid out as _launch.token_major's. The state (a
            log-sum-exp, ...) is what the backward needs besides the inputs.
        forward_fake: (*inputs) -> empty tensors shaped and laid out as forward's outputs (no kernel runs).
        backward: (*inputs, *outputs, grad, needs) -> a gradient per tensor input, in its dtype (q, k,
            v's laid out as _launch.token_major's, the others as their input), or an empty tensor where
            `needs` (a bool per tensor input) says none is wanted; annotated. grad: the output's, its
            last stride 1 (the kernels read it through its strides).
        tensors: how many of the inputs are tensors (the rest are options, given no gradient).
    """
    op = torch.library.custom_op(f"relpos::{name}", forward, mutates_args=())
    op.register_fake(forward_fake)
    backward_op = torch.library.custom_op(f"relpos::{name}_backward", backward, mutates_args=())

    @backward_op.register_fake
    def _(*args):
        needs = args[-1]
        return [t.new_empty(0) if not need else token_major(t.shape, t.dtype, t.device) if i < 3 else torch.empty_like(t)
                for i, (t, need) in enumerate(zip(args[:tensors], needs))]

    def gradients(run_backward: Callable, ctx, grad: Tensor) -> tuple:
        saved = ctx.saved_tensors
        needs = list(ctx.needs_input_grad[:tensors])
        grad = grad if grad.stride(-1) == 1 else grad.contiguous()
        grads = run_backward(*saved[:tensors], *ctx.options, *saved[tensors:], grad, needs)
        return (*(g if need else None for g, need in zip(grads, needs)), *(None for _ in ctx.options))

    def save(ctx, inputs: tuple, output: tuple) -> None:
        ctx.save_for_backward(*inputs[:tensors], *output)
        ctx.options = inputs[tensors:]

    def setup_context(ctx, inputs: tuple, output: tuple) -> None:
        save(ctx, inputs, output)
        ctx.mark_non_differentiable(*output[1:])

    op.register_autograd(lambda ctx, grad, *state_grads: gradients(backward_op, ctx, grad), setup_context=setup_context)

    class Eager(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            output = forward(*inputs)
            save(ctx, inputs, output)
            return output[0]

        @staticmethod
        def backward(ctx, grad: Tensor):
            return gradients(backward, ctx, grad)

    Eager.__name__ = Eager.__qualname__ = f"{name}_function"

    def call(*inputs) -> Tensor:
        inputs = (*kernel_layout(*inputs[:3]), *inputs[3:])
        if torch.compiler.is_compiling():
            return op(*inputs)[0]
        return Eager.apply(*inputs)

    return call


def softmax_outputs(q: Tensor, *inputs) -> tuple[Tensor, Tensor]:
    """What a softmax kernel's forward writes, allocated: out shaped as q (_launch.token_major), and each
    query's log-sum-exp (B, H, Tq) in float32 for its backward; as it reads no other input, also the
    forward op's fake."""
    return token_major(q.shape, q.dtype, q.device), q.new_empty(q.shape[:3], dtype=torch.float32)


def split_backward_outputs(q: Tensor, k: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """What FlashAttention-2's split backward writes (a query-tile program for dq, then a key-tile program
    for dk and dv), allocated -> delta, each query's dO . O (B, H, Tq) float32, which the dq program
    stores for the other; dq laid out as the output (the dq program reads the output with dq's strides);
    dk and dv per query head (B, H, Tk, Dh), in k's dtype, or in float32 under grouped-query attention
    where _launch.input_gradient sums them over a group."""
    B, H, Tq, Dh = q.shape
    Hk, Tk = k.shape[1], k.shape[2]
    delta = torch.empty((B, H, Tq), dtype=torch.float32, device=q.device)
    dq = token_major(q.shape, q.dtype, q.device)
    dk = token_major((B, H, Tk, Dh), k.dtype if Hk == H else torch.float32, q.device)
    return delta, dq, dk, token_major(dk.shape, dk.dtype, q.device)


def key_tile_states(q: Tensor, k: Tensor, rows: Tiles, keys: Tiles) -> tuple[Tiles, Tensor, Tensor]:
    """For a split backward whose query-tile program (tiles `rows`) stores two float32 values per row at the
    end of each of the key-tile program's key tiles (`keys`; _tiles.key_tile_state: stick-breaking's,
    CoPE's) -> the query-tile program's tiles on the key-tile program's BLOCK_N, which the state's grain
    makes one, and the two state tensors, allocated (B, H, cdiv(Tk, BLOCK_N), Tq). The entries of the rows
    whose query sees a key tile are written before the key-tile program reads them; the others, left
    unwritten where the query tiles are smaller than the key-tile program's, are read under the causal
    mask, or by the check that skips a chunk of query tiles when none of its rows is below a bound, which
    such a value can only turn to a full walk (tl.min passes over NaN)."""
    B, H, Tq, _ = q.shape
    key_tiles = (k.shape[2] + keys.block_n - 1) // keys.block_n
    state = torch.empty((2, B, H, key_tiles, Tq), dtype=torch.float32, device=q.device)
    return rows._replace(block_n=keys.block_n), state[0], state[1]
