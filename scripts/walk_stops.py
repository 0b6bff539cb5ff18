"""Where stick-breaking's and CoPE's walks over the keys stop, for a run's own weights: the share of the
key tiles each fused kernel's forward computes in full, and how many keys a query needs before it stops.

    python scripts/walk_stops.py outputs/latest --length 2048 --json walk.json

Both kernels (relpos_cli/kernels/stickbreaking.py, cope.py) walk a query tile's key tiles from the
nearest and drop their full arithmetic once every query of the tile has spent its stick (stick-breaking:
SPENT, in log) or counted max_positions - 1 (CoPE); evaluation on CPU leaves the same keys out per block of
queries (`far_keys`). How soon that happens depends on the weights: logits near 0, as at initialisation,
stop a query within about 160 keys, logits well below 0 never. This runs one window of --length tokens
of the run's validation data through its model (CPU, float32, no grad), takes each layer's q and k as its
attention computes them (inspect.attention_inputs), and counts, at the forward kernel's CUDA tiles (its
narrow KernelTiles, or --tiles), the key tiles the walk computes in full against the causal walk's, checking
every STOP_CHECK_TILES key tiles as the kernels do.

Prints one line per layer and writes {"run", "scheme", "length", "tiles", "check_every", "bound", "commit", "threads",
"layers": [{"tiles_walked", "tiles_causal", "fraction", "keys_to_stop": {"median", "p90", "max"}, "never"}]}
to --json: per layer, summed over heads; keys_to_stop over the queries that stop (the nearest keys whose
sum reaches the bound), never the share of queries whose sum does not.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def tiles_walked(per_key, bound: float, block_m: int, block_n: int, check_every: int) -> tuple[int, int]:
    """per_key (H, T, T): what each key adds to its query's sum (0 where the query does not see it), the
    queries at positions 0..T-1 -> (key tiles the kernels walk in full, key tiles of the causal walk),
    summed over heads. A query tile of block_m walks its key tiles from the nearest (the one holding
    its last query's key) check_every at a time (_tiles.STOP_CHECK_TILES), and before each such chunk
    goes on while one of its queries' sums over the tiles walked is below bound, as
    _tiles.some_row_below decides in the kernels."""
    import torch.nn.functional as F

    H, T, _ = per_key.shape
    tiles = math.ceil(T / block_n)
    sums = F.pad(per_key, (0, tiles * block_n - T)).view(H, T, tiles, block_n).sum(-1)  # (H, T, tiles)
    walked = causal = 0
    for start in range(0, T, block_m):
        n = math.ceil(min(T, start + block_m) / block_n)
        after = sums[:, start:start + block_m, :n].flip(-1).cumsum(-1)  # each query's sum after 1, 2, .. tiles
        # the chunk from tile c * check_every is walked when a query's sum after the tiles before it is still
        # below bound; the first always
        checks = after[..., check_every - 1:n - 1:check_every].min(dim=1).values < bound  # (H, chunks - 1)
        walked += int(((1 + checks.sum(-1)) * check_every).clamp(max=n).sum())
        causal += H * n
    return walked, causal


def keys_to_stop(per_key, bound: float):
    """per_key (H, T, T) as tiles_walked -> (the nearest keys whose sum reaches bound, per query that
    gets there: a 1-D tensor; the share of queries that never do)."""
    import torch

    T = per_key.shape[-1]
    reached = per_key.flip(-1).cumsum(-1) >= bound  # from key T - 1 back: a query's later keys add 0
    stops = reached.any(-1)  # (H, T)
    first = reached.int().argmax(-1)  # the flipped index where the sum reaches bound
    keys = first - (T - 1 - torch.arange(T))  # from the query's own position back: distance + 1
    return (keys[stops] + 1).double(), 1.0 - stops.double().mean().item()


def per_key_sums(scheme, q, k, positions):
    """What each visible key adds to its query's sum in the kernel's walk, and the bound that stops it:
    stick-breaking's -log(1 - beta) against SPENT, CoPE's gates against max_positions - 1. (H, T, T)."""
    from relpos_cli.positions.stickbreaking import SPENT

    if scheme.name == "stickbreaking":
        return scheme.taken(q, k, scheme.visible(positions, positions))[0].double(), SPENT
    return scheme.gates(q, k, positions, positions)[0].double(), float(scheme.max_positions - 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="a run of pos=stickbreaking or pos=cope")
    ap.add_argument("--length", type=int, help="tokens in the window (default: 16 x the run's train.seq_len)")
    ap.add_argument("--tiles", type=int, nargs=2, metavar=("M", "N"),
                    help="query and key tile (default: the forward kernel's narrow CUDA tiles)")
    ap.add_argument("--json", type=Path, help="written with the figures")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    import torch
    from omegaconf import OmegaConf

    from relpos_cli import kernels
    from relpos_cli.atomic import atomic_write_text
    from relpos_cli.attention import fused_kernel
    from relpos_cli.checkpoint import load_run
    from relpos_cli.data import load_token_data
    from relpos_cli.errors import RelposError
    from relpos_cli.inspect import attention_inputs
    from relpos_cli.kernels._tiles import STOP_CHECK_TILES

    try:
        model, _, cfg = load_run(args.run)
    except (RelposError, OSError) as e:
        raise SystemExit(f"walk_stops: {e}") from None
    scheme = model.scheme
    if scheme.name not in ("stickbreaking", "cope"):
        raise SystemExit(f"walk_stops: {args.run} is a run of pos={scheme.name}; its walk does not stop: "
                         f"give a run of pos=stickbreaking or pos=cope")
    length = args.length or 16 * int(cfg.train.seq_len)
    validation = load_token_data(OmegaConf.to_container(cfg.data, resolve=True)).validation
    if not 1 < length <= len(validation):
        raise SystemExit(f"walk_stops: --length {length} must be 2..{len(validation)} (the run's validation tokens)")
    if args.tiles and not all(t > 0 for t in args.tiles):
        raise SystemExit(f"walk_stops: --tiles {args.tiles[0]} {args.tiles[1]} must be positive")
    kernel = getattr(kernels, fused_kernel(scheme))
    block_m, block_n = args.tiles or sys.modules[kernel.__module__].FORWARD_TILES.narrow[:2]
    check_every = STOP_CHECK_TILES.value
    tokens = torch.as_tensor(validation[:length].astype("int64"))
    positions = torch.arange(length)
    layers = []
    with torch.no_grad():
        for block, x in zip(model.blocks, attention_inputs(model, tokens)):
            q, k, _ = block.attn.heads(x, positions, scheme)  # (1, H, T, Dh)
            per_key, bound = per_key_sums(scheme, q, k, positions)
            walked, causal = tiles_walked(per_key, bound, block_m, block_n, check_every)
            keys, never = keys_to_stop(per_key, bound)
            stop = ({"median": keys.median().item(), "p90": keys.quantile(0.9).item(), "max": keys.max().item()}
                    if keys.numel() else None)
            layers.append({"tiles_walked": walked, "tiles_causal": causal, "fraction": walked / causal,
                           "keys_to_stop": stop, "never": never})
            keys_line = (f"median {stop['median']:.0f}, p90 {stop['p90']:.0f}, max {stop['max']:.0f}" if stop
                         else "none stops")
            print(f"layer {len(layers) - 1}: {walked:,} of {causal:,} key tiles walked in full ({walked / causal:.1%}); "
                  f"keys to the stop: {keys_line}; never stopping {never:.1%} of queries")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    record = {"run": str(args.run), "scheme": scheme.name, "length": length, "tiles": [block_m, block_n],
              "check_every": check_every,
              "bound": bound, "commit": commit or "unknown", "threads": torch.get_num_threads(), "layers": layers}
    if args.json:
        try:
            atomic_write_text(args.json, json.dumps(record, indent=2) + "\n")  # never half-written
        except OSError as e:
            raise SystemExit(f"walk_stops: cannot write {args.json}: {e}") from None
        print(f"walk_stops: {args.json}")


if __name__ == "__main__":
    main()
