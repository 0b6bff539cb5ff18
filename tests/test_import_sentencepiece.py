"""A Llama-2-style checkpoint through `relpos import` and `relpos eval-task`, end to end.

The tokenizer is built here as Llama 2's tokenizer.json is: BPE with byte fallback (<0x00>..<0xFF>
in the vocabulary, ids 3-258), normalizer Prepend("▁") + Replace(" ", "▁"), no pre-tokenizer, a
TemplateProcessing post-processor that puts <s> before every text, a SentencePiece decoder; its
pieces never span a space and digits stand alone (SentencePiece's pieces, Llama's split_digits).
The examples eval-task caches must begin with the BOS and hold, in each answer span, exactly the
tokens transformers' own tokenizer (AutoTokenizer on the model dir) gives the running text.
Checked to fail with b464669 and ace4a31 reverted (no BOS; " 1234567" alone was "▁▁1..."). The
text-starting-with-a-space test fails with importing.py keeping tokenizer.json as the file has it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import run_in_process  # noqa: E402
from relpos_cli import load_run  # noqa: E402
from relpos_cli.importing import import_checkpoint  # noqa: E402

transformers.logging.set_verbosity_error()
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
TEXT = [FILLER * 3, "The pass key is 71432. Remember it. 71432 is the pass key.",
        "What is the pass key? The pass key is 90210.", "One of the special magic numbers for apple is: 1234567.",
        "Some special magic numbers are hidden within the following text. Make sure to memorize it.",
        "What is the special magic number for apple mentioned in the provided text?",
        "Digits 0 1 2 3 4 5 6 7 8 9 and 86 and 3.14 and 2718281828."] * 20
SPECIAL = ["<unk>", "<s>", "</s>"]


def llama2_tokenizer():
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never"),
                                                 pre_tokenizers.Digits(individual_digits=True)])  # training only
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.train_from_iterator(TEXT, trainers.BpeTrainer(vocab_size=700, special_tokens=SPECIAL, show_progress=False))
    spec = json.loads(tok.to_str())
    pieces = [t for t, _ in sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1]) if t not in SPECIAL]
    vocab = {t: i for i, t in enumerate(SPECIAL + [f"<0x{i:02X}>" for i in range(256)] + pieces)}
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in spec["model"]["merges"]]
    llama = Tokenizer(models.BPE(vocab, merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    llama.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    llama.normalizer = tok.normalizer
    llama.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    llama.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                       decoders.Strip(" ", 1, 0)])
    return llama


@pytest.fixture(scope="module")
def llama2(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hf") / "tiny-llama-2"
    path.mkdir()
    tok = llama2_tokenizer()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "add_bos_token": True, "add_eos_token": False, "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "legacy": False, "clean_up_tokenization_spaces": False, "tokenizer_class": "LlamaTokenizer"}))
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2))
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def imported(llama2, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("import")
    corpus = root / "corpus.txt"
    corpus.write_text("\n\n".join(TEXT))
    with pytest.MonkeyPatch.context() as mp:  # the run's data.cache_dir: where eval-task caches its examples
        mp.setenv("RELPOS_CACHE", str(root / "cache"))
        return import_checkpoint(str(llama2), root / "run", ["data=text_files", f"data.files=[{corpus}]"])


def cached_examples(run: Path, task: str) -> list[dict]:
    import datasets

    cache = Path(str(load_run(run)[2].data.cache_dir)).expanduser()
    (path,) = sorted((cache / "tasks").glob(f"{task}-*"))
    return list(datasets.load_from_disk(str(path)))


@pytest.mark.parametrize("task, name", [("passkey", "passkey"), ("niah_single_1", "niah")])
def test_eval_task_examples_are_what_transformers_gives_the_running_text(imported, llama2, task, name, tmp_path,
                                                                           monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, err = run_in_process("eval-task", str(imported), f"task={task}", "task.samples=2",
                                    "task.eval_lengths=[160,320]")
    assert code == 0, out + err
    auto = transformers.AutoTokenizer.from_pretrained(llama2)
    rows = cached_examples(imported, name)
    assert len(rows) >= 2 * 2 * (5 if task == "passkey" else 1)
    for row in rows:
        ids = row["input_ids"]
        assert len(ids) == row["length"]
        assert ids[0] == auto.bos_token_id == 1 and 1 not in ids[1:]  # the BOS every Llama prompt begins with
        for start, end in zip(row["answer_starts"], row["answer_ends"]):
            running = auto.decode(ids[:end], skip_special_tokens=True)  # the example's text up to its answer
            answer = auto.decode(ids[start:end], skip_special_tokens=True).strip()
            assert answer.isdigit() and running.endswith(f" is {answer}") and not running.endswith(f"  {answer}")
            assert auto(running)["input_ids"][-(end - start):] == ids[start:end]  # the tokens transformers gives it


def test_eval_task_scores_transformers_argmax(imported, llama2, tmp_path, monkeypatch):
    """eval-task's exact match on a cached example: transformers' LlamaForCausalLM gives the same argmax
    at every answer position (a random model: compared token by token, not by accuracy)."""
    from relpos_cli.eval_task import exact_matches

    monkeypatch.chdir(tmp_path)
    assert run_in_process("eval-task", str(imported), "task=passkey", "task.samples=2", "task.eval_lengths=[160,320]")[0] == 0
    model, _, _ = load_run(imported)
    reference = transformers.AutoModelForCausalLM.from_pretrained(llama2).eval()
    row = cached_examples(imported, "passkey")[0]
    ids = torch.tensor([row["input_ids"]])
    (start, end), = zip(row["answer_starts"], row["answer_ends"])
    with torch.no_grad():
        want = reference(ids).logits[0, start - 1 : end - 1].argmax(-1)
        got = model(ids)[0, start - 1 : end - 1].argmax(-1)
    assert got.tolist() == want.tolist()
    assert exact_matches(model, ids, [[(start, end)]]) == [[bool((want == ids[0, start:end]).all())]]


def test_the_first_text_after_the_bos_is_marked_as_transformers_marks_it(imported, llama2):
    """RULER's niah prompt as transformers encodes it begins "<s> ▁A ▁special"; the example began
    "<s> A ▁special". This file's small vocabulary has no "▁A" piece: the mark is a token of its own,
    one more than the text mid-document, which the haystack gives up (Segments.finish)."""
    from omegaconf import OmegaConf

    from relpos_cli.config import conf_dir
    from relpos_cli.tasks import build_task, task_settings
    from relpos_cli.tasks.base import Encoder
    from relpos_cli.tasks.examples import cell_examples

    _, tokenizer, _ = load_run(imported)
    auto = transformers.AutoTokenizer.from_pretrained(llama2)
    cfg = OmegaConf.to_container(OmegaConf.load(conf_dir() / "task" / "niah_single_1.yaml"))
    task = build_task(task_settings(cfg), Encoder(tokenizer))
    ex = next(cell_examples(task, 0, task.shortest_example() + 60, 0.5, 1))
    text = auto.decode(ex.input_ids, skip_special_tokens=True)
    assert ex.input_ids[:3].tolist() == auto(text)["input_ids"][:3]


def test_a_text_that_starts_with_a_space_is_encoded_as_transformers_encodes_it(imported, llama2):
    """lm-eval's hf model encodes " There and back again." as transformers does ("▁There"); the run's
    tokenizer gave "▁▁There", so loglikelihood_rolling differed (8.3 nats on the model of this file's kind)."""
    _, tokenizer, _ = load_run(imported)
    auto = transformers.AutoTokenizer.from_pretrained(llama2)
    for text in (" There and back again.", " The sky is blue."):
        assert tokenizer.encode(text, special_tokens=True) == auto(text)["input_ids"]


def test_a_byte_level_tokenizer_without_bos_is_unchanged(tmp_path):
    """GPT-2 style (no prefix space, no BOS): a segment is encoded as any text, and no start token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from relpos_cli.tokenizers import HfTokenizer

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXT, trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"], show_progress=False,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    hf = HfTokenizer.load(tmp_path / "tokenizer.json", "<|endoftext|>")
    assert hf.start_ids == []
    for text in ("71432", " 71432", "\nWhat is the pass key? The pass key is ", FILLER, "x"):
        assert hf.encode_segment(text) == hf.encode(text) == hf.encode(text, special_tokens=True)
    assert np.asarray(hf.encode_segment(" ")).size == 1
