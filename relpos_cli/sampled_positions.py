"""Position ids drawn for a window in place of 0..T-1, at training (train.randomized_positions,
train.position_skip) and in eval-task's randomized protocol (task.eval_positions=randomized):

- randomized positions (Ruoss et al. 2023, google-deepmind/randomized_positional_encodings): a sorted
  sample of T distinct positions from [0, N);
- PoSE (Zhu et al. 2024, dwzhu-pku/PoSE ``train_preprocess_function_pose``): the window in two
  chunks, the second moved up by a skip.
"""

from __future__ import annotations

import torch


def random_positions(limit: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """(length,) sorted distinct positions drawn uniformly from [0, limit) (Ruoss et al. 2023)."""
    return torch.randperm(limit, generator=generator)[:length].sort().values


def pose_positions(target: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """(length,) positions of PoSE (Zhu et al. 2024, dwzhu-pku/PoSE ``train_preprocess_function_pose``):
    the window in two chunks, the first of 1..(length + 1) // 2 tokens at 0, 1, ..., the second
    moved up by a skip of 0..target - length, so the positions reach up to target - 1 while the
    window keeps its length; both drawn uniformly, as the reference's random.randint (both ends in)."""
    first = int(torch.randint(1, (length + 1) // 2 + 1, (1,), generator=generator))
    skip = int(torch.randint(0, target - length + 1, (1,), generator=generator))
    return pose_position_ids(length, first, skip)


def pose_position_ids(length: int, first: int, skip: int) -> torch.Tensor:
    """0..length-1 with the positions from `first` on moved up by `skip`."""
    positions = torch.arange(length)
    positions[first:] += skip
    return positions
