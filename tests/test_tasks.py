"""Task generators, training batches and exact-match scoring, in process: each checked against what
the example's text says (parsed independently of the generator), brute-force greedy decoding, or
the losses of examples run one by one."""

import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from relpos_cli.config import conf_dir
from relpos_cli.errors import RelposError
from relpos_cli.eval_task import effective_length, exact_matches
from relpos_cli.model import build_model
from relpos_cli.tasks import build_task, task_names, task_settings
from relpos_cli.tasks.base import CLASSIC_FILLER, Encoder
from relpos_cli.tasks.examples import cell_examples, eval_dataset
from relpos_cli.tasks.passkey import QUESTION, needle
from relpos_cli.tasks.training import IGNORE, answer_loss, mixed_rows, padded_batch
from relpos_cli.tokenizers import BpeTokenizer, ByteTokenizer
from relpos_cli.sampled_positions import random_positions

TASKS = ["passkey", "assoc_recall", "copy", "flip_flop"]


@pytest.fixture(scope="module")
def bpe() -> BpeTokenizer:
    """A small byte-level BPE that has merges for the templates' words, digits and letters."""
    rng = np.random.default_rng(0)
    docs = [CLASSIC_FILLER * 20, needle("12345") * 20, QUESTION * 20,
            " ".join("".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz0123456789:"), 6)) for _ in range(3000))]
    return BpeTokenizer.train(iter(docs), 400)


@pytest.fixture(params=["bytes", "bpe"])
def encoder(request, bpe) -> Encoder:
    return Encoder(ByteTokenizer() if request.param == "bytes" else bpe)


def task_config(name: str, **overrides) -> dict:
    cfg = OmegaConf.to_container(OmegaConf.load(conf_dir() / "task" / f"{name}.yaml"))
    return {**cfg, **overrides}


def make_task(name: str, encoder: Encoder, **overrides):
    return build_task(task_settings(task_config(name, **overrides)), encoder)


def decode(encoder: Encoder, ids) -> str:
    return encoder.decode(np.asarray(ids))


def expected_answers(name: str, text: str) -> list[str]:
    """The answers an example's text calls for, read from the text alone."""
    if name == "passkey":
        return [re.search(r"The pass key is (\d+)\. Remember it\. \1 is the pass key\.", text).group(1)]
    if name == "assoc_recall":  # 8 pairs "kv " first; then queries " kv" among filler without digits
        pairs = dict(re.findall(r"([A-Z])(\d) ", text[: 3 * 8]))
        queried = re.findall(r" ([A-Z])\d", text[3 * 8 :])
        assert sorted(queried) == sorted(pairs) and len(pairs) == 8  # every key queried once
        return [pairs[k] for k in queried]
    if name == "copy":
        return [text.strip(" ").split("=")[0]]
    if name == "flip_flop":
        answers, last = [], None
        for op, bit in re.findall(r"([wir])([01])", text):
            if op == "w":
                last = bit
            if op == "r":
                answers.append(last)
        return answers
    raise KeyError(name)


@pytest.mark.parametrize("name", TASKS)
def test_examples_are_exact_length_deterministic_and_their_spans_hold_the_answers(name, encoder):
    task = make_task(name, encoder)
    for length in (task.min_length(), task.min_length() + 1, 160, 411):
        depth = 0.3 if task.has_depth else None
        a = list(cell_examples(task, 7, length, depth, 3))
        b = list(cell_examples(task, 7, length, depth, 3))
        other = list(cell_examples(task, 8, length, depth, 3))
        for x, y, z in zip(a, b, other):
            assert len(x.input_ids) == length and np.array_equal(x.input_ids, y.input_ids) and x.answer_spans == y.answer_spans
            assert x.text == decode(encoder, x.input_ids)
            spans = [decode(encoder, x.input_ids[s:e]) for s, e in x.answer_spans]
            assert spans == expected_answers(name, x.text)
            for (s, e), answer in zip(x.answer_spans, spans):
                assert list(x.input_ids[s:e]) == list(encoder.encode(answer))  # the span is exactly the answer's tokens
        assert any(not np.array_equal(x.input_ids, z.input_ids) for x, z in zip(a, other))


def test_the_passkey_sits_at_the_stated_depth():
    encoder = Encoder(ByteTokenizer())
    task = make_task("passkey", encoder)
    length = 600
    filler = length - task.min_length()
    for depth in (0.0, 0.1, 0.25, 0.5, 0.9, 1.0):
        for ex in cell_examples(task, 3, length, depth, 3):
            start = ex.text.index("\nThe pass key is")
            assert start == round(depth * filler) and ex.depth == pytest.approx(depth, abs=0.5 / filler)
            if depth == 1.0:  # nothing between the needle and the question
                assert ex.text[start:].index(QUESTION) == len(needle(ex.text[start + 17 : start + 22]))


def test_corpus_filler_is_cut_from_the_corpus_and_the_instruction_leads():
    corpus = np.frombuffer(("".join(f"line {i} of the corpus\n" for i in range(500))).encode(), dtype=np.uint8)
    encoder = Encoder(ByteTokenizer(), corpus.astype(np.int64))
    ex = next(cell_examples(make_task("passkey", encoder, filler="corpus", instruction=True), 0, 500, 0.5, 1))
    assert ex.text.startswith("There is an important info hidden") and "of the corpus\n" in ex.text
    ids = ex.input_ids
    assert any(np.array_equal(ids[i : i + 40], corpus[j : j + 40]) for i in range(150, 200) for j in range(len(corpus) - 40))


def test_corpus_filler_draws_every_window_of_the_corpus():
    """Any of the len - n + 1 windows, the last included; a corpus exactly n tokens long serves."""
    corpus = np.arange(12, dtype=np.int64)
    encoder = Encoder(ByteTokenizer(), corpus)
    rng = np.random.default_rng(0)
    starts = {int(encoder.corpus_filler(rng, 9)[0]) for _ in range(400)}
    assert starts == {0, 1, 2, 3}  # windows of 9 of 12 tokens start at 0..3
    assert np.array_equal(encoder.corpus_filler(rng, 12), corpus)
    with pytest.raises(RelposError, match="needs 13 filler tokens; the corpus split has 12"):
        encoder.corpus_filler(rng, 13)


def test_eval_dataset_is_cached_and_keyed_by_corpus(tmp_path):
    encoder = Encoder(ByteTokenizer())
    settings = task_settings(task_config("passkey", samples=2, depths=[0.0, 1.0]))
    task = build_task(settings, encoder)
    first = eval_dataset(task, settings, [128, 256], tmp_path, "corpus-a")
    again = eval_dataset(task, settings, [128, 256], tmp_path, "corpus-a")
    assert len(first) == 8 and first["input_ids"] == again["input_ids"]
    assert [(r["length"], r["depth"]) for r in first] == [(128, 0.0)] * 2 + [(128, 1.0)] * 2 + [(256, 0.0)] * 2 + [(256, 1.0)] * 2
    cell = list(cell_examples(task, 0, 256, 0.0, 2))
    assert first[4]["input_ids"] == cell[0].input_ids.tolist() and first[5]["input_ids"] == cell[1].input_ids.tolist()
    eval_dataset(task, settings, [128, 256], tmp_path, "corpus-b")
    cached = sorted(p.name for p in (tmp_path / "tasks").iterdir())
    assert len(cached) == 2 and not [p for p in cached if p.endswith(".tmp")]


def brute_force_greedy(model, prefix: np.ndarray, steps: int, positions: torch.Tensor | None = None) -> list[int]:
    """Greedy decoding one token at a time, the whole prefix re-run at every step (at positions[:its length])."""
    out, ids = [], torch.from_numpy(prefix)[None]
    with torch.no_grad():
        for _ in range(steps):
            at = None if positions is None else positions[: ids.shape[1]]
            nxt = int(model(ids, positions=at)[0, -1].argmax())
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], 1)
    return out


@pytest.mark.parametrize("name, pos, position_limit", [
    ("passkey", "rope", None), ("assoc_recall", "alibi", None), ("copy", "t5", None),
    ("copy", "rope", 512), ("assoc_recall", "alibi", 512),  # task.eval_positions=randomized: sorted draws from [0, 512)
])
def test_exact_match_under_teacher_forcing_equals_greedy_decoding(name, pos, position_limit):
    torch.manual_seed(0)
    model = build_model({"model": {"d_model": 32, "n_layers": 2, "n_heads": 2, "mlp_ratio": 2}, "pos": {"name": pos},
                         "train": {"seq_len": 64}}, 256).eval()
    encoder = Encoder(ByteTokenizer())
    task = make_task(name, encoder, **({"pairs": 3} if name == "assoc_recall" else {}))
    examples, want = [], []
    length = {"passkey": 110, "assoc_recall": 60, "copy": 40}[name]
    positions = None if position_limit is None else random_positions(position_limit, length, torch.Generator().manual_seed(3))
    for i, ex in enumerate(cell_examples(task, 1, length, 0.5 if task.has_depth else None, 4)):
        ids = ex.input_ids.copy()
        for j, (s, e) in enumerate(ex.answer_spans):  # in order: a span's prefix holds the earlier answers as rewritten
            greedy = brute_force_greedy(model, ids[:s], e - s, positions)
            if (i + j) % 3 == 0:  # make the answer what greedy decoding says: must count as correct
                ids[s:e] = greedy
            elif (i + j) % 3 == 1 and e - s > 1:  # greedy but for the last token: must not
                ids[s:e] = greedy[:-1] + [(greedy[-1] + 1) % 256]
            want.append(greedy == list(ids[s:e]))
        examples.append((ids, ex.answer_spans))
    got = exact_matches(model, torch.from_numpy(np.stack([i for i, _ in examples])), [s for _, s in examples], positions)
    flat = [hit for row in got for hit in row]
    assert flat == want and any(flat) and not all(flat)


def test_forward_at_selects_the_same_logits():
    torch.manual_seed(0)
    model = build_model({"model": {"d_model": 16, "n_layers": 1, "n_heads": 2, "mlp_ratio": 2}, "pos": {"name": "alibi"},
                         "train": {"seq_len": 32}}, 50).eval()
    tokens = torch.randint(0, 50, (3, 20))
    at = torch.rand(3, 20) < 0.3
    with torch.no_grad():
        torch.testing.assert_close(model(tokens, at=at), model(tokens)[at])


@pytest.mark.parametrize("name", TASKS)
def test_padded_task_batches_score_each_answer_as_if_the_example_ran_alone(name):
    torch.manual_seed(0)
    model = build_model({"model": {"d_model": 16, "n_layers": 2, "n_heads": 2, "mlp_ratio": 2}, "pos": {"name": "learned"},
                         "train": {"seq_len": 200}}, 256).eval()
    task = make_task(name, Encoder(ByteTokenizer()))
    examples = [next(cell_examples(task, i, length, 0.5 if task.has_depth else None, 1))
                for i, length in enumerate((task.min_length(), 150, 200))]
    x, y = padded_batch(examples, 200, 0)
    assert ((y != IGNORE).sum(1) == torch.tensor([sum(e - s for s, e in ex.answer_spans) for ex in examples])).all()
    with torch.no_grad():
        got = answer_loss(model, x, y)
        per_example = []
        for ex in examples:  # each alone, unpadded: mean cross-entropy over its answer tokens
            ids = torch.from_numpy(ex.input_ids)
            logits = model(ids[None])[0]
            positions = [t for s, e in ex.answer_spans for t in range(s, e)]
            per_example.append(F.cross_entropy(logits[[t - 1 for t in positions]], ids[positions]))
    torch.testing.assert_close(got, torch.stack(per_example).mean(), rtol=1e-5, atol=1e-6)


def test_default_eval_lengths_are_1x_to_16x_with_the_training_length_always_in():
    assert task_settings(task_config("copy")).lengths(112) == [112, 224, 448, 896, 1792]
    assert task_settings(task_config("copy", eval_lengths=[500, 64])).lengths(112) == [64, 112, 500]
    assert task_settings(task_config("passkey")).eval_depths() == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert task_settings(task_config("copy")).eval_depths() == [None]


def test_effective_length_is_where_accuracy_first_drops_below_the_threshold():
    rows = [{"length": l, "accuracy": a} for l, a in [(256, 1.0), (128, 0.95), (512, 0.92), (1024, 0.5), (2048, 0.95)]]
    assert effective_length(rows, 0.9) == 512
    assert effective_length(rows, 0.96) == 0
    assert effective_length(rows, 0.5) == 2048


@pytest.mark.parametrize("cfg, message", [
    ({"name": "nope"}, "unknown task 'nope'; choose one of: " + ", ".join(sorted(["none", *task_names()]))),
    (task_config("passkey", depths=[0.0, 1.5]), "task.depths must hold numbers in [0, 1], got [0.0, 1.5]"),
    (task_config("passkey", depths=[]), "task.depths must be a non-empty list"),
    (task_config("passkey", mix=1.5), "task.mix must be a number in [0, 1], got 1.5"),
    (task_config("passkey", mix=-0.1), "task.mix must be a number in [0, 1], got -0.1"),
    (task_config("copy", samples=0), "task.samples must be an integer >= 1, got 0"),
    (task_config("copy", threshold=2), "task.threshold must be a number in [0, 1], got 2"),
    (task_config("copy", eval_lengths=[128, -1]), "task.eval_lengths must hold integers >= 1"),
    (task_config("passkey", digits=0), "task.digits must be an integer in [1, 18], got 0"),
    (task_config("passkey", filler="lorem"), "task.filler='lorem'; choose one of: classic, corpus"),
    (task_config("assoc_recall", pairs=11), "task.pairs must be an integer in [1, 10], got 11"),
    (task_config("assoc_recall", pairs=200, key_chars=2, value_chars=2), "task.pairs must be an integer in [1, 100], got 200"),
    (task_config("assoc_recall", pairs=30, key_chars=1, value_chars=2), "task.pairs must be an integer in [1, 24], got 30"),
    (task_config("assoc_recall", power_a=0), "task.power_a must be a number in (0, 1]"),
    (task_config("flip_flop", p_write=0.6, p_read=0.5), "task.p_write + task.p_read must be at most 1"),
    (task_config("copy", alphabet="ab="), "task.alphabet must hold distinct characters other than '='"),
    (task_config("copy", nope=1), "task=copy has no option nope; its options are: alphabet, eval_lengths"),
])
def test_bad_task_settings_are_one_line_with_the_allowed_range(cfg, message):
    with pytest.raises(RelposError) as e:
        build_task(task_settings(cfg), Encoder(ByteTokenizer()))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_lengths_too_short_for_the_fixed_parts_and_mixes_that_round_away():
    task = make_task("passkey", Encoder(ByteTokenizer()))
    with pytest.raises(RelposError, match=r"train.seq_len=64 is too short for task=passkey: its fixed parts take 104 tokens"):
        task.check_length(64, "train.seq_len=64")
    assert mixed_rows(0.25, 32) == 8 and mixed_rows(0, 32) == 0 and mixed_rows(1, 32) == 32
    with pytest.raises(RelposError, match=r"task.mix=0.01 gives 0 task rows of train.batch_size=32"):
        mixed_rows(0.01, 32)
