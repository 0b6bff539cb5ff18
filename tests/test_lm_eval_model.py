"""The `relpos` model of lm-evaluation-harness (relpos_cli/lm_eval_model.py), offline: a custom task
written here (loglikelihood, loglikelihood_rolling, generate_until on a tiny jsonl dataset) run
through lm_eval.simple_evaluate on a trained tiny run, its numbers computed again here from
load_run's model; the same task on an imported tiny Llama against lm-eval's own `hf` model on its
Hugging Face dir: RoPE-scaled at both models' default max_length, and with a tokenizer that adds a
BOS (and a model that generates it: a special token the answers leave out); eval-time extension
settings, bad model_args, generation settings and import.json.

Mutation checked: tok_encode without the BOS, prefix_token_id the end token, tok_decode keeping
special tokens (each fails the BOS parity case); max_length defaulting to train.seq_len, top_k not
passed to the sampler (each fails the rope-scaled parity case); sampling without its
do_sample/temperature check (KeyError) fails the generation-settings test; an empty generation
context not replaced by the prefix token fails test_empty_generation_context_follows_the_prefix_token.
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

# contexts and continuations of a few bytes up to past 32 tokens (TINY's train.seq_len): left-truncated;
# an empty context (conditioned on the prefix token); generation prompts are the contexts but the
# empty one (lm-eval's hf model cannot generate from nothing without a BOS)
DOCS = [
    {"context": "def main(", "continuation": "self):", "text": "import os\n", "prompt": "def main("},
    {"context": "class A:\n    ", "continuation": "pass", "text": "def f(x):\n    return x + 1\n" * 3,
     "prompt": "class A:\n    "},
    {"context": "import sys\nimport os\nfrom pathlib import Path\n", "continuation": "\ndef run():",
     "text": "x = 1\n", "prompt": "import sys\nimport os\nfrom pathlib import Path\n"},
    {"context": "", "continuation": "import os", "text": "class B:\n    pass\n" * 2, "prompt": "import"},
]
GENERATE = 'doc_to_text: "{{prompt}}"\ndoc_to_target: "{{continuation}}"\nmetric_list:\n  - metric: exact_match\n'
# task name -> (output type, the rest of its yaml); responses() runs the first three unless told
TASKS = {
    "loglikelihood": ("loglikelihood", 'doc_to_text: "{{context}}"\ndoc_to_target: "{{continuation}}"\n'
                                       'metric_list:\n  - metric: acc\n'),
    "loglikelihood_rolling": ("loglikelihood_rolling", 'doc_to_text: ""\ndoc_to_target: "{{text}}"\n'
                                                       'metric_list:\n  - metric: word_perplexity\n'),
    "generate_until": ("generate_until", GENERATE + 'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 6\n'
                                                    '  do_sample: false\n'),
    # sampling from the single most likely token: the greedy answer, if top_k reaches the sampler
    "sampled": ("generate_until", GENERATE + 'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 6\n'
                                             '  do_sample: true\n  temperature: 0.7\n  top_k: 1\n'),
}
KINDS = ("loglikelihood", "loglikelihood_rolling", "generate_until")


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> Path:
    """A dir of lm-eval task yamls (relpos_test_<name in TASKS>) over one jsonl file."""
    root = tmp_path_factory.mktemp("tasks")
    data = root / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    for name, (kind, body) in TASKS.items():
        (root / f"{name}.yaml").write_text(
            f"task: relpos_test_{name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
            f"test_split: test\noutput_type: {kind}\n{body}")
    return root


def responses(tasks: Path, model: str, model_args: str, kinds=KINDS) -> dict[str, list]:
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


def greedy(model, ids: list[int], n: int, window: int, eos: int) -> list[int]:
    """At most n tokens after ids, each the argmax from the last `window` tokens, stopped at eos."""
    new = []
    with torch.no_grad():
        for _ in range(n):
            token = int(model(torch.tensor([ids + new])[:, -window:])[0, -1].argmax())
            if token == eos:
                break
            new.append(token)
    return new


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
    for doc, (ll, is_greedy) in zip(DOCS, got["loglikelihood"]):
        ids = tokenizer.encode(doc["context"] + doc["continuation"])  # bytes: the context's ids come first
        ids = ids if doc["context"] else [tokenizer.eos_id, *ids]  # an empty context: the end token
        # lm-eval scores the context's trailing spaces with the continuation, for every model
        scored = len(doc["continuation"]) + len(doc["context"]) - len(doc["context"].rstrip())
        assert ll == pytest.approx(loglikelihood(model, ids, scored, window), abs=1e-4)
        assert isinstance(is_greedy, bool)
    assert len(DOCS[2]["context"]) > window  # the case that cuts the context
    for doc, ll in zip(DOCS, got["loglikelihood_rolling"]):
        assert ll == pytest.approx(rolling(model, tokenizer.eos_id, tokenizer.encode(doc["text"]), window), abs=1e-4)
    assert len(DOCS[1]["text"]) > window  # more than one rolling window
    for doc, text in zip(DOCS, got["generate_until"]):
        ids = tokenizer.encode(doc["prompt"])[-(window - 6):]
        assert text == tokenizer.decode(greedy(model, ids, 6, window, tokenizer.eos_id)).split("\n")[0]


def add_bos(llama: Path) -> None:
    """The tiny Llama's tokenizer with a BOS its post-processor puts before every text, as Llama's
    and Mistral's, and the BOS's output row a little larger than that of a token the model often
    picks: greedy decoding of the first prompt gives it between text tokens."""
    import transformers
    from tokenizers import processors
    from test_import import EOS, byte_level_tokenizer

    backend = byte_level_tokenizer().backend_tokenizer
    backend.add_special_tokens(["<s>"])
    bos = backend.token_to_id("<s>")
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                           special_tokens=[("<s>", bos)])
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token=EOS)
    tokenizer.save_pretrained(llama)
    model = transformers.AutoModelForCausalLM.from_pretrained(llama)
    with torch.no_grad():
        model.lm_head.weight[bos] = model.lm_head.weight[146] * 1.05
        model.save_pretrained(llama)
        prompt = tokenizer(DOCS[0]["prompt"], return_tensors="pt")["input_ids"]
        generated = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)[0, prompt.shape[1]:]
    assert bos in generated.tolist() and set(generated.tolist()) != {bos}  # a special token among text


# Llama 3.1's scaling with an original length of 32: train.seq_len 32, max_position_embeddings 128
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 32}


@pytest.mark.parametrize("bos, max_length, config", [(False, "", {"rope_scaling": LLAMA3_SCALING}), (True, 32, {})],
                         ids=["rope-scaled", "bos"])
def test_imported_checkpoint_scores_as_lm_evals_hf_model(tasks, tmp_path, bos, max_length, config):
    """A tiny random Llama: lm-eval's `hf` model on its Hugging Face dir and `relpos` on the run
    `relpos import` makes of it give the same loglikelihoods and the same generations, greedy and
    sampled from the top token (the run keeps the model's tokenizer). Without a BOS, a RoPE-scaled
    Llama with both models' default max_length: hf's, its max_position_embeddings (128), not the
    run's train.seq_len (the scaling's original length, 32). With a BOS (added to every text, the
    prefix of an empty context and of the first rolling window, left out of the answers),
    max_length 32: contexts cut from the left, rolling windows of 32."""
    pytest.importorskip("transformers")
    from test_import import save_tiny_llama
    from relpos_cli.importing import import_checkpoint

    llama = save_tiny_llama(tmp_path / "tiny-llama", eos_token_id=0, **config)  # the tokenizer's end token
    if bos:
        add_bos(llama)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(d["context"] + d["continuation"] + d["text"] for d in DOCS) * 20)
    run = import_checkpoint(str(llama), tmp_path / "run", ["data=text_files", f"data.files=[{corpus}]"])
    kinds = (*KINDS, "sampled")
    given = f",max_length={max_length}" if max_length else ""
    hf = responses(tasks, "hf", f"pretrained={llama},dtype=float32{given}", kinds)
    ours = responses(tasks, "relpos", f"run={run}{given}", kinds)
    for kind in ("loglikelihood", "loglikelihood_rolling"):
        want = [r[0] if isinstance(r, (tuple, list)) else r for r in hf[kind]]
        got = [r[0] if isinstance(r, (tuple, list)) else r for r in ours[kind]]
        assert got == pytest.approx(want, abs=1e-4), kind
    assert [r[1] for r in ours["loglikelihood"]] == [r[1] for r in hf["loglikelihood"]]
    assert ours["generate_until"] == hf["generate_until"]
    assert ours["sampled"] == hf["sampled"] == hf["generate_until"]


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


def generate(lm, context: str, **gen_kwargs) -> str:
    """lm.generate_until on one request, greedy and at most 4 tokens unless gen_kwargs say otherwise."""
    from lm_eval.api.instance import Instance

    settings = {"until": ["\n"], "max_gen_toks": 4, "do_sample": False, **gen_kwargs}
    return lm.generate_until([Instance("generate_until", {}, (context, settings), 0)])[0]


@pytest.mark.parametrize("gen_kwargs, message", [
    ({"do_sample": True}, "do_sample=true needs a finite temperature > 0, got none"),
    ({"do_sample": True, "top_k": 5}, "do_sample=true needs a finite temperature > 0, got none"),
    ({"do_sample": True, "temperature": 0.0}, "do_sample=true needs a finite temperature > 0, got 0.0"),
    ({"top_k": -1}, "top_k must be a non-negative integer (0: every token), got -1"),
    ({"top_k": 2.5, "do_sample": True, "temperature": 1.0}, "top_k must be a non-negative integer"),
    ({"top_p": 0.9}, "not top_p"),
])
def test_bad_generation_settings_are_one_line(tiny_run, gen_kwargs, message):
    """What HF's generate refuses (lm-eval's hf model fails with a ValueError on each) and what relpos's
    sampler does not do: one line, never a KeyError."""
    from relpos_cli.lm_eval_model import RelposLM

    lm = RelposLM.create_from_arg_string(f"run={tiny_run}", {"device": "cpu"})
    with pytest.raises(RelposError) as e:
        generate(lm, "def main(", **gen_kwargs)
    assert message in str(e.value) and len(str(e.value).splitlines()) == 1


def test_empty_generation_context_follows_the_prefix_token(tiny_run):
    """An empty context (which HF's generate refuses without a BOS) generates after the prefix token,
    the end token here, as a document starts in training; sampling with a temperature runs."""
    from relpos_cli.lm_eval_model import RelposLM

    lm = RelposLM.create_from_arg_string(f"run={tiny_run}", {"device": "cpu"})
    model, tokenizer, cfg = load_run(tiny_run)
    want = greedy(model, [tokenizer.eos_id], 4, int(cfg.train.seq_len), tokenizer.eos_id)
    assert generate(lm, "", until=[]) == tokenizer.decode(want)
    assert isinstance(generate(lm, "", do_sample=True, temperature=1.0, top_k=5), str)


@pytest.mark.parametrize("record, message", [
    ('{"max_position_embeddings": 0}', "import.json's max_position_embeddings must be a positive integer, got 0"),
    ("{not json", "import.json is unreadable"),
])
def test_bad_import_record_is_one_line(tiny_run, tmp_path, record, message):
    """The default max_length of an imported run comes from its import.json: a broken one is one line."""
    import shutil

    from relpos_cli.lm_eval_model import RelposLM

    run = shutil.copytree(tiny_run, tmp_path / "run")
    (run / "import.json").write_text(record)
    with pytest.raises(RelposError) as e:
        RelposLM.create_from_arg_string(f"run={run}", {"device": "cpu"})
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
