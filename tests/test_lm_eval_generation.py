"""The `relpos` lm-eval model (relpos_cli/lm_eval_model.py) at its edges: sampled requests lm-eval
repeats, generation settings HF's generate refuses, and the rolling loglikelihood against
eval-length's own loss on the same validation tokens."""

from __future__ import annotations

import csv
import math

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")

from conftest import run_in_process  # noqa: E402
from relpos_cli.checkpoint import load_run  # noqa: E402
from relpos_cli.errors import RelposError  # noqa: E402

pytestmark = pytest.mark.usefixtures("in_temp_cwd")


def requests(context: str, copies: int, **gen_kwargs):
    from lm_eval.api.instance import Instance

    settings = {"until": ["\n"], "max_gen_toks": 8, **gen_kwargs}
    return [Instance("generate_until", {}, (context, settings), i) for i in range(copies)]


def test_repeated_sampled_requests_are_different_samples_and_follow_torchs_seed(tiny_run):
    """lm-eval runs a task's `repeats` (self-consistency, pass@k) as copies of one request: sampled,
    they must be independent draws, as hf's are (they were the same seed-0 draw every time), and the
    same again under the same torch seed (lm-eval's --seed)."""
    from relpos_cli.lm_eval_model import RelposLM

    lm = RelposLM.create_from_arg_string(f"run={tiny_run}", {"device": "cpu"})
    reqs = requests("def main(", 6, do_sample=True, temperature=1.0, until=[])
    torch.manual_seed(1234)
    first = lm.generate_until(reqs)
    assert len(set(first)) > 1, first  # 8 tokens sampled at temperature 1 from an all-but-untrained model
    torch.manual_seed(1234)
    assert lm.generate_until(reqs) == first
    greedy = lm.generate_until(requests("def main(", 2, do_sample=False, until=[]))
    assert greedy[0] == greedy[1]


@pytest.mark.parametrize("gen_kwargs, message", [
    ({"do_sample": True, "temperature": math.nan}, "do_sample=true needs a finite temperature > 0, got nan"),
    ({"do_sample": True, "temperature": math.inf}, "do_sample=true needs a finite temperature > 0, got inf"),
    ({"until": [5]}, "until must hold strings (stop sequences), got 5"),
    ({"until": None}, "until must hold strings (stop sequences), got None"),
])
def test_bad_generation_settings_are_one_line(tiny_run, gen_kwargs, message):
    """A nan temperature (HF's generate refuses it) crashed the sampler with torch's RuntimeError; a
    stop sequence that is not a string crashed with a TypeError: one line each."""
    from relpos_cli.lm_eval_model import RelposLM

    lm = RelposLM.create_from_arg_string(f"run={tiny_run}", {"device": "cpu"})
    with pytest.raises(RelposError) as e:
        lm.generate_until(requests("def main(", 1, max_gen_toks=4, **gen_kwargs))
    assert message in str(e.value) and len(str(e.value).splitlines()) == 1


def test_rolling_loglikelihood_is_eval_lengths_loss_on_the_same_tokens(tiny_run, tmp_path):
    """eval-length (nonoverlapping, L = train.seq_len) scores validation tokens 1..N from windows
    starting at token 0; lm-eval's rolling windows over the text of tokens 1..N are the same windows
    but the first, which reads the end token where eval-length reads token 0. Computed again here."""
    import shutil

    from omegaconf import OmegaConf

    from relpos_cli.data import load_token_data
    from relpos_cli.lm_eval_model import RelposLM

    run = shutil.copytree(tiny_run, tmp_path / "run")
    model, tokenizer, cfg = load_run(run)
    window, n = int(cfg.train.seq_len), 8 * int(cfg.train.seq_len)
    code, _, err = run_in_process("eval-length", str(run), f"eval.tokens={n}", f"eval.lengths=[{window}]")
    assert code == 0, err
    row = next(csv.DictReader(open(run / "eval_length.csv")))
    assert int(row["tokens"]) == n
    tokens = [int(t) for t in load_token_data(OmegaConf.to_container(cfg.data, resolve=True)).validation[:n + 1]]
    text = tokenizer.decode(tokens[1:])
    assert tokenizer.encode(text) == tokens[1:]

    def logp(inputs: list[int], targets: list[int]) -> float:
        with torch.no_grad():
            rows = model(torch.tensor([inputs]))[0].float().log_softmax(-1)
        return sum(float(rows[i, t]) for i, t in enumerate(targets))

    from lm_eval.api.instance import Instance

    lm = RelposLM.create_from_arg_string(f"run={run}", {"device": "cpu"})
    rolling = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])[0]
    first_window = logp(tokens[:window], tokens[1:window + 1]) - logp([tokenizer.eos_id, *tokens[1:window]],
                                                                     tokens[1:window + 1])
    assert -(rolling + first_window) / n == pytest.approx(float(row["loss"]), abs=1e-5)
