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

from conftest import REPO, redraw_weights, tiny_trained  # noqa: E402
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


def test_imported_checkpoint_scores_as_lm_evals_hf_model(tasks, tmp_path):
    """A tiny random Llama: lm-eval's `hf` model on its Hugging Face dir and `relpos` on the run
    `relpos import` makes of it give the same loglikelihoods and the same generations (the run keeps
    the model's tokenizer; max_length 128 for both: its max_position_embeddings, the run's train.seq_len)."""
    pytest.importorskip("transformers")
    from test_import import save_tiny_llama
    from relpos_cli.importing import import_checkpoint

    llama = save_tiny_llama(tmp_path / "tiny-llama", eos_token_id=0)  # the tokenizer's end token
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(d["context"] + d["continuation"] + d["text"] for d in DOCS) * 20)
    run = import_checkpoint(str(llama), tmp_path / "run", ["data=text_files", f"data.files=[{corpus}]"])
    hf = responses(tasks, "hf", f"pretrained={llama},dtype=float32,max_length=128")
    ours = responses(tasks, "relpos", f"run={run}")
    for kind in ("loglikelihood", "loglikelihood_rolling"):
        want = [r[0] if isinstance(r, (tuple, list)) else r for r in hf[kind]]
        got = [r[0] if isinstance(r, (tuple, list)) else r for r in ours[kind]]
        assert got == pytest.approx(want, abs=1e-4), kind
    assert [r[1] for r in ours["loglikelihood"]] == [r[1] for r in hf["loglikelihood"]]
    assert ours["generate_until"] == hf["generate_until"]


@pytest.fixture(scope="module")
def rope_run(tmp_path_factory) -> Path:
    """A tiny RoPE run whose weights are drawn again, N(0, 1) seeded: four training steps leave
    predictions near uniform, where positions, and so an extension method, hardly move a logit."""
    return redraw_weights(tiny_trained(tmp_path_factory, "pos=rope"))


def test_extension_settings_score_past_the_training_length(rope_run, tasks):
    """max_length=64 (twice train.seq_len) with Self-Extend: rolling loglikelihoods of load_run's
    model with the same settings, read in windows of 64, and not those of the plain model."""
    settings = ["eval.self_extend.group=4", "eval.self_extend.window=8"]
    extended = responses(tasks, "relpos", f"run={rope_run},max_length=64,{','.join(settings)}",
                         kinds=["loglikelihood_rolling"])["loglikelihood_rolling"]
    plain = responses(tasks, "relpos", f"run={rope_run},max_length=64", kinds=["loglikelihood_rolling"])
    model, tokenizer, _ = load_run(rope_run, overrides=settings)
    for doc, ll in zip(DOCS, extended):
        assert ll == pytest.approx(rolling(model, tokenizer.eos_id, tokenizer.encode(doc["text"]), 64), abs=1e-3)
    assert abs(extended[1] - plain["loglikelihood_rolling"][1]) > 1e-2  # doc 1 is longer than 32 tokens


@pytest.mark.parametrize("model_args, message", [
    ("eval.lengths=64", "takes run, device, max_length, batch_size, eval.precision and eval.rope_scaling.*"),
    ("max_new_tokens=5", "not max_new_tokens=5"),
    ("batch_size=0", "batch_size must be a positive integer, got 0"),
    ("device=tpu", "device='tpu'; choose one of: auto, cpu, cuda, cuda:N"),
    ("eval.self_extend.group=4", "eval.self_extend"),  # no window
    ("eval.rope_scaling.type=nope", "eval.rope_scaling.type"),
])
def test_bad_model_args_are_one_line(tiny_run, rope_run, model_args, message):
    from relpos_cli.lm_eval_model import RelposLM

    run = rope_run if "rope" in model_args or "extend" in model_args else tiny_run
    with pytest.raises(RelposError) as e:
        RelposLM.create_from_arg_string(f"run={run},{model_args}", {} if "device" in model_args else {"device": "cpu"})
    assert message in str(e.value) and len(str(e.value).splitlines()) == 1


def test_model_args_device_and_batch_size_win_over_lm_eval_s_options(tiny_run):
    """lm-eval's command line passes --device and --batch_size always, its defaults too; given in
    --model_args as well they are no TypeError (lm-eval's own merge), and model_args win."""
    from relpos_cli.lm_eval_model import RelposLM

    lm = RelposLM.create_from_arg_string(f"run={tiny_run},batch_size=3,device=cpu",
                                         {"batch_size": 1, "max_batch_size": None, "device": "cuda:0"})
    assert lm.batch_size == 3 and lm.device.type == "cpu"
    lm = RelposLM.create_from_arg_obj({"run": str(tiny_run)}, {"batch_size": "2", "device": "cpu"})
    assert lm.batch_size == 2 and lm.device.type == "cpu"


def test_command_line_registers_relpos_and_reports_errors_in_one_line(tasks, tmp_path):
    """relpos-lm-eval is lm-eval's command line that knows `--model relpos`: a run dir that does not
    exist is one line from the model, exit 2 (with device and batch_size in --model_args beside
    lm-eval's own --device and --batch_size: no TypeError first)."""
    proc = subprocess.run(
        [sys.executable, "-c", "from relpos_cli.lm_eval_model import main; main()", "--model", "relpos",
         "--model_args", f"run={tmp_path / 'absent'},device=cpu,batch_size=2", "--tasks", "relpos_test_loglikelihood", "--include_path",
         str(tasks), "--verbosity", "ERROR"],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=tmp_path, timeout=300)
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert proc.returncode == 2 and lines[-1] == f"error: run dir not found: {tmp_path / 'absent'}", proc.stderr
    assert "Traceback" not in proc.stderr


def test_importing_relpos_does_not_import_lm_eval():
    """lm-eval loads with relpos_cli.lm_eval_model alone: every other module of the package imports without it."""
    code = ("import pkgutil, importlib, sys, relpos_cli\n"
            "for m in pkgutil.walk_packages(relpos_cli.__path__, 'relpos_cli.'):\n"
            "    if m.name != 'relpos_cli.lm_eval_model' and not m.name.endswith('__main__'):\n"
            "        importlib.import_module(m.name)\n"
            "print('lm_eval' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)}).stdout
    assert out.strip() == "False"
