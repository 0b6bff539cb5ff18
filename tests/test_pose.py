"""PoSE training (Zhu et al. 2024, "PoSE: Efficient Context Window Extension of LLMs via Positional
Skip-wise Training"): train.position_skip=N gives each batch the positions of the reference's
``train_preprocess_function_pose`` (dwzhu-pku/PoSE src/train_pose.py), drawn from the batch plan's
own generator, so a resumed run is bitwise the uninterrupted one."""

import random

import pytest
import torch
from omegaconf import OmegaConf

from conftest import TINY, final_weights, metrics, run_in_process
from relpos_cli.sampled_positions import pose_position_ids
from relpos_cli.train import BatchPlan


def reference_pose_position_ids(len_chunk: int, scaled_max_position_embeddings: int, rng: random.Random) -> torch.Tensor:
    """The position part of dwzhu-pku/PoSE ``train_preprocess_function_pose`` for a window of
    len_chunk tokens (lt1 = 0, lt = 0 as in the repository's revision)."""
    lt1 = 0
    rt1 = rng.randint(1, (len_chunk + 1) // 2)
    pos_ids = torch.arange(len_chunk, dtype=torch.long)
    lt = 0
    rt = rng.randint(lt, scaled_max_position_embeddings - len_chunk)
    pos_ids[:rt1 - lt1] += lt
    pos_ids[rt1 - lt1:] += rt
    return pos_ids


def draws(positions: torch.Tensor) -> tuple[int | None, int]:
    """(first chunk's length, skip) read back from PoSE positions (the chunk is unseen when skip = 0)."""
    skip = int(positions[-1]) - (positions.shape[0] - 1)
    jumps = (positions.diff() > 1).nonzero()
    return (int(jumps[0]) + 1 if skip else None), skip


def test_position_ids_are_the_references_for_every_draw():
    """For each (first chunk, skip) the reference can draw, the same position ids."""
    length, target = 9, 20
    for first in range(1, (length + 1) // 2 + 1):
        for skip in range(0, target - length + 1):
            rng = FixedDraws([first, skip])
            assert torch.equal(pose_position_ids(length, first, skip), reference_pose_position_ids(length, target, rng))


class FixedDraws(random.Random):
    """A random.Random whose randint returns the given values in turn (checking they are in range)."""

    def __init__(self, values):
        super().__init__(0)
        self.values = list(values)

    def randint(self, a, b):
        value = self.values.pop(0)
        assert a <= value <= b
        return value


def plan(**train):
    return BatchPlan(OmegaConf.create({"seq_len": 8, "min_seq_len": 4, "length_schedule": "fixed", "steps": 50,
                                       "randomized_positions": None, "position_skip": 20, **train}), seed=0)


def test_draws_cover_the_references_ranges_uniformly_and_stay_below_the_target():
    """Mutation checked: drawing the first chunk from 1..length // 2 (one short) or the skip from
    0..N - L - 1 fails."""
    ours, theirs = plan(), random.Random(0)
    got = [ours.positions(9, torch.device("cpu")) for _ in range(6000)]
    want = [reference_pose_position_ids(9, 20, theirs) for _ in range(6000)]
    for drawn in (got, want):
        assert all(p.shape == (9,) and int(p[0]) == 0 and int(p[-1]) < 20 and bool((p.diff() > 0).all()) for p in drawn)
    firsts = lambda d: {f for f, s in map(draws, d) if f is not None}  # noqa: E731
    skips = lambda d: [s for _, s in map(draws, d)]  # noqa: E731
    assert firsts(got) == firsts(want) == set(range(1, 6))
    assert set(skips(got)) == set(skips(want)) == set(range(0, 12))
    counts = torch.bincount(torch.tensor(skips(got)), minlength=12).float()
    assert counts.min() > 0.8 * counts.mean() and counts.max() < 1.2 * counts.mean()  # uniform like randint


def test_uniform_lengths_get_pose_positions_of_their_length():
    p = plan(length_schedule="uniform")
    for step in range(1, 30):
        length = p.length(step)
        positions = p.positions(length, torch.device("cpu"))
        assert positions.shape == (length,) and int(positions[-1]) < 20


def test_pose_trains_resumes_bitwise_and_changes_the_losses(tmp_path, in_temp_cwd):
    import shutil

    run = tmp_path / "pose"
    pose = [*TINY, "pos=rope", "train.position_skip=512", "train.ckpt_every=2", "device=cpu"]
    code, _, err = run_in_process("train", *pose, f"hydra.run.dir={run}")
    assert code == 0, err
    resumed = tmp_path / "resumed"
    shutil.copytree(run, resumed)
    (resumed / "checkpoint.pt").unlink()
    code, _, err = run_in_process("train", f"resume={resumed}")
    assert code == 0, err
    assert [m["loss"] for m in metrics(resumed)] == [m["loss"] for m in metrics(run)]
    want, got = final_weights(run), final_weights(resumed)
    assert all(torch.equal(want[k], got[k]) for k in want)
    plain = tmp_path / "plain"
    code, _, err = run_in_process("train", *[o for o in pose if "position_skip" not in o], f"hydra.run.dir={plain}")
    assert code == 0, err
    assert metrics(plain)[0]["loss"] != metrics(run)[0]["loss"]  # the skipped positions reached the model


@pytest.mark.parametrize("overrides, message", [
    (["train.position_skip=16"], "train.position_skip=16 is below train.seq_len=32"),
    (["train.position_skip=256", "train.randomized_positions=256"],
     "train.position_skip (PoSE) and train.randomized_positions both choose each batch's positions; set one of them"),
    (["train.position_skip=256", "pos=none"], "train.position_skip applies to schemes whose logits read position values; pos=none does not"),
    (["train.position_skip=256", "pos=fox"], "train.position_skip applies to schemes whose logits read position values; pos=fox does not"),
    (["train.position_skip=256", "pos=learned", "pos.max_positions=100"],
     "train.position_skip=256 draws positions up to 255: pos=learned has a table of 100 positions"),
    (["train.position_skip=long"], "train.position_skip must be an integer or null, got 'long'"),
])
def test_bad_position_skip_is_one_line_and_leaves_only_the_failure(tmp_path, overrides, message, in_temp_cwd):
    run = tmp_path / "r"
    code, _, err = run_in_process("train", *TINY, "device=cpu", *overrides, f"hydra.run.dir={run}")
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (run / "config.yaml").exists() and not list(run.glob("checkpoint*"))
