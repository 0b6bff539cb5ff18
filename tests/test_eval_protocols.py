"""Evaluation protocols: coverage, per-position counts and losses against brute-force references."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from omegaconf import OmegaConf

from relpos_cli.config import default_group
from relpos_cli.errors import RelposError
from relpos_cli.evaluate import check_stride, score_windows, variant_settings, window_plan
from relpos_cli.results import variant_tag
from relpos_cli.settings import EvalSettings
from relpos_cli.model import build_model

VOCAB = 50


def tiny_model(pos: str = "alibi", seed: int = 0):
    torch.manual_seed(seed)
    cfg = {"model": {"d_model": 16, "n_layers": 2, "n_heads": 2, "mlp_ratio": 2}, "pos": {"name": pos}, "train": {"seq_len": 16}}
    return build_model(cfg, VOCAB).eval()


def stream(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n + 1,), generator=torch.Generator().manual_seed(seed))


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 400), length=st.integers(1, 64), stride_frac=st.floats(0.01, 1.0))
def test_every_target_scored_exactly_once_with_enough_context(n, length, stride_frac):
    stride = max(1, int(length * stride_frac))
    if n < length:
        with pytest.raises(RelposError):
            window_plan(n, length, stride)
        return
    hits = np.zeros(n, dtype=int)
    for i, (start, first) in enumerate(window_plan(n, length, stride)):
        assert 0 <= start and start + length <= n  # full-length windows inside the stream
        assert first == 0 if i == 0 else first >= length - stride  # >= L - S tokens of context
        hits[start + first : start + length] += 1
    assert (hits == 1).all()


@pytest.mark.parametrize("pos", ["alibi", "rope", "learned"])
def test_nonoverlapping_matches_a_reshape_reference(pos):
    model, tokens, length = tiny_model(pos), stream(256), 32
    loss_sum, count = score_windows(model, tokens, length, length, max_tokens_per_batch=64)  # 2 windows per batch
    with torch.no_grad():
        ref = model.loss(tokens[:-1].view(-1, length), tokens[1:].view(-1, length), reduction="none").double()  # (W, L)
    assert (count == 256 // length).all()
    np.testing.assert_allclose(loss_sum, ref.sum(0).numpy(), rtol=1e-5)


def test_sliding_stride_one_matches_brute_force():
    model, n, length = tiny_model("t5"), 60, 16
    tokens = stream(n, seed=1)
    loss_sum, count = score_windows(model, tokens, length, 1, max_tokens_per_batch=100)
    ref_sum, ref_count = np.zeros(length), np.zeros(length, dtype=int)
    with torch.no_grad():
        window = model.loss(tokens[None, :length], tokens[None, 1 : length + 1], reduction="none")[0]
        ref_sum += window.double().numpy()
        ref_count += 1
        for t in range(length, n):  # target t sees exactly the L-1 tokens before it
            x = tokens[None, t - length + 1 : t + 1]
            ref_sum[-1] += model.loss(x, tokens[None, t - length + 2 : t + 2], reduction="none")[0, -1].item()
            ref_count[-1] += 1
    assert (count == ref_count).all()
    np.testing.assert_allclose(loss_sum, ref_sum, rtol=1e-5)


def test_stride_equal_to_length_is_nonoverlapping_exactly():
    """Sliding with S = L scores the plain reshape into windows, bit for bit (one batch for both)."""
    model, tokens, length = tiny_model("rope"), stream(320, seed=2), 64
    loss_sum, count = score_windows(model, tokens, length, stride=length, max_tokens_per_batch=4096)
    with torch.no_grad():
        ref = model.loss(tokens[:-1].view(-1, length), tokens[1:].view(-1, length), reduction="none").double()
    assert np.array_equal(loss_sum, ref.sum(0).numpy()) and (count == 5).all()
    # a partial last window (300 targets) is the final L tokens scoring only the 44 new ones
    assert window_plan(300, 64, 64) == [(0, 0), (64, 0), (128, 0), (192, 0), (236, 20)]


@pytest.mark.parametrize("stride", [None, 8])
def test_coverage_equal_across_lengths_and_counts_add_up(stride):
    model, tokens = tiny_model("alibi"), stream(200, seed=3)
    for length in (16, 32, 64, 100):
        _, count = score_windows(model, tokens, length, stride or length, max_tokens_per_batch=128)
        assert count.sum() == 200 and count.shape == (length,)


def eval_cfg(**changes):
    cfg = OmegaConf.create({"eval": default_group("eval"), "train": {"seq_len": 32}})
    for k, v in changes.items():
        OmegaConf.update(cfg, f"eval.{k}", v, force_add=True)
    return cfg


def test_variants_are_generic_diffs_against_the_defaults():
    assert variant_tag(variant_settings(eval_cfg(lengths=[32, 64], tokens=999, max_tokens_per_batch=7).eval)) == "default"
    sliding = variant_settings(eval_cfg(protocol="sliding", stride=16).eval)
    assert sliding == {"protocol": "sliding", "stride": 16}
    assert variant_tag(sliding) == "protocol=sliding,stride=16"
    nested = eval_cfg(**{"some_scaling.type": "yarn", "some_scaling.factor": 4.0}).eval  # keys unknown to this branch
    assert variant_tag(variant_settings(nested)) == "some_scaling.factor=4,some_scaling.type=yarn"  # 4.0 and 4: one setting


def check_eval_config(cfg):
    OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(EvalSettings), cfg.eval))  # the schema's checks
    return check_stride(cfg)


def test_bad_protocol_settings_are_clear_errors():
    with pytest.raises(RelposError, match="needs a positive eval.stride"):
        check_eval_config(eval_cfg(protocol="sliding"))
    with pytest.raises(RelposError, match="applies only to eval.protocol=sliding"):
        check_eval_config(eval_cfg(stride=8))
    with pytest.raises(RelposError, match="longer than eval lengths"):
        check_eval_config(eval_cfg(protocol="sliding", stride=64, lengths=[32, 128]))
    with pytest.raises(RelposError, match="choose one of"):
        check_eval_config(eval_cfg(protocol="strided"))


def brute_force_context_loss(model, tokens: torch.Tensor, window: int, longest: int, stride: int) -> tuple[float, int]:
    """Mean loss over targets t >= longest, each predicted from the `window` tokens that end where its
    stride block ends (blocks of `stride` targets from `longest` on, the last one ragged), one forward
    per target on exactly the tokens it may see."""
    n = len(tokens) - 1
    total, count = 0.0, 0
    with torch.no_grad():
        for t in range(longest, n):
            end = min(longest + ((t - longest) // stride + 1) * stride, n)  # the block's window ends here
            context = tokens[end - window : t + 1]  # the window's tokens up to and including target t's input
            total += model.loss(context[None], tokens[None, end - window + 1 : t + 2], reduction="none")[0, -1].item()
            count += 1
    return total / count, count


@pytest.mark.parametrize("pos, length, train_len, stride", [("alibi", 48, 16, 8), ("rope", 40, 16, 16), ("t5", 16, 32, 8)])
def test_context_use_against_brute_force(pos, length, train_len, stride):
    from relpos_cli.evaluate import context_use

    model, tokens = tiny_model(pos), stream(150, seed=4)
    got = context_use(model, tokens, length, train_len, stride, max_tokens_per_batch=64)
    longest = max(length, train_len)
    long_loss, count = brute_force_context_loss(model, tokens, length, longest, stride)
    short_loss, _ = brute_force_context_loss(model, tokens, train_len, longest, stride)
    assert got["context_tokens"] == count == 150 - longest
    assert got["context_loss"] == pytest.approx(long_loss, rel=1e-5)
    assert got["context_loss_train_window"] == pytest.approx(short_loss, rel=1e-5)
    assert got["context_gain"] == pytest.approx(short_loss - long_loss, abs=1e-5)
    assert context_use(model, tokens, train_len, train_len, stride, 64)["context_gain"] == 0.0  # L = L_train


def test_context_use_needs_the_sliding_protocol():
    with pytest.raises(RelposError, match="eval.context_use=true compares sliding windows"):
        check_eval_config(eval_cfg(context_use=True))
    assert check_eval_config(eval_cfg(context_use=True, protocol="sliding", stride=16)) == 16
