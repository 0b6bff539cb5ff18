"""relpos sample: greedy decoding against one teacher-forced forward pass, top-k and temperature by
their properties, the run's tokenizer, and the command line."""

import math

import pytest
import torch

from conftest import run_in_process
from relpos_cli.checkpoint import load_trained_model
from relpos_cli.sample import generate, next_token

pytestmark = pytest.mark.usefixtures("in_temp_cwd")
PROMPT = [0, *b"def main("]


@pytest.fixture(scope="module")
def model(tiny_run):
    return tiny_run, load_trained_model(tiny_run, torch.device("cpu"))[1]


@torch.no_grad()
def teacher_forced_logits(model, ids):
    """Logits after every prefix of ids, from one forward pass over all of them: (len(ids), V)."""
    return model(torch.tensor(ids)[None])[0]


def test_greedy_is_the_argmax_of_a_single_forward_pass(model):
    _, model = model
    new = list(generate(model, PROMPT, 24))
    logits = teacher_forced_logits(model, PROMPT + new)
    for i, token in enumerate(new):
        at = len(PROMPT) + i - 1  # the logits that predict new[i]
        assert token == int(logits[at].argmax()) or math.isclose(float(logits[at, token]), float(logits[at].max()), rel_tol=1e-6)


def test_top_k_1_is_greedy_and_samples_stay_in_the_top_k(model):
    _, model = model
    assert list(generate(model, PROMPT, 16, temperature=1.0, top_k=1, seed=3)) == list(generate(model, PROMPT, 16))
    k = 5
    new = list(generate(model, PROMPT, 32, temperature=1.5, top_k=k, seed=0))
    logits = teacher_forced_logits(model, PROMPT + new)
    for i, token in enumerate(new):
        row = logits[len(PROMPT) + i - 1]
        assert int((row > row[token]).sum()) < k  # fewer than k tokens are more likely than the one drawn


def test_sampling_is_reproducible_with_a_seed(model):
    _, model = model
    draw = lambda seed: list(generate(model, PROMPT, 32, temperature=1.0, top_k=50, seed=seed))  # noqa: E731
    assert draw(7) == draw(7)
    assert len({tuple(draw(s)) for s in range(4)}) > 1


def test_next_token_draws_from_the_tempered_top_k_softmax():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    temperature, k, n = 0.7, 3, 20000
    generator = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.tensor([next_token(logits, temperature, k, generator) for _ in range(n)]), minlength=5)
    weights = [math.exp(v / temperature) for v in (2.0, 1.0, 0.5)]
    expected = [w / sum(weights) for w in weights] + [0.0, 0.0]
    for got, want in zip((counts / n).tolist(), expected):
        assert abs(got - want) < 0.015


def test_a_tiny_temperature_is_greedy_not_nan():
    """logits / 1e-310 overflows to inf, and softmax(inf - inf) is NaN: the draw must be the argmax."""
    logits = torch.tensor([0.5, 2.0, 1.0, -3.0])
    generator = torch.Generator().manual_seed(0)
    assert {next_token(logits, 1e-310, k, generator) for k in (0, 2) for _ in range(20)} == {1}


def test_sample_command_prints_the_prompt_and_its_continuation(model):
    run_dir, net = model
    code, out, err = run_in_process("sample", str(run_dir), "--prompt", "def main(", "--max-new-tokens", "12")
    assert code == 0, err
    greedy = bytes(generate(net, PROMPT, 12, stop_id=0)).decode("utf-8", errors="replace")
    assert out.rstrip("\n") == "def main(" + greedy
    for args, fragment in ((["--max-new-tokens", "0"], "--max-new-tokens must be positive"),
                           (["--temperature", "-1"], "--temperature must be a finite number >= 0"),
                           (["--temperature", "nan"], "--temperature must be a finite number >= 0"),
                           (["--temperature", "inf"], "--temperature must be a finite number >= 0"),
                           (["--top-k", "999"], "--top-k must be between 0"),
                           (["--context", "0"], "--context must be positive")):
        code, _, err = run_in_process("sample", str(run_dir), *args)
        assert code == 2 and err.startswith("error: ") and fragment in err
    code, _, err = run_in_process("sample", str(run_dir.parent / "missing"))
    assert code == 2 and "run dir not found" in err
