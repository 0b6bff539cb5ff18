"""Tests written to kill mutants that the rest of the suite let live (a mutation audit). Each checks a
documented property against a brute-force computation or a reference implementation, never a value
copied from the code under test. The mutant each one kills is named in its docstring."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from relpos_cli.intervals import separated
from relpos_cli.positions import build_scheme
from relpos_cli.positions.base import ModelShape
from relpos_cli.positions.rope import rope_inv_freq
from relpos_cli.tasks.base import Encoder
from relpos_cli.tasks.passkey import Passkey
from relpos_cli.tokenizers import ByteTokenizer


# ---- intervals.separated: closed intervals that touch overlap -------------------------------------

def test_separated_is_false_for_intervals_sharing_a_point():
    """Mutant killed: ``best[0] >= other[1]`` (touching intervals counted as told apart). The
    intervals are closed: two cells are separated only if no accuracy lies in both. Brute force over
    endpoints on a grid of eighths (exact in binary floating point)."""
    grid = [i / 8 for i in range(9)]
    for b0 in grid:
        for b1 in (x for x in grid if x >= b0):
            for o0 in grid:
                for o1 in (x for x in grid if x >= o0):
                    share_a_point = any(b0 <= x <= b1 and o0 <= x <= o1 for x in grid)
                    best_above = b0 >= o0  # separated asks whether the best cell stands above the other
                    if best_above:
                        assert separated((b0, b1), (o0, o1)) == (not share_a_point), ((b0, b1), (o0, o1))


# ---- CoPE: every key before far_keys' split has a saturated count --------------------------------

COPE_SHAPE = ModelShape(d_model=64, n_heads=4, n_layers=2, train_seq_len=32)


def brute_force_counts(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """p_ij = sum_{t=j..i} sigmoid(q_i . k_t / sqrt(d)), the paper's definition, one pair at a time."""
    B, H, Tq, D = q.shape
    out = torch.zeros(B, H, Tq, k.shape[-2], dtype=torch.float64)
    q, k = q.double(), k.double()
    for a in range(Tq):
        i = int(q_pos[a])
        for j in range(k.shape[-2]):
            if int(k_pos[j]) > i:
                continue
            ts = [t for t in range(k.shape[-2]) if int(k_pos[j]) <= int(k_pos[t]) <= i]
            gates = torch.sigmoid((q[:, :, a, None, :] * k[:, :, ts, :]).sum(-1) / math.sqrt(D))
            out[:, :, a, j] = gates.sum(-1)
    return out


def cope_case(gate: float | None, seed: int, n_keys: int, n_queries: int, max_positions: int):
    torch.manual_seed(seed)
    cope = build_scheme({"name": "cope", "max_positions": max_positions}, COPE_SHAPE)
    torch.nn.init.normal_(cope.pos_emb)
    D = COPE_SHAPE.head_dim
    if gate is None:  # random content
        q = torch.randn(1, COPE_SHAPE.n_heads, n_queries, D)
        k = torch.randn(1, COPE_SHAPE.n_heads, n_keys, D)
    else:  # every gate sigmoid(q . k / sqrt(D)) equal to `gate`
        u = torch.nn.functional.normalize(torch.randn(D), dim=0)
        logit = math.log(gate / (1 - gate))
        q = u.expand(1, COPE_SHAPE.n_heads, n_queries, D).clone()
        k = (u * logit * math.sqrt(D)).expand(1, COPE_SHAPE.n_heads, n_keys, D).clone()
    k_pos = torch.arange(n_keys)
    q_pos = k_pos[-n_queries:]
    return cope, q, k, q_pos, k_pos


@pytest.mark.parametrize("gate, seed", [(0.38, 0), (None, 0), (None, 1), (None, 2)])
def test_cope_far_keys_are_only_keys_whose_count_is_saturated(gate, seed):
    """Mutant killed: far_keys accepting a window once the counts reach max_positions - 2 (one short).
    Keys before the split far_keys returns get far_bias, q . e[max_positions - 1], in evaluation:
    that is right only if their count p_ij (brute force from the paper's definition) has reached
    max_positions - 1 for every query of the block. With every gate 0.38 and max_positions 8 the
    window of 16 keys before the block sums to 6.46 for its first query: not yet saturated."""
    max_positions, n_keys, n_queries = 8, 100, 10
    cope, q, k, q_pos, k_pos = cope_case(gate, seed, n_keys, n_queries, max_positions)
    with torch.no_grad():
        split = cope.far_keys(0, q, k, q_pos, k_pos)
        counts = brute_force_counts(q, k, q_pos, k_pos)
        assert bool((counts[..., :split] >= max_positions - 1 - 1e-9).all()), split
        # and what evaluation adds for those keys is the whole-row bias there
        if split:
            rows = cope.content_bias(0, q, k, q_pos, k_pos)
            far = cope.far_bias(0, q, q_pos)
            assert torch.allclose(rows[..., :split], far[..., None].expand_as(rows[..., :split]), atol=1e-5)


# ---- passkey: min_length covers the keys build draws ----------------------------------------------

class SevensTwice(ByteTokenizer):
    """Bytes, except that the digit 7 takes two tokens: keys of the same digit count then take
    different numbers of tokens, as digit strings do under BPE."""

    def encode(self, text: str) -> list[int]:
        out = []
        for b in text.encode("utf-8"):
            out += [b, b] if b == ord("7") else [b]
        return out

    encode_segment = encode


def test_passkey_min_length_fits_nearly_every_key():
    """Mutant killed: min_length taking the shortest of its sample keys instead of the longest. The
    docstring's promise: min_length is the longest fixed part of 64 sample keys, so a key that needs
    more (to be redrawn by build) is rare; at min_length() almost every random key must fit. With
    the shortest, only keys without a 7 fit (about 0.9^4 * 8/9 ~ 58%), and build at min_length
    would quietly draw only those."""
    task = Passkey(Encoder(SevensTwice()), digits=5)
    shortest = task.min_length()
    rng = np.random.default_rng(123)
    keys = [str(int(rng.integers(10**4, 10**5))) for _ in range(2000)]
    fixed = [len(task.encoder(f"\nThe pass key is {k}. Remember it. {k} is the pass key.\n"))
             + len(task.encoder("\nWhat is the pass key? The pass key is ")) + len(task.encoder(k)) for k in keys]
    assert np.mean([f <= shortest for f in fixed]) >= 0.9
    # and build at that length still draws keys containing a 7
    drawn = [task.build(np.random.default_rng(s), shortest, 0.5) for s in range(40)]
    assert any("7" in task.encoder.decode(ex.input_ids[slice(*ex.answer_spans[0])]) for ex in drawn)


# ---- llama3 RoPE scaling against transformers, a wavelength on the band's edge ---------------------

transformers = pytest.importorskip("transformers")


def hf_llama3(head_dim: int, base: float, params: dict) -> torch.Tensor:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, max_position_embeddings=params[
        "original_max_position_embeddings"], rope_parameters={**params, "rope_theta": base})
    return ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")[0]


def plain_wavelengths(head_dim: int, base: float) -> torch.Tensor:
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    return 2 * math.pi / inv_freq


@pytest.mark.parametrize("head_dim, base, original, factor, low, high", [
    (16, 10000.0, 128, 8.0, 1.0, 4.0),
    (64, 500000.0, 8192, 8.0, 1.0, 4.0),
    (16, 10000.0, 128, 8.0, "edge3", 4.0),  # a wavelength exactly at original / low_freq_factor
    (16, 10000.0, 128, 4.0, 0.5, "edge1"),  # a wavelength exactly at original / high_freq_factor
])
def test_llama3_matches_transformers_including_the_band_edges(head_dim, base, original, factor, low, high):
    """Mutant killed: the medium band's bounds made strict (> and <). transformers'
    _compute_llama3_parameters keeps a wavelength equal to original / low_freq_factor in the band
    (divided by the factor there); a strict bound leaves it unscaled. The llama3 frequencies had no
    comparison with transformers elsewhere (test_rope_scaling covers linear, dynamic, yarn)."""
    wavelength = plain_wavelengths(head_dim, base)
    if low == "edge3":
        low = original / float(wavelength[3])
    if high == "edge1":
        high = original / float(wavelength[1])
    params = {"rope_type": "llama3", "factor": factor, "original_max_position_embeddings": original,
              "low_freq_factor": low, "high_freq_factor": high}
    ours, scale = rope_inv_freq(head_dim, base, params)
    assert torch.allclose(ours, hf_llama3(head_dim, base, params), rtol=1e-6, atol=0)
    assert scale == 1.0


# ---- eval-length's bits per byte: the bytes of the scored targets -----------------------------------

def test_eval_tokens_counts_the_bytes_of_the_targets_not_the_inputs():
    """Mutant killed: the bytes counted over tokens[:-1] (the inputs) instead of tokens[1:] (the
    targets the loss is over). test_cli's BPE run does not see it when the first and the last token
    happen to decode to as many bytes. Here token t decodes to t % 5 + 1 bytes, so every shift shows."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from relpos_cli.evaluate import eval_tokens

    validation = np.arange(3, 300, dtype=np.uint16)
    token_bytes = np.arange(400) % 5 + 1
    data = SimpleNamespace(validation=validation, token_bytes=token_bytes)
    n = 101
    assert token_bytes[validation[0]] != token_bytes[validation[n]]  # inputs and targets differ in bytes
    tokens, scored_bytes = eval_tokens(OmegaConf.create({"eval": {"tokens": n}}), data, longest=64)
    assert tokens.tolist() == validation[: n + 1].tolist()
    targets = [int(t) for t in validation[1 : n + 1]]  # what position p predicts: token p + 1
    assert scored_bytes == sum(t % 5 + 1 for t in targets)
