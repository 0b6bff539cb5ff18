"""The `relpos` model of lm-evaluation-harness (relpos_cli/lm_eval_model.py), offline: a custom task
written here (loglikelihood, loglikelihood_rolling, generate_until on a tiny jsonl dataset) run
through lm_eval.simple_evaluate on a trained tiny run, its numbers computed again here from
load_run's model; the same task on an imported tiny Llama against lm-eval's own `hf` model on its
Hugging Face dir; eval-time extension settings and bad model_args.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")

from conftest import REPO, TINY, run_in_process  # noqa: E402
from relpos_cli.checkpoint import load_run  # noqa: E402
from relpos_cli.errors import RelposError  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

pytestmark = pytest.mark.usefixtures("in_temp_cwd")

# contexts and continuations of a few bytes up to past 32 tokens (TINY's train.seq_len): left-truncated
DOCS = [
    {"context": "def main(", "continuation": "self):", "text": "import os\n"},
    {"context": "class A:\n    ", "continuation": "pass", "text": "def f(x):\n    return x + 1\n" * 3},
    {"context": "import sys\nimport os\nfrom pathlib import Path\n", "continuation": "\ndef run():",
     "text": "x = 1\n"},
]
KINDS = {
    "loglikelihood": 'doc_to_text: "{{context}}"\ndoc_to_target: "{{continuation}}"\nmetric_list:\n  - metric: acc\n',
    "loglikelihood_rolling": 'doc_to_text: ""\ndoc_to_target: "{{text}}"\nmetric_list:\n  - metric: word_perplexity\n',
    "generate_until": ('doc_to_text: "{{context}}"\ndoc_to_target: "{{continuation}}"\n'
                       'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 6\n  do_sample: false\n'
                       'metric_list:\n  - metric: exact_match\n'),
}


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> Path:
    """A dir of three lm-eval task yamls (relpos_test_<output type>) over one jsonl file."""
    root = tmp_path_factory.mktemp("tasks")
    data = root / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    for kind, body in KINDS.items():
        (root / f"{kind}.yaml").write_text(
            f"task: relpos_test_{kind}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
            f"test_split: test\noutput_type: {kind}\n{body}")
    return root


def responses(tasks: Path, model: str, model_args: str, kinds=tuple(KINDS)) -> dict[str, list]:
    """Each task's responses, in the order of DOCS: (loglikelihood, is_greedy), a loglikelihood, a string."""
    import lm_eval.models  # noqa: F401  lm-eval's own models (hf), as its command line has them
    import relpos_cli.lm_eval_model  # noqa: F401  registers `relpos`

    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[f"relpos_test_{k}" for k in kinds],
                                  task_manager=TaskManager(include_path=str(tasks)), log_samples=True,
                                  device="cpu", bootstrap_iters=0)
    found = {}
    for kind in kinds:
        samples = sorted(out["samples"][f"relpos_test_{kind}"], key=lambda s: s["doc_id"])
        found[kind] = [s["resps"][0][0] for s in samples]
    return found


def loglikelihood(model, ids: list[int], n: int, window: int) -> float:
    """log p(last n of ids | the ids before them), the model run once on the `window` ids before the last."""
    inputs = torch.tensor([ids[:-1][-window:]])
    with torch.no_grad():
        logp = model(inputs)[0].log_softmax(-1)  # (T, V)
    targets = ids[-n:]
    return sum(float(logp[logp.shape[0] - n + j, t]) for j, t in enumerate(targets))


def rolling(model, eos: int, ids: list[int], window: int) -> float:
    """log p(ids | the end token): predictions in chunks of `window` tokens, each chunk read from
    the `window` tokens before its last prediction."""
    sequence = [eos, *ids]
    total = 0.0
    for start in range(0, len(ids), window):
        end = min(start + window, len(ids))
        total += loglikelihood(model, sequence[:end + 1], end - start, window)
    return total


def test_trained_run_scores_what_its_model_computes(tiny_run, tasks):
    """Every loglikelihood lm-eval reports is log p(continuation | context) from load_run's model,
    contexts past 32 tokens cut from the left; generation is greedy decoding cut at the newline."""
    got = responses(tasks, "relpos", f"run={tiny_run},batch_size=2")
    model, tokenizer, cfg = load_run(tiny_run)
    window = int(cfg.train.seq_len)
    for doc, (ll, greedy) in zip(DOCS, got["loglikelihood"]):
        ids = tokenizer.encode(doc["context"] + doc["continuation"])  # bytes: the context's ids come first
        # lm-eval scores the context's trailing spaces with the continuation, for every model
        scored = len(doc["continuation"]) + len(doc["context"]) - len(doc["context"].rstrip())
        assert ll == pytest.approx(loglikelihood(model, ids, scored, window), abs=1e-4)
        assert isinstance(greedy, bool)
    assert len(DOCS[2]["context"]) > window  # the case that cuts the context
    for doc, ll in zip(DOCS, got["loglikelihood_rolling"]):
        assert ll == pytest.approx(rolling(model, tokenizer.eos_id, tokenizer.encode(doc["text"]), window), abs=1e-4)
    assert len(DOCS[1]["text"]) > window  # more than one rolling window
    for doc, text in zip(DOCS, got["generate_until"]):
        ids = tokenizer.encode(doc["context"])[-(window - 6):]
        new = []
        with torch.no_grad():
            for _ in range(6):
                token = int(model(torch.tensor([ids + new])[:, -window:])[0, -1].argmax())
                if token == tokenizer.eos_id:
                    break
                new.append(token)
        assert text == tokenizer.decode(new).split("\n")[0]
