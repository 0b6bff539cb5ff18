"""FIRE (Li et al. 2023, "Functional Interpolation for Relative Positions Improves Long Context
Transformers").

logits[h, i, j] += f_h(psi(i - j) / psi(max(L, i))), psi(x) = log(c x + 1), f a small MLP
(1 -> width -> H, ReLU), c and the threshold L learnable (L = |multiplier * init_L|, the
multiplier learned, as in the paper's appendix code, which is the reference implementation here).
The normaliser psi(max(L, i)) makes the input lie in [0, 1] at any length, which is what lets FIRE
extrapolate; it also depends on the query's absolute index, so FIRE is not shift invariant:
it declares an index-pair bias, not a distance one.
Each layer has its own FIRE (one per attention layer, as in the paper's code).

For the GPU kernels: queries at or below L share the normaliser psi(L), so among them the bias is a
table of the distance (``pair_bias_as_distances``, which the fused distance kernel runs: training
at lengths up to L, every layer's table computed at once in a training pass); past L, FlexAttention
or the fused kernel of its own (relpos_cli/kernels/fire.py, evaluation only) computes psi per score and
reads the MLP off a fine grid, within a bound stated and tested (``score_formula``,
``normalised_log_distance_grid``, ``FireLayer.formula_error_bound``).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor, nn

from relpos_cli.errors import RelposError
from relpos_cli.positions import register
from relpos_cli.positions.base import BiasInput, ModelShape, PositionScheme, check_above, records_gradient

FORMULA_GRID = 8192  # cells of score_formula's interpolation grid over [0, 1]: the MLP at default init is
# then within ~4e-5 of the grid (formula_error_bound), and a head's table is 32 KiB


class FireLayer(nn.Module):
    def __init__(self, n_heads: int, width: int, init_c: float, init_threshold: float, eps: float = 1e-6):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(1, width), nn.ReLU(), nn.Linear(width, n_heads))
        self.c = nn.Parameter(torch.tensor(float(init_c)))
        self.register_buffer("init_threshold", torch.tensor(float(init_threshold)))
        self.threshold_multiplier = nn.Parameter(torch.tensor(1.0))
        self.eps = eps

    def threshold(self) -> Tensor:
        """L, the query index up to which the normaliser is psi(L): a scalar tensor."""
        return (self.threshold_multiplier * self.init_threshold).abs()

    def forward(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """Elementwise in the index pair: q_pos (Tq, 1), k_pos (1, Tk) -> (H, Tq, Tk)."""
        normaliser = torch.maximum(q_pos.to(torch.float32), self.threshold())  # (Tq, 1)
        psi_normaliser = self.psi(normaliser) + self.eps
        if records_gradient(*self.parameters()):
            normalised = self.psi((q_pos - k_pos).to(torch.float32)) / psi_normaliser  # (Tq, Tk), in [0, 1] for causal pairs
            return self.mlp(normalised[..., None]).movedim(-1, 0)  # (H, Tq, Tk)
        return self.piecewise_linear(self.psi_of_distances(q_pos, k_pos).div_(psi_normaliser))  # a fresh tensor

    def score_formula(self) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
        """The bias at (head, i, j) from psi computed per score and the MLP read off a grid of
        FORMULA_GRID + 1 points over [0, 1] (the range of the normalised input), linearly
        interpolated: two gathers from an (H, FORMULA_GRID + 1) table instead of the hidden layer.
        The MLP is piecewise linear, so the interpolation is exact in every grid cell without a
        knot and within formula_error_bound() of the MLP in the others."""
        threshold, psi, eps, cells = self.threshold(), self.psi, self.eps, FORMULA_GRID
        grid = self.formula_grid()

        def fire(head: Tensor, i: Tensor, j: Tensor) -> Tensor:
            distance = (i - j).clamp(min=0).to(torch.float32)  # future pairs are masked: any value in range
            x = psi(distance) / (psi(torch.maximum(i.to(torch.float32), threshold)) + eps)
            at = x * cells
            cell = at.floor().clamp(0, cells - 1)
            below = grid[head, cell.to(torch.int64)]
            above = grid[head, cell.to(torch.int64) + 1]
            return below + (at - cell) * (above - below)

        return fire

    def formula_grid(self) -> Tensor:
        """The MLP at FORMULA_GRID + 1 evenly spaced points of [0, 1], (H, FORMULA_GRID + 1) float32
        (under autocast too): what score_formula and the fused kernel past the threshold interpolate."""
        points = torch.linspace(0, 1, FORMULA_GRID + 1, device=self.c.device)[:, None]
        return self.mlp(points).T.float().contiguous()

    def formula_constants(self) -> Tensor:
        """(|c|, L, eps), (3,) float32, left on the device for a kernel to read: the numbers of psi(i - j) /
        (psi(max(i, L)) + eps) besides the positions (psi(x) = log(|c| x + 1) for x >= 0)."""
        eps = torch.full((), self.eps, dtype=torch.float32, device=self.c.device)  # a fill, no copy from the host
        return torch.stack([self.c.abs().float(), self.threshold().float(), eps])

    def formula_error_bound(self) -> Tensor:
        """(H,): how far score_formula may be from the MLP. In a grid cell of width h the linear
        interpolant of a piecewise-linear function errs by at most h / 4 times the sum of the
        changes of slope at its knots (each knot's error is a hat of height |change| t (1 - t) h);
        hidden unit w changes head h's slope by |w2[h, w] w1[w]|, so the sum over all units bounds
        every cell."""
        first, last = self.mlp[0], self.mlp[2]
        return (last.weight * first.weight[:, 0]).abs().sum(1) / (4 * FORMULA_GRID)

    def psi(self, x: Tensor) -> Tensor:
        return torch.log((self.c * x).abs() + 1)

    def psi_of_distances(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """psi(i - j) for q_pos (Tq, 1), k_pos (1, Tk) -> (Tq, Tk). Evaluation's query blocks have
        consecutive positions, so the matrix is Toeplitz: psi of its Tq + Tk - 1 distances, in
        decreasing order, seen as Tq overlapping windows of Tk (the rows, last query first). Six
        passes over (Tq, Tk) (difference, cast, scale, abs, add, log) become one copy, the same
        numbers: at L = 16384 a block of 32 queries took 0.3 ms instead of 3.4-4.3 (README, Speed)."""
        if not (_consecutive(q_pos) and _consecutive(k_pos)):
            return self.psi((q_pos - k_pos).to(torch.float32))
        n_queries, n_keys = q_pos.shape[0], k_pos.shape[1]
        first_query, first_key = int(q_pos[0, 0]), int(k_pos[0, 0])
        farthest = first_query + n_queries - 1 - first_key  # the last query's distance to the first key
        distances = torch.arange(farthest, farthest - n_queries - n_keys + 1, -1, dtype=torch.float32, device=q_pos.device)
        return self.psi(distances).unfold(0, n_keys, 1).flip(0)

    def piecewise_linear(self, x: Tensor) -> Tensor:
        """The MLP at every x (Tq, Tk) -> (H, Tq, Tk), without its (Tq, Tk, width) hidden layer.

        With a scalar input, W2 relu(w1 x + b1) + b2 is piecewise linear in x, with a knot where each
        hidden unit switches on (x = -b1/w1): between knots it is slope * x + intercept, per head.
        At L = 16384 the hidden layer is what made FIRE's evaluation slow and large (width 32: 32
        floats per pair). A key whose x lies in one piece for every query of the block (most keys:
        x changes slowly with the query far from the diagonal, and only a few knots fall inside
        [0, 1]) takes that piece's slope and intercept as scalars per head; the others find their
        piece per entry (a search among the knots and two gathers). For a block of 32 queries at
        L = 16384 of a trained FIRE, 7.4 ms instead of 16 with every key per entry (README, Speed)."""
        knots, slope, intercept = self.linear_pieces()
        if x.dim() != 2:  # scalar pairs (torch.vmap)
            return _pieces_at(x, knots, slope, intercept)
        out = x.new_empty(slope.shape[0], *x.shape)  # (H, Tq, Tk)
        for start, stop, piece in key_runs(x, knots):
            keys = slice(start, stop)
            if piece is None:
                _pieces_at(x[:, keys], knots, slope, intercept, out=out[:, :, keys])
            else:
                torch.addcmul(intercept[:, piece, None, None], slope[:, piece, None, None], x[:, keys], out=out[:, :, keys])
        return out

    def linear_pieces(self) -> tuple[Tensor, Tensor, Tensor]:
        """The MLP's finite knots, sorted (K,), and each piece's slope and intercept, (H, K + 1):
        piece p lies between knots p - 1 and p."""
        first, last = self.mlp[0], self.mlp[2]
        w1, b1 = first.weight[:, 0], first.bias  # (width,)
        knots = torch.where(w1 != 0, -b1 / w1, torch.full_like(b1, float("inf"))).sort().values  # (width,)
        finite = knots[knots.isfinite()]
        # one point inside each piece: below the first knot, between neighbours, above the last
        inside = torch.cat([finite[:1] - 1, (finite[1:] + finite[:-1]) / 2, finite[-1:] + 1]) if finite.numel() \
            else torch.zeros(1, device=w1.device)
        active = ((w1 * inside[:, None] + b1) > 0).to(w1.dtype)  # (pieces, width)
        slope = last.weight @ (active * w1).T  # (H, pieces)
        intercept = last.weight @ (active * b1).T + last.bias[:, None]  # (H, pieces)
        return finite, slope.contiguous(), intercept.contiguous()


def _consecutive(positions: Tensor) -> bool:
    return positions.dim() == 2 and bool((positions.reshape(-1).diff() == 1).all())


def _pieces_at(x: Tensor, knots: Tensor, slope: Tensor, intercept: Tensor, out: Tensor | None = None) -> Tensor:
    """slope * x + intercept of each entry's own piece: x (...) -> (H, ...). At a knot the MLP is
    continuous, so either neighbouring piece gives its value. The gathers are index_select on the
    flat pieces from contiguous (H, pieces) tables: indexing a transposed table took 4x as long
    for a (32 x 16384) block (README, Speed)."""
    piece = torch.searchsorted(knots, x.contiguous()).view(-1)
    per_head = lambda table: table.index_select(1, piece).view(-1, *x.shape)  # noqa: E731
    return torch.addcmul(per_head(intercept), per_head(slope), x, out=out)


def key_runs(x: Tensor, knots: Tensor) -> list[tuple[int, int, int | None]]:
    """Runs [start, stop) of keys (columns of x (Tq, Tk)) whose entries all lie in one piece, with
    that piece, and the runs in between with None. A column's entries share a piece when its
    smallest and largest do, since the search is monotone. x grows with the distance along a row
    and with the query down a column, so there are about two runs per knot; columns that are not
    monotone (other positions) could make thousands, and are left to the per-entry path whole."""
    low, high = x.amin(0), x.amax(0)  # aminmax(x, dim=0) took 14x as long for a (32 x 16384) block
    piece = torch.searchsorted(knots, low)
    piece = torch.where(piece == torch.searchsorted(knots, high), piece, -1)  # (Tk,), -1: mixed
    edges = ((piece[1:] != piece[:-1]).nonzero().squeeze(1) + 1).tolist()
    if len(edges) > 4 * (knots.numel() + 1):
        return [(0, x.shape[1], None)]
    starts, stops = [0, *edges], [*edges, x.shape[1]]
    return [(a, b, p if p >= 0 else None) for a, b, p in zip(starts, stops, piece[starts].tolist())]


@register("fire")
class FIRE(PositionScheme):
    paper = "Li et al. 2023 (FIRE)"
    relative = False  # the normaliser psi(max(L, i)) sees the query's absolute index
    bias_input = BiasInput.INDEX_PAIR
    decayed_parameters = ("layers.*.mlp.*.weight",)
    decay_reference = ("the paper's code listing gives no optimizer: its MLP's weight matrices decay like "
                       "the model's other linear weights, c, the threshold and the biases do not")

    def __init__(self, shape: ModelShape, mlp_width: int = 32, init_c: float = 0.1, init_threshold: float | None = None):
        super().__init__(shape)
        if isinstance(mlp_width, bool) or not isinstance(mlp_width, int) or mlp_width < 1:
            raise RelposError(f"pos.mlp_width={mlp_width!r} must be a positive integer")
        if init_c == 0:  # psi(x) = log(|c x| + 1) = 0 at every distance, and |c|'s gradient at 0 is 0: no position, ever
            raise RelposError("pos.init_c=0 makes psi(i - j) = log(c (i - j) + 1) zero at every distance, and c never "
                              "moves from 0 (its gradient there is 0): give a nonzero c, e.g. 0.1")
        if isinstance(init_c, bool) or not isinstance(init_c, (int, float)) or not math.isfinite(init_c):
            raise RelposError(f"pos.init_c={init_c!r} must be a finite number (psi uses |c|)")
        if init_threshold is not None:
            check_above("init_threshold", init_threshold, 0, " or null (= train.seq_len): L, the query index psi(L) normalises to")
        threshold = shape.train_seq_len if init_threshold is None else init_threshold
        self.layers = nn.ModuleList(
            FireLayer(shape.n_heads, mlp_width, init_c, threshold) for _ in range(shape.n_layers)
        )

    def pair_bias(self, layer: int, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        return self.layers[layer](q_pos, k_pos)

    def pair_bias_as_distances(self, layer: int, positions: Tensor) -> Tensor | None:
        """Queries at or below the threshold L share the normaliser psi(L): the last query's row, by
        distance, is every row's (training at lengths up to L; evaluation up to L). While training, a
        forward pass over these positions computes every layer's at once (last_rows_of_all_layers) on
        its first call."""
        if not self.within_thresholds(positions)[layer]:
            return None
        if positions is self.pass_positions() and records_gradient(*self.parameters()):
            tables = self.pass_value(("every layer's table",),
                                     lambda: self.last_rows_of_all_layers(positions).unbind(0))
            return tables[layer]
        return self.layers[layer](positions[-1:, None], positions[None, :])[:, 0].flip(-1)  # (H, T): distances 0..T-1

    def last_rows_of_all_layers(self, positions: Tensor) -> Tensor:
        """Every layer's bias of the last query of `positions` (T,), consecutive, by distance 0..T-1:
        (n_layers, H, T), FireLayer.forward's computation (its MLP through baddbmm, as nn.Linear under
        autocast, in bf16 there) with the layers' parameters stacked. One set of ops a training step
        instead of one per layer, each a launch from the host, which FIRE's training step on a GPU
        waits on (0.36x NoPE's rate, most of its gap the host's: docs/gpu.md, "Sixth run"); the
        backward reaches every layer's parameters through the stacks."""
        layers = self.layers
        c = torch.stack([layer.c for layer in layers])[:, None]  # (n_layers, 1)
        normaliser = torch.maximum(positions[-1].to(torch.float32), self.thresholds())[:, None]  # (n_layers, 1)
        distance = torch.arange(positions.shape[0], device=positions.device, dtype=torch.float32)  # (T,)
        psi = lambda x: torch.log((c * x).abs() + 1)  # noqa: E731 -- FireLayer.psi with each layer's c
        normalised = psi(distance) / (psi(normaliser) + layers[0].eps)  # (n_layers, T); FIRE builds its layers alike
        first = [layer.mlp[0] for layer in layers]
        last = [layer.mlp[2] for layer in layers]
        hidden = torch.baddbmm(torch.stack([f.bias for f in first])[:, None], normalised[..., None],
                               torch.stack([f.weight for f in first]).transpose(1, 2)).relu()  # (n_layers, T, width)
        out = torch.baddbmm(torch.stack([f.bias for f in last])[:, None], hidden,
                            torch.stack([f.weight for f in last]).transpose(1, 2))  # (n_layers, T, H)
        # (n_layers, H, T), each layer's table as the fused kernel reads it: contiguous, float32 (bf16 under
        # autocast, which the kernel's inputs would otherwise cast per layer), copied for all the layers at once
        return out.transpose(1, 2).contiguous().float()

    def within_thresholds(self, positions: Tensor) -> list[bool]:
        """Per layer, whether every query of `positions` is at or below the layer's threshold L: read
        from the device once a forward pass over these positions, when a layer first asks (the fused
        kernel's table; two reads per layer stalled the GPU's queue 24 times a step of the 12-layer
        bench model), else at the call. Not kept past the pass: an optimizer step between passes moves
        the thresholds (CUDA's fused AdamW without bumping their version counters)."""
        if positions is not self.pass_positions():
            return self.read_within_thresholds(positions)
        return self.pass_value(("within thresholds",), lambda: self.read_within_thresholds(positions))

    def read_within_thresholds(self, positions: Tensor) -> list[bool]:
        """within_thresholds for every layer in one read from the device."""
        thresholds = self.thresholds().detach()
        return (positions[-1].to(thresholds) <= thresholds).tolist()

    def thresholds(self) -> Tensor:
        """Every layer's FireLayer.threshold, (n_layers,), from the layers' parameters stacked: a few ops
        for all the layers, not a few per layer."""
        return (torch.stack([layer.threshold_multiplier for layer in self.layers])
                * torch.stack([layer.init_threshold for layer in self.layers])).abs()

    def score_formula(self, layer: int):
        """The MLP through an interpolation grid (FireLayer.score_formula), within
        FireLayer.formula_error_bound of pair_bias; None while training (the MLP, c and the threshold
        would get their gradients by atomics from every score)."""
        return None if records_gradient(*self.parameters()) else self.layers[layer].score_formula()

    def normalised_log_distance_grid(self, layer: int) -> tuple[Tensor, Tensor] | None:
        """score_formula's numbers for a kernel (relpos_cli/kernels/fire.py): the layer's grid and its
        (|c|, L, eps); None while training, as score_formula."""
        if records_gradient(*self.parameters()):
            return None
        fire = self.layers[layer]
        return fire.formula_grid(), fire.formula_constants()
