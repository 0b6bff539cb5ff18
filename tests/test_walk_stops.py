"""scripts/walk_stops.py: the key tiles stick-breaking's and CoPE's kernels walk in full, counted against
the kernels' walk written out as a loop (a query tile walks its key tiles from the nearest while one
of its queries' sums is below the bound), the keys a query needs before its stop against a loop over
each row, and the script end to end on a tiny stick-breaking run, its bad inputs in one line."""

from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import tiny_trained
from test_gpu_check import run
from walk_stops import keys_to_stop, tiles_walked


def per_key(H: int, T: int, seed: int) -> torch.Tensor:
    """(H, T, T): positive amounts on the causal pairs (the diagonal included), 0 on the future ones;
    some rows small, so that some queries' sums stay below a bound and others pass it."""
    g = torch.Generator().manual_seed(seed)
    scale = 0.3 + torch.rand(H, T, 1, generator=g, dtype=torch.float64)  # per query
    amounts = torch.rand(H, T, T, generator=g, dtype=torch.float64) * scale
    return amounts.tril()


def walked_by_loop(values: torch.Tensor, bound: float, block_m: int, block_n: int, check_every: int) -> tuple[int, int]:
    """The kernels' forward, one head and one query tile at a time: walk the key tiles from the nearest,
    adding each tile's amounts to each query's sum, checking before every check_every-th tile whether some
    query of the tile is below bound."""
    H, T, _ = values.shape
    walked = causal = 0
    for h in range(H):
        for start in range(0, T, block_m):
            rows = range(start, min(start + block_m, T))
            n_tiles = math.ceil(min(T, start + block_m) / block_n)
            sums = {i: 0.0 for i in rows}
            for step, tile in enumerate(reversed(range(n_tiles))):
                if step % check_every == 0 and min(sums.values()) >= bound:
                    break
                walked += 1
                for i in rows:
                    sums[i] += float(values[h, i, tile * block_n:(tile + 1) * block_n].sum())
            causal += n_tiles
    return walked, causal


@pytest.mark.parametrize("T,block_m,block_n", [(37, 16, 8), (40, 8, 16), (64, 16, 16), (150, 32, 8)])
@pytest.mark.parametrize("bound", [0.5, 3.0, 9.0])
@pytest.mark.parametrize("check_every", [1, 3, 4])
def test_tiles_walked_counts_the_kernels_walk(T, block_m, block_n, bound, check_every):
    values = per_key(2, T, seed=T + block_m)
    walked, causal = tiles_walked(values, bound, block_m, block_n, check_every)
    assert (walked, causal) == walked_by_loop(values, bound, block_m, block_n, check_every)


def test_the_cases_walk_some_tiles_and_skip_others():
    """Not vacuous: at the middle bound the walk stops early for some query tiles and walks to key 0
    for others, checking every tile and every 3."""
    values = per_key(2, 150, seed=182)
    for check_every in (1, 3):
        walked, causal = tiles_walked(values, 3.0, 32, 8, check_every)
        assert 2 * 5 * check_every < walked < causal  # more than each query tile's first chunk


def test_keys_to_stop_per_query():
    values = per_key(2, 30, seed=3)
    bound = 4.0
    keys, never = keys_to_stop(values, bound)
    expected, missing = [], 0
    for h in range(2):
        for i in range(30):
            total = 0.0
            for j in range(i, -1, -1):  # from the query back
                total += float(values[h, i, j])
                if total >= bound:
                    expected.append(i - j + 1)
                    break
            else:
                missing += 1
    assert keys.tolist() == expected and 0 < missing < 60
    assert never == pytest.approx(missing / 60)


@pytest.fixture(scope="module")
def stickbreaking_run(tmp_path_factory, in_temp_cwd):
    return tiny_trained(tmp_path_factory, "pos=stickbreaking")


def test_a_stickbreaking_run_end_to_end(stickbreaking_run, tmp_path):
    out = tmp_path / "walk.json"
    proc = run("walk_stops.py", str(stickbreaking_run), "--length", "96", "--tiles", "32", "16", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = json.loads(out.read_text())
    assert record["scheme"] == "stickbreaking" and record["length"] == 96 and record["tiles"] == [32, 16]
    heads = 2  # model=tiny
    assert len(record["layers"]) >= 1
    for layer in record["layers"]:
        # each query tile walks its nearest tile at least; the causal walk: (2 + 4 + 6) tiles a head
        assert layer["tiles_causal"] == heads * (2 + 4 + 6)
        assert heads * 3 <= layer["tiles_walked"] <= layer["tiles_causal"]
        assert 0 <= layer["never"] <= 1
    assert proc.stdout.count("key tiles walked in full") == len(record["layers"])


def test_bad_inputs_are_one_line(stickbreaking_run, tiny_run, tmp_path):
    for args, message in (((str(tiny_run),), "is a run of pos=alibi; its walk does not stop"),
                          ((str(stickbreaking_run), "--length", "10000000"), "--length 10000000 must be 2.."),
                          ((str(stickbreaking_run), "--tiles", "0", "16"), "--tiles 0 16 must be positive"),
                          ((str(tmp_path / "nothing"),), "walk_stops: ")):
        proc = run("walk_stops.py", *args)
        assert proc.returncode != 0 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr[-2000:]
        assert message in proc.stderr and "Traceback" not in proc.stderr
