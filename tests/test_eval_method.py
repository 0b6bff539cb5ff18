"""The evaluation method is part of the model a run dir describes: a length-dependent training
scaling (pos.scaling.type=dynamic) and the eval-time settings (eval.rope_scaling, eval.self_extend,
eval.rerope, eval.sinks) give the same model in load_run, sample, eval-length and eval-task.

Before the method became a value the model is built with, only eval-length and eval-task set it (a
side channel on the scheme), so load_run and sample ran dynamic NTK frozen at the training length
and ignored eval-time methods altogether.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from conftest import redraw_weights, run_in_process, tiny_trained
from relpos_cli.checkpoint import load_run
from relpos_cli.data import load_token_data
from relpos_cli.errors import RelposError
from relpos_cli.sample import generate, sample_run

pytestmark = pytest.mark.usefixtures("in_temp_cwd")
TRAIN_LEN = 32  # TINY's train.seq_len
SELF_EXTEND = ["eval.self_extend.group=4", "eval.self_extend.window=8"]


@pytest.fixture(scope="module")
def dynamic_run(tmp_path_factory):
    """A RoPE run trained with dynamic NTK scaling (factor 1: base x (L / 32)^(d / (d - 2)) past 32),
    its weights drawn again so positions move the logits."""
    return redraw_weights(tiny_trained(tmp_path_factory, "pos=rope", "pos.scaling.type=dynamic"))


@pytest.fixture(scope="module")
def rope_run(tmp_path_factory):
    return redraw_weights(tiny_trained(tmp_path_factory, "pos=rope"))


def tokens_of(run_dir, n: int) -> torch.Tensor:
    """The run's first n validation tokens, (1, n): what eval-length scores first."""
    cfg = OmegaConf.load(run_dir / "config.yaml")
    data = load_token_data(OmegaConf.to_container(cfg.data, resolve=True))
    return torch.as_tensor(data.validation[:n].astype("int64"))[None]


@torch.no_grad()
def test_load_run_scales_dynamic_ntk_by_the_length_it_is_called_on(dynamic_run):
    """Dynamic NTK at 4 x 32 tokens is static NTK with factor 4 (alpha = L / L_train), a model
    eval.rope_scaling builds through another path; at 32 tokens it is no scaling at all."""
    tokens = tokens_of(dynamic_run, 4 * TRAIN_LEN)
    dynamic, _, _ = load_run(dynamic_run)
    static, _, _ = load_run(dynamic_run, overrides=["eval.rope_scaling.type=ntk", "eval.rope_scaling.factor=4"])
    torch.testing.assert_close(dynamic(tokens), static(tokens), rtol=1e-4, atol=1e-4)
    plain, _, _ = load_run(dynamic_run, overrides=["eval.rope_scaling.type=linear", "eval.rope_scaling.factor=1"])
    short = tokens[:, :TRAIN_LEN]
    torch.testing.assert_close(dynamic(short), plain(short), rtol=1e-5, atol=1e-5)
    assert (dynamic(tokens) - plain(tokens)).abs().max() > 0.1  # the 4x case above tests something


@pytest.mark.parametrize("which, overrides", [
    ("dynamic_run", []),
    ("rope_run", SELF_EXTEND),
    ("rope_run", ["eval.sinks.count=2", "eval.sinks.window=16"]),
    ("rope_run", ["eval.rope_scaling.type=yarn"]),  # factor=auto: 4 at 4 x 32 tokens
])
def test_eval_length_scores_the_model_load_run_returns(which, overrides, request):
    """eval-length's loss over one window of 128 tokens equals the mean cross-entropy of load_run's
    model (same overrides) on those tokens, computed here."""
    run_dir = request.getfixturevalue(which)
    length = 4 * TRAIN_LEN
    code, _, err = run_in_process("eval-length", str(run_dir), f"eval.lengths=[{length}]", f"eval.tokens={length}",
                                  *overrides)
    assert code == 0, err
    variant = sorted(run_dir.glob("eval_length*.json"), key=lambda p: p.stat().st_mtime)[-1]
    scored = next(r for r in json.loads(variant.read_text()) if r["length"] == length)
    model, _, _ = load_run(run_dir, overrides=overrides)
    tokens = tokens_of(run_dir, length + 1)
    with torch.no_grad():
        loss = F.cross_entropy(model(tokens[:, :-1])[0], tokens[0, 1:])
    assert scored["loss"] == pytest.approx(float(loss), rel=1e-5)
    if overrides:  # the settings change the model: equality above is no accident of a method left out
        plain, _, _ = load_run(run_dir)
        with torch.no_grad():
            plain_loss = F.cross_entropy(plain(tokens[:, :-1])[0], tokens[0, 1:])
        assert abs(float(plain_loss) - float(loss)) > 1e-3


def test_sample_generates_from_the_model_load_run_returns(rope_run):
    """relpos sample with eval overrides is greedy decoding of load_run's model with the same overrides."""
    model, tokenizer, _ = load_run(rope_run, overrides=SELF_EXTEND)
    prompt = [tokenizer.eos_id, *tokenizer.encode("def main(self):\n    return ")]
    want = tokenizer.decode(list(generate(model, prompt, 40, context=64, stop_id=tokenizer.eos_id)))
    got = "".join(sample_run(rope_run, "def main(self):\n    return ", 40, 0.0, 0, 0, 64, "cpu", SELF_EXTEND))
    assert got == want
    plain = "".join(sample_run(rope_run, "def main(self):\n    return ", 40, 0.0, 0, 0, 64, "cpu"))
    plain_model, _, _ = load_run(rope_run)
    assert plain == tokenizer.decode(list(generate(plain_model, prompt, 40, context=64, stop_id=tokenizer.eos_id)))


@pytest.mark.parametrize("args, message", [
    (["train.steps=3"], "relpos sample takes only eval.* overrides"),
    (["eval.self_extend.group=4"], "eval.self_extend"),  # no window
    (["eval.rerope.window=8", "eval.self_extend.group=2", "eval.self_extend.window=4"], "separate methods"),
    (["eval.rope_scaling.type=warp"], "eval.rope_scaling.type='warp'"),
])
def test_sample_refuses_bad_eval_settings_in_one_line(rope_run, args, message):
    code, out, err = run_in_process("sample", str(rope_run), "-p", "x", "-n", "2", *args)
    assert code != 0
    assert message in err and "Traceback" not in err + out and len(err.strip().splitlines()) == 1


def test_load_run_refuses_keys_other_than_eval(rope_run):
    with pytest.raises(RelposError, match="takes only eval"):
        load_run(rope_run, overrides=["train.seq_len=64"])


def test_an_alibi_run_refuses_rope_scaling_when_loaded(tiny_run):
    """The model is built with the method, so a method that does not apply to the scheme is refused
    wherever the run is loaded, not only by eval-length."""
    with pytest.raises(RelposError, match="eval.rope_scaling applies to schemes that rotate"):
        load_run(tiny_run, overrides=["eval.rope_scaling.type=linear"])


def test_factor_longest_is_resolved_from_the_eval_lengths_for_load_run(rope_run):
    """factor=longest means the longest eval length / L_train: load_run resolves it from eval.lengths."""
    tokens = tokens_of(rope_run, 4 * TRAIN_LEN)
    longest, _, _ = load_run(rope_run, overrides=["eval.rope_scaling.type=linear", "eval.rope_scaling.factor=longest",
                                                  "eval.lengths=[64,128]"])
    fixed, _, _ = load_run(rope_run, overrides=["eval.rope_scaling.type=linear", "eval.rope_scaling.factor=4"])
    with torch.no_grad():
        torch.testing.assert_close(longest(tokens), fixed(tokens), rtol=1e-6, atol=1e-6)
    assert math.isclose(longest.scheme.frequencies_at(16)[0][-1], fixed.scheme.frequencies_at(16)[0][-1])


@pytest.mark.parametrize("factor", [1.0, 2.0])
def test_an_imported_llama_with_dynamic_scaling_matches_transformers_past_its_context(factor):
    """transformers' dynamic rope rescales by the sequence it is called on; so does the converted
    model, at 2x max_position_embeddings, without any command configuring it first."""
    transformers = pytest.importorskip("transformers")
    from test_families import LLAMA, VOCAB, converted, random_hf_model

    hf = random_hf_model(transformers.LlamaConfig, transformers.LlamaForCausalLM, rope_theta=500.0, **LLAMA,
                         rope_scaling={"rope_type": "dynamic", "factor": factor})
    ours, conversion = converted(hf)
    assert conversion.pos["scaling"]["type"] == "dynamic"
    tokens = torch.randint(0, VOCAB, (1, 2 * LLAMA["max_position_embeddings"]), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), hf(tokens).logits, rtol=1e-4, atol=1e-4)
