"""What a position scheme does to attention: position-only logits, distance curves, attention maps
and the symmetry measure ||A - A^T||_F / ||A||_F (seed 002: a causal mask breaks (i, j) symmetry).

The position-only term comes from the scheme's hooks, never from its name:
- score bias (ALiBi, T5, ...): ``score_bias`` of an index pair. A bias of the queries and keys
  (CoPE, Shaw, DAPE, stick-breaking: ``BiasInput.CONTENT``) is taken at one query and one key per
  head drawn from N(0, 1) (``content_sample``, seeded), the same at every position, so that what
  changes with (i, j) is the positions alone, as in the rotary term; at zero q and k CoPE's and
  Shaw's biases q . e would be 0 everywhere. FoX's bias reads the layer input, taken as zero: each
  head's gate bias alone, a constant decay per token;
- rotation (RoPE, ...): E[(R_i u) . (R_j u)] / sqrt(Dh) over random u used as both query and key,
  the part of q . k that changes with the positions when the content is identical;
- embedding (learned, sinusoidal): cosine similarity of the position rows of ``embed(0, positions)``.
A scheme with several hooks gets the sum; a scheme with none gets zeros.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch
from torch import Tensor

from omegaconf import OmegaConf

from relpos_cli.atomic import atomic_write_bytes, atomic_write_text
from relpos_cli.attention import causal_additive_mask
from relpos_cli.checkpoint import load_config, load_trained_model
from relpos_cli.config import apply_overrides, check_override_keys, save_hydra_record, validate_run_config
from relpos_cli.console import clear_errors, plain_console
from relpos_cli.data import load_token_data
from relpos_cli.distributed import machine_memory
from relpos_cli.errors import RelposError
from relpos_cli.fingerprint import check_data_unchanged, check_tokens_unchanged
from relpos_cli.logs import run_log
from relpos_cli.model import Transformer, model_shape
from relpos_cli.plots import figure_bytes, plot_format, pyplot, run_title
from relpos_cli.positions import build_scheme
from relpos_cli.positions.base import BiasInput, ModelShape, PositionScheme
from relpos_cli.results import CONFIG_FILE, FORMATS, INSPECT_DIR, INSPECT_INDEX, SYMMETRY_FILE
from relpos_cli.rundir import check_fresh_run_dir, refuse_if_trained, run_dir_lock
from relpos_cli.tracking import log_inspect, publish

# what `relpos inspect RUN_DIR` may change in a trained run (it always runs on the CPU)
INSPECT_KEYS = ("inspect.*", "plots.*")
ROTARY_CHUNK = 8  # random vectors rotated at once for the rotary position term
POSITION_SEED = 0  # the random vectors of the position term (rotary samples, a content bias's q and k)
# (H, L, L) fp32 arrays alive at once for one layer: the position term and a bias, two softmax maps
# and the mask they go through, asymmetry's difference and its nan-free copy, one spare
PICTURES = 8
# a heat map's cost per cell of each head shown: its float32 copy, and matplotlib's float64 copy,
# mask and resampling of it
HEATMAP_BYTES_PER_CELL = 32


# ---- numbers --------------------------------------------------------------------------------------


def content_sample(shape: ModelShape, length: int, seed: int = POSITION_SEED) -> tuple[Tensor, Tensor]:
    """The queries and keys a content bias's position term is taken at: one query and one key per
    head ~ N(0, 1), drawn from `seed`, the same at every one of `length` positions -> q, k (1, H, L, Dh)."""
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(2, 1, shape.n_heads, 1, shape.head_dim, generator=g).expand(-1, -1, -1, length, -1)
    return q, k


def content_note(scheme: PositionScheme) -> str:
    """How the position term of a bias of q and k was taken, for the captions; "" for other schemes."""
    if scheme.bias_input is not BiasInput.CONTENT:
        return ""
    return f"q, k ~ N(0, 1), seed {POSITION_SEED}: one per head, the same at every position"


@torch.no_grad()
def position_logits(scheme: PositionScheme, layer: int, length: int, rotary_samples: int = 256,
                    seed: int = POSITION_SEED) -> Tensor:
    """Position-only logit contribution of `layer` on an L x L grid -> (H, L, L)."""
    shape = scheme.shape
    H, Dh, D = shape.n_heads, shape.head_dim, shape.d_model
    positions = torch.arange(length)
    total = torch.zeros(H, length, length)
    if scheme.uses_score_bias:
        q, k = content_sample(shape, length, seed)  # read by a content bias only
        no_tokens = torch.zeros(1, length, D)  # a token-difference bias of no content: its gates' biases alone
        total += scheme.score_bias(layer, q, k, positions, layer_input=no_tokens).float().expand(1, H, length, length)[0]
    if scheme.uses_rotation:
        g = torch.Generator().manual_seed(seed)
        u = torch.randn(rotary_samples, H, 1, Dh, generator=g).expand(-1, -1, length, -1)  # same u at every position
        for chunk in u.split(ROTARY_CHUNK):  # (n, H, L, L) products a few samples at a time, not (N, H, L, L)
            q, k = scheme.rotate(layer, chunk, chunk, positions)  # (n, H, L, Dh)
            total += (q @ k.transpose(-2, -1)).sum(0) / (rotary_samples * math.sqrt(Dh))
    if scheme.uses_embedding:
        rows = scheme.embed(torch.zeros(1, length, D), positions)[0]  # (L, D)
        rows = torch.nn.functional.normalize(rows, dim=-1)
        total += rows @ rows.T
    return total


def asymmetry(a: Tensor) -> Tensor:
    """||A - A^T||_F / ||A||_F over the last two dims -> (...); 0 where A is all zeros. Logits of
    -inf (keys a scheme hides itself: stick-breaking's j >= i) count as 0, what they weigh."""
    a = a.nan_to_num(neginf=0.0)
    num = torch.linalg.matrix_norm(a - a.transpose(-2, -1))
    den = torch.linalg.matrix_norm(a)
    return torch.where(den > 0, num / den.clamp(min=1e-30), torch.zeros_like(den))


def softmax_maps(logits: Tensor, normalise: bool = True) -> tuple[Tensor, Tensor]:
    """logits (..., L, L) -> (bidirectional attention, causal attention): softmax over all keys vs
    over keys j <= i; exp(logits) as they are for a scheme that does not normalise (stick-breaking)."""
    weights = (lambda x: x.softmax(-1)) if normalise else torch.exp
    return weights(logits), weights(causal_additive_mask(logits))


def distance_curve(a: Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Mean of A[..., i, j] along each diagonal d = i - j -> (distances (2L-1,), values (..., 2L-1))."""
    L = a.shape[-1]
    distances = np.arange(-(L - 1), L)
    values = torch.stack([torch.diagonal(a, offset=-int(d), dim1=-2, dim2=-1).mean(-1) for d in distances], -1)
    return distances, values.numpy()


@torch.no_grad()
def attention_inputs(model: Transformer, tokens: Tensor) -> list[Tensor]:
    """What each layer's attention block receives for one sample tokens (T,) -> [(1, T, D)], from one
    forward pass: CausalSelfAttention.heads(x, positions, scheme) gives that layer's q, k, v."""
    captured: list[Tensor] = []
    hooks = [
        block.attn.register_forward_pre_hook(lambda module, args: captured.append(args[0]))
        for block in model.blocks
    ]
    try:
        model(tokens[None])
    finally:
        for h in hooks:
            h.remove()
    return captured


@torch.no_grad()
def attention_logits(model: Transformer, tokens: Tensor) -> list[Tensor]:
    """Full (unmasked) attention logits of every layer for one sample tokens (T,) -> [(H, T, T)].

    Recomputes each layer's q . k / sqrt(Dh) + bias from the input its attention block receives,
    the way CausalSelfAttention does before the mask. A layer with a sliding window
    (model.sliding_window) gets -inf where |i - j| >= window: its causal maps are the window it
    attends with, its bidirectional maps the same band both ways."""
    positions = torch.arange(tokens.shape[0], device=tokens.device)
    scheme = model.scheme
    out = []
    for block, x in zip(model.blocks, attention_inputs(model, tokens)):
        attn = block.attn
        q, k, _ = attn.heads(x, positions, scheme)  # (B, H, T, Dh)
        logits = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, T, T)
        if scheme.uses_score_bias:
            logits = logits + scheme.score_bias(attn.layer, q, k, positions, layer_input=x)
        if attn.window is not None:
            logits = logits.masked_fill((positions[:, None] - positions[None, :]).abs() >= attn.window, float("-inf"))
        out.append(logits[0].float().cpu())
    return out


def pick(indices: Any, count: int, what: str) -> list[int]:
    """inspect.layers / inspect.heads: the indices given (all when null), each once and in range."""
    if indices is None:
        return list(range(count))
    chosen = [int(i) for i in indices]
    if not chosen:
        raise RelposError(f"inspect.{what}=[] names no {what[:-1]}; give indices, or null for all {count}")
    bad = [i for i in chosen if not 0 <= i < count]
    if bad:
        raise RelposError(f"inspect.{what}={bad} out of range: the model has {count} {what}")
    if len(set(chosen)) < len(chosen):
        raise RelposError(f"inspect.{what}={chosen} names a {what[:-1]} twice; name each once")
    return chosen


def inspect_bytes(scheme: PositionScheme, length: int, heads: int, rotary_samples: int, with_model: bool) -> int:
    """About the most memory inspect holds at once: per layer PICTURES (H, L, L) fp32 arrays, the
    rotary term's (ROTARY_CHUNK, H, L, L) products and its random vectors, a trained model's
    attention logits of every layer (plus its own forward pass), and the heat maps' copies."""
    shape = scheme.shape
    arrays = PICTURES + (ROTARY_CHUNK if scheme.uses_rotation else 0) + (shape.n_layers + 2 if with_model else 0)
    cells = length * length
    vectors = rotary_samples * shape.n_heads * shape.head_dim * 4 if scheme.uses_rotation else 0
    return cells * (4 * shape.n_heads * arrays + HEATMAP_BYTES_PER_CELL * heads) + vectors


def check_inspect_settings(scheme: PositionScheme, settings: Mapping[str, Any], with_model: bool) -> tuple[int, list[int], list[int]]:
    """The length, layers and heads to inspect, refused in one line before anything is computed or
    written where the scheme cannot represent the length or the pictures cannot fit in memory
    (inspect.length=30000 met the OOM killer or a failed allocation deep in torch).

    Args:
        scheme: the scheme inspected.
        settings: cfg.inspect (validated by relpos_cli.settings: types and lower bounds).
        with_model: a trained model's attention maps are drawn too.
    Returns:
        (length, layers, heads).
    """
    length = int(settings["length"])
    if length < 2:
        raise RelposError(f"inspect.length={length} must be at least 2")
    scheme.check_length(length)
    layers = pick(settings.get("layers"), scheme.shape.n_layers, "layers")
    heads = pick(settings.get("heads"), scheme.shape.n_heads, "heads")
    samples = int(settings.get("rotary_samples", 256))
    need = inspect_bytes(scheme, length, len(heads), samples, with_model)
    memory = machine_memory()
    if memory is not None and need > memory:
        # the random vectors alone can be too many (inspect.rotary_samples=10**10)
        culprit = "rotary_samples" if inspect_bytes(scheme, length, len(heads), 1, with_model) <= memory else "length"
        raise RelposError(f"inspect.length={length} with inspect.rotary_samples={samples} needs about {need / 2**30:,.1f} GiB "
                          f"({scheme.shape.n_heads} x {length} x {length} pictures), more than this machine's "
                          f"{memory / 2**30:,.1f} GiB of memory: lower inspect.{culprit}")
    return length, layers, heads


# ---- pictures ----------------------------------------------------------------------------------------

HEATMAP_COLUMNS = 4  # heads per row: six heads of 3 cm each stay readable on a page


def heatmaps(maps: Tensor, heads: list[int], title: str):
    """One L x L heat map per head, (H, L, L) -> figure. All heads of a layer share one colour scale
    and one colour bar, so heads that differ in scale (ALiBi's slopes) look different."""
    plt = pyplot()
    from matplotlib.ticker import MaxNLocator

    cols = min(len(heads), HEATMAP_COLUMNS)
    rows = math.ceil(len(heads) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(2.4 * cols + 1.2, 2.4 * rows + 0.7), squeeze=False,
                             layout="constrained", dpi=100)
    shown = [maps[h].numpy().copy() for h in heads]
    for m in shown:  # -inf: a key the scheme hides itself (stick-breaking's j >= i), left blank
        m[np.isneginf(m)] = np.nan
    low, high = float(np.nanmin(shown)), float(np.nanmax(shown))
    for n, ax in enumerate(axes.flat):
        if n >= len(heads):
            ax.remove()
            continue
        im = ax.imshow(shown[n], cmap="viridis", vmin=low, vmax=high)
        ax.set_title(f"head {heads[n]}", fontsize=9)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.tick_params(labelsize=7)
        if n % cols == 0:
            ax.set_ylabel("query i", fontsize=8)
        if n // cols == rows - 1 or n + cols >= len(heads):
            ax.set_xlabel("key j", fontsize=8)
    fig.colorbar(im, ax=[a for a in axes.flat if a.figure is fig and a.has_data()], shrink=0.9)
    fig.suptitle(title, fontsize=10)
    return fig


def curves(distances: np.ndarray, values: np.ndarray, heads: list[int], title: str):
    """Contribution vs i - j, one line per head -> figure (legend beside the axes)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4), dpi=100)
    for h in heads:
        ax.plot(distances, np.where(np.isneginf(values[h]), np.nan, values[h]), label=f"head {h}")  # hidden keys: no point
    ax.axvline(0, color="grey", lw=0.5)
    ax.set_xlabel("i - j (query - key; > 0: key in the past)")
    ax.set_ylabel("mean position-only logit")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0, frameon=False)
    return fig


# ---- the job -------------------------------------------------------------------------------------------


def inspect_scheme(
    scheme: PositionScheme,
    out_dir: Path,
    settings: Mapping[str, Any],
    model: Transformer | None = None,
    tokens: Tensor | None = None,
    title: str | None = None,
    fmt: str = "png",
) -> dict[str, Any]:
    """Write figures (in fmt), symmetry.json and inspect.md into out_dir/inspect; returns the
    symmetry record. Figures are titled `title` (the run's name and scheme; default the scheme).
    With a model and a token sample (T,), also the attention maps of the chosen layers/heads."""
    title = title or scheme.name
    length, layers, heads = check_inspect_settings(scheme, settings, model is not None)
    target = Path(out_dir) / INSPECT_DIR
    target.mkdir(parents=True, exist_ok=True)
    files: list[tuple[str, str]] = []  # (file name, what it shows)
    note = content_note(scheme)
    record: dict[str, Any] = {"scheme": scheme.name, "hooks": scheme.hooks(), "length": length, "heads": heads,
                              **({"position_content": note} if note else {}), "layers": {}}
    attention = attention_logits(model, tokens) if model is not None else None
    for layer in layers:
        logits = position_logits(scheme, layer, length, int(settings.get("rotary_samples", 256)))
        entry = position_figures(scheme, layer, logits, heads, target, title, fmt, files)
        if attention is not None:
            entry.update(attention_figures(scheme, layer, attention[layer], heads, target, title, fmt, files))
        record["layers"][str(layer)] = entry
    record["figures"] = [f for f, _ in files]  # what W&B gets (tracking.log_inspect), not the folder's other files
    write_index(record, target, files)
    remove_stale_figures(target, files)
    record["files"] = [target / f for f, _ in files]
    return record


def per_head(values: Tensor, heads: list[int]) -> list[float]:
    """(H,) -> the chosen heads' values."""
    return [float(values[h]) for h in heads]


# every figure inspect writes is target/<kind>_layer<N>.<plots.format>, and no other file is named so
FIGURE_KINDS = ("position_logits", "distance", "attention_bidirectional", "attention_causal")
FIGURE_NAME = re.compile(rf"({'|'.join(FIGURE_KINDS)})_layer\d+\.({'|'.join(FORMATS)})")


def write_figure(figure, target: Path, kind: str, layer: int, fmt: str, what: str, files: list[tuple[str, str]]) -> None:
    """One figure of a FIGURE_KINDS kind into target/<kind>_layer<layer>.fmt, listed in files with what it shows."""
    name = f"{kind}_layer{layer}.{fmt}"
    atomic_write_bytes(target / name, figure_bytes(figure, fmt))
    files.append((name, what))


def remove_stale_figures(target: Path, files: list[tuple[str, str]]) -> None:
    """Once the new set is written: remove the figures of earlier inspects that this one did not
    write (other layers, plots.format), which W&B would otherwise get as current. Only files named
    as inspect names its figures; anything else in the folder stays."""
    written = {f for f, _ in files}
    for path in target.iterdir():
        if FIGURE_NAME.fullmatch(path.name) and path.name not in written and path.is_file():
            path.unlink()


def position_figures(scheme: PositionScheme, layer: int, logits: Tensor, heads: list[int], target: Path, title: str,
                     fmt: str, files: list[tuple[str, str]]) -> dict[str, list[float]]:
    """The position-only term of one layer, logits (H, L, L): its heat maps and distance curves
    written, its asymmetry without and with the causal mask returned."""
    length = logits.shape[-1]
    bidir, causal = softmax_maps(logits, scheme.normalises)
    entry = {"position_logits": per_head(asymmetry(logits), heads),
             "position_attention_bidirectional": per_head(asymmetry(bidir), heads),
             "position_attention_causal": per_head(asymmetry(causal), heads)}
    note = content_note(scheme)  # a content bias: the q and k it is taken at, under the title and in the index
    line, clause = (f"\n{note}", f"; bias at {note}") if note else ("", "")
    write_figure(heatmaps(logits, heads, f"{title}\nposition-only logits, layer {layer}{line}"), target,
                 "position_logits", layer, fmt,
                 f"layer {layer}: position-only logit contribution per head on {length} x {length} (query i, key j){clause}", files)
    distances, values = distance_curve(logits)
    write_figure(curves(distances, values, heads, f"{title}\nposition term vs distance, layer {layer}{line}"), target,
                 "distance", layer, fmt,
                 f"layer {layer}: position-only logit averaged over pairs with the same i - j, one line per head{clause}", files)
    return entry


def attention_figures(scheme: PositionScheme, layer: int, full: Tensor, heads: list[int], target: Path, title: str,
                      fmt: str, files: list[tuple[str, str]]) -> dict[str, list[float]]:
    """A trained model's attention of one layer on the sample, logits full (H, T, T): its maps
    without and with the causal mask written, their asymmetry returned."""
    bidir, causal = softmax_maps(full, scheme.normalises)
    for kind, maps in (("bidirectional", bidir), ("causal", causal)):
        what = "softmax over all keys (no mask)" if kind == "bidirectional" else "softmax over keys j <= i (causal mask)"
        write_figure(heatmaps(maps, heads, f"{title}\nattention on a validation sample, layer {layer}, {kind}"), target,
                     f"attention_{kind}", layer, fmt,
                     f"layer {layer}: trained attention weights on {full.shape[-1]} validation tokens, {what}", files)
    return {"attention_bidirectional": per_head(asymmetry(bidir), heads),
            "attention_causal": per_head(asymmetry(causal), heads)}


def write_index(record: Mapping[str, Any], target: Path, files: list[tuple[str, str]]) -> None:
    """symmetry.json (the record) and inspect.md (every file and what it shows) into target."""
    atomic_write_text(target / SYMMETRY_FILE, json.dumps(record, indent=2) + "\n")
    files.append((SYMMETRY_FILE, "||A - A^T||_F / ||A||_F per layer and head, without and with the causal mask"))
    atomic_write_text(target / INSPECT_INDEX, index_markdown(record, files))


def index_markdown(record: Mapping[str, Any], files: list[tuple[str, str]]) -> str:
    lines = [
        f"# relpos inspect: pos={record['scheme']} (hooks: {', '.join(record['hooks']) or 'none'}), L={record['length']}",
        "",
        "Asymmetry = ||A - A^T||_F / ||A||_F (0: symmetric in query/key; position_logits is the raw",
        "position term, *_bidirectional softmaxes over all keys, *_causal over keys j <= i).",
        "",
        "| file | what it shows |",
        "|---|---|",
        *[f"| [{f}]({f}) | {what} |" for f, what in files],
        "",
    ]
    return "\n".join(lines)


# symmetry.json's measures as two-line column headers that fit 80 columns
MEASURE_HEADERS = {
    "position_logits": "position\nlogits",
    "position_attention_bidirectional": "position\nsoftmax",
    "position_attention_causal": "position\ncausal",
    "attention_bidirectional": "trained\nsoftmax",
    "attention_causal": "trained\ncausal",
}


def symmetry_table(record: Mapping[str, Any], title: str):
    from rich.table import Table

    columns = [c for c in next(iter(record["layers"].values()))]
    taken = f" at {record['position_content']}" if "position_content" in record else ""
    caption = (f"position: the position-only term{taken}; " + ("trained: attention on a validation sample; " if "attention_causal" in columns else "")
               + "softmax: over all keys; causal: over keys j <= i")
    table = Table(title=title, caption=caption, caption_justify="left")
    table.add_column("layer", justify="right")
    table.add_column("head", justify="right")
    for c in columns:
        table.add_column(MEASURE_HEADERS.get(c, c.replace("_", " ")), justify="right")
    for layer, entry in record["layers"].items():
        for n, h in enumerate(record["heads"]):
            table.add_row(layer, str(h), *[f"{entry[c][n]:.4f}" for c in columns])
    return table


def reinit_scheme_parameters(scheme: PositionScheme, seed: int) -> None:
    """Untrained models: redraw every scheme parameter ~ N(0, 1) (then project it into the scheme's
    constraints) so zero-initialised tables (CoPE) show their structure instead of a blank map."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in scheme.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    scheme.constrain_parameters()  # back into the allowed set (KERPLE's r > 0), as after a training step


# ---- entry points -----------------------------------------------------------------------------------


def inspect_fresh(cfg, run_dir: Path) -> dict[str, Any]:
    """`relpos inspect pos=<scheme>`: the scheme as built from the config, no training, no data."""
    validate_run_config(cfg)
    m = cfg.model
    if m.d_model % m.n_heads:
        raise RelposError(f"model.d_model={m.d_model} is not divisible by model.n_heads={m.n_heads}")
    torch.manual_seed(int(cfg.seed))
    scheme = build_scheme(cfg.pos, model_shape(m, cfg.train))
    if cfg.inspect.fresh_init == "normal":
        reinit_scheme_parameters(scheme, int(cfg.seed))
    return inspect_scheme(scheme, run_dir, cfg.inspect, title=f"{run_title(run_dir, scheme.name)} (untrained)",
                          fmt=plot_format(cfg))


def inspect_run(run_dir: Path, overrides: list[str]):
    """`relpos inspect RUN_DIR`: the trained scheme plus attention maps on a validation sample."""
    check_override_keys(overrides, INSPECT_KEYS, "inspect")
    cfg = apply_overrides(load_config(run_dir, whole_run=True), overrides)  # it rebuilds the trained model
    validate_run_config(cfg)
    fmt = plot_format(cfg)
    # one sample of inspect.length tokens: CPU is fast enough and keeps the grids on one device
    _, model = load_trained_model(run_dir, torch.device("cpu"))
    check_inspect_settings(model.scheme, cfg.inspect, with_model=True)  # before the data is read
    allow = bool(cfg.inspect.allow_changed_data)
    check_data_unchanged(run_dir, cfg.data, allow, "inspect")
    data = load_token_data(OmegaConf.to_container(cfg.data, resolve=True))
    check_tokens_unchanged(run_dir, data, allow, "inspect")
    start, length = int(cfg.inspect.sample_offset), int(cfg.inspect.length)
    if start < 0 or start + length > len(data.validation):
        raise RelposError(
            f"inspect.sample_offset={start} + inspect.length={length} is past the {len(data.validation)} validation tokens"
        )
    tokens = torch.from_numpy(np.asarray(data.validation[start : start + length]).astype(np.int64))
    return cfg, inspect_scheme(model.scheme, run_dir, cfg.inspect, model, tokens, run_title(run_dir, model.scheme.name), fmt)


def report_inspect(run_dir: Path, config, record) -> None:
    """Print the symmetry table, log to relpos.log and W&B, name what was written."""
    console = plain_console()
    console.print(symmetry_table(record, f"{run_title(run_dir, record['scheme'])}: asymmetry ||A - A^T||_F / ||A||_F"))
    wrote = f"wrote {len(record['files']) + 1} files into {run_dir / INSPECT_DIR} (index: {INSPECT_INDEX})"
    with run_log(run_dir) as log:
        log.info(f"inspect: {wrote}")
    publish(run_dir, log_inspect, OmegaConf.to_container(config, resolve=True))
    console.print(wrote)


def inspect_job(cfg) -> None:
    """The Hydra job of `relpos inspect key=value...`: a fresh scheme into the job's run dir."""
    from hydra.core.hydra_config import HydraConfig

    with clear_errors():
        run_dir = Path(HydraConfig.get().runtime.output_dir)
        check_fresh_run_dir(run_dir)  # never into a folder of the user's own files
        with run_dir_lock(run_dir, "inspect"):
            # a trained run's inspect/ pictures are of its weights: `relpos inspect RUN_DIR` redoes them
            refuse_if_trained(run_dir, (run_dir / CONFIG_FILE).exists())
            save_hydra_record(run_dir, cfg)
            report_inspect(run_dir, cfg, inspect_fresh(cfg, run_dir))


def inspect_runs(runs: list[Path], overrides: list[str]) -> None:
    """`relpos inspect RUN_DIR...`: each trained run, under its lock."""
    for run_dir in runs:
        with run_dir_lock(run_dir, "inspect"):
            cfg, record = inspect_run(run_dir, overrides)
            report_inspect(run_dir, cfg, record)
