"""RULER's synthetic tasks (niah, variable_tracking, common_words, frequent_words) in its 11 non-QA
configurations: every example has its exact length with bytes and a BPE, holds RULER's template
text (written out below from NVIDIA/RULER scripts/data/synthetic/constants.py and niah.py's
singular rewording), and its answer spans hold what the text calls for, read from the text alone."""

import re
import shutil
from collections import Counter

import numpy as np
import pytest
from omegaconf import OmegaConf

from conftest import run_in_process
from relpos_cli.config import conf_dir
from relpos_cli.errors import RelposError
from relpos_cli.tasks import build_task, task_settings
from relpos_cli.tasks.base import CLASSIC_FILLER, Encoder
from relpos_cli.tasks.examples import cell_examples
from relpos_cli.tokenizers import BpeTokenizer, ByteTokenizer

# scripts/synthetic.yaml's configurations but qa_1 and qa_2, as conf/task yamls (vt, cwe, fwe: the tasks' own)
RULER = ["niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2", "niah_multikey_3",
         "niah_multivalue", "niah_multiquery", "variable_tracking", "common_words", "frequent_words"]
# RULER's templates + answer prefixes, written out (constants.py; niah singular: 'Some'->'A', 'are all'->'is', ...)
NIAH_HEAD = {
    ("number", 1): "A special magic number is hidden within the following text. Make sure to memorize it. "
                   "I will quiz you about the number afterwards.",
    ("uuid", 1): "A special magic uuid is hidden within the following text. Make sure to memorize it. "
                 "I will quiz you about the uuid afterwards.",
    ("number", 4): "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
                   "I will quiz you about the numbers afterwards.",
}
NIAH_QUESTION = {
    1: "\nWhat is the special magic {t} for {q} mentioned in the provided text? The special magic {t} for {q} "
       "mentioned in the provided text is",
    4: "\nWhat are all the special magic {t}s for {q} mentioned in the provided text? The special magic {t}s for {q} "
       "mentioned in the provided text are",
}
VT_HEAD = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
VT_QUESTION = ("\nQuestion: Find all variables that are assigned the value {v} in the text above. Answer: According to "
               "the chain(s) of variable assignment in the text above, 5 variables are assigned the value {v}, they are: ")
CWE_HEAD = ("Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones "
            "that appear most often.\n")
CWE_QUESTION = ("\nQuestion: What are the 10 most common words in the above list? Answer: The top 10 words that appear "
                "most often in the list are:")
FWE_HEAD = ("Read the following coded text and track the frequency of each coded word. Find the three most frequently "
            "appeared coded words.")
FWE_QUESTION = ("\nQuestion: Do not provide any explanation. Please ignore the dots '....'. What are the three most "
                "frequently appeared words in the above coded text? Answer: According to the coded text above, the "
                "three most frequently appeared words are:")
CORPUS = "".join(f"Essay line {i}: how to start a startup and why it is hard to do. " for i in range(400))


def config(name: str, **overrides) -> dict:
    return {**OmegaConf.to_container(OmegaConf.load(conf_dir() / "task" / f"{name}.yaml")), **overrides}


@pytest.fixture(scope="module")
def bpe() -> BpeTokenizer:
    """A small BPE with merges for the templates' words and the corpus."""
    docs = [CLASSIC_FILLER * 20, CORPUS, (NIAH_HEAD[("number", 4)] + NIAH_QUESTION[4] + VT_HEAD + VT_QUESTION
                                          + CWE_HEAD + CWE_QUESTION + FWE_HEAD + FWE_QUESTION) * 20]
    return BpeTokenizer.train(iter(docs), 400)


@pytest.fixture(params=["bytes", "bpe"])
def encoder(request, bpe) -> Encoder:
    tok = ByteTokenizer() if request.param == "bytes" else bpe
    return Encoder(tok, np.asarray(tok.encode_documents([CORPUS]), dtype=np.int64))


def niah_answers(text: str, cfg: dict) -> list[str]:
    """The values asked for, read from the needles and the question: RULER's template checked on the way."""
    v = cfg["values"] * cfg["queries"]
    t = cfg["value_type"][:-1]
    head = NIAH_HEAD[(t, v)]
    assert text.lstrip(" ").startswith(head)
    q = re.search(r"\nWhat (?:is|are all) the special magic \w+ for (.+) mentioned in the provided text\?", text).group(1)
    assert NIAH_QUESTION[v].format(t=t, q=q) in text
    asked = q.replace(", and ", ", ").split(", ")
    assert len(asked) == cfg["queries"]
    needles = re.findall(rf"One of the special magic {cfg['value_type']} for (\S+) is: (\S+)\.", text)
    keys = {k for k, _ in needles}
    if cfg["haystack"] == "needle":  # every line a needle, exactly like the real one
        body = text[text.index(head) + len(head) : text.index("\nWhat ")]
        assert body.count("\n") == len(needles)
    else:
        assert len(keys) == max(cfg["keys"], cfg["queries"]) and len(needles) == len(keys) * cfg["values"]
    assert all(sum(k == a for k, _ in needles) == cfg["values"] for a in asked)  # no distractor shares an asked key
    return [val for a in asked for k, val in needles if k == a]


def vt_answers(text: str) -> list[str]:
    """The variables holding the asked value, in chain order: the assignments resolved by hand."""
    main = text[text.rindex(VT_HEAD) :]
    if text.index(VT_HEAD) != text.rindex(VT_HEAD):  # the worked example: RULER's format, answered right
        shot = text[: text.rindex(VT_HEAD)]
        names = re.search(r"they are:  ((?:[A-Z]{3} ?)+)\n$", shot).group(1).split()
        assert names == resolve(shot, re.search(r"assigned the value (\d+), they", shot).group(1))
    value = re.search(r"assigned the value (\d+) in the text above", main).group(1)
    assert VT_QUESTION.format(v=value) in main
    return resolve(main[: main.index("\nQuestion:")], value)


def resolve(text: str, value: str) -> list[str]:
    held, order = {}, []
    for name, source in re.findall(r"VAR ([A-Z]+) = (VAR [A-Z]+ |\d+)", text):
        held[name] = held.get(source[4:-1]) if source.startswith("VAR") else source
        if held[name] == value:
            order.append(name)
    return order


def cwe_answers(text: str) -> list[str]:
    """The 10 words listed most often (strictly more than any other), in order of first appearance."""
    main = text[text.rindex(CWE_HEAD) + len(CWE_HEAD) : text.rindex(CWE_QUESTION)].rstrip(" ")  # less the pads
    items = re.findall(r"(\d+)\. (\S+)", main)
    assert [int(i) for i, _ in items] == list(range(1, len(items) + 1)) and main == " ".join(f"{i}. {w}" for i, w in items)
    counts = Counter(w for _, w in items)
    top = sorted(counts.values(), reverse=True)
    assert top[9] > (top[10] if len(top) > 10 else 0)
    common = [w for w, c in counts.items() if c >= top[9]]
    assert text.endswith("".join(f" {j}. {w}" for j, w in enumerate(common, 1)))
    return common


def fwe_answers(text: str) -> list[str]:
    """The three most frequent coded words, most frequent first, each strictly more frequent than the next."""
    assert text.lstrip(" ").startswith(FWE_HEAD + " ") and FWE_QUESTION in text
    words = text[text.index(FWE_HEAD) + len(FWE_HEAD) : text.index(FWE_QUESTION)].split()
    ranked = Counter(w for w in words if w != "...").most_common()
    assert all(ranked[i][1] > ranked[i + 1][1] for i in range(3)) and Counter(words)["..."] > ranked[0][1]
    return [w for w, _ in ranked[:3]]


def expected_answers(name: str, text: str, cfg: dict) -> list[str]:
    if cfg["name"] == "niah":
        return niah_answers(text, cfg)
    return {"variable_tracking": vt_answers, "common_words": cwe_answers, "frequent_words": fwe_answers}[name](text)


@pytest.mark.parametrize("name", RULER)
def test_ruler_examples_have_the_exact_length_the_reference_format_and_answers_at_their_spans(name, encoder):
    cfg = config(name)
    task = build_task(task_settings(cfg), encoder)
    lengths = [task.min_length(), task.min_length() + 1, 2 * task.min_length() + 13]
    if name == "common_words":
        lengths.append(7000)  # RULER's long shape (30 and 3 repeats, the 40-word worked example) from 4096 on
    for length in lengths:
        examples = list(cell_examples(task, 3, length, 0.5 if task.has_depth else None, 2))
        assert [e.input_ids.tolist() for e in examples] == [e.input_ids.tolist() for e in cell_examples(
            task, 3, length, 0.5 if task.has_depth else None, 2)]
        for ex in examples:
            assert len(ex.input_ids) == length and ex.text == encoder.decode(ex.input_ids)
            spans = [encoder.decode(ex.input_ids[s:e]) for s, e in ex.answer_spans]
            assert [a.strip() for a in spans] == expected_answers(name, ex.text, cfg)
            for (s, e), answer in zip(ex.answer_spans, spans):
                assert list(ex.input_ids[s:e]) == list(encoder.encode(answer))
            assert ex.answer_spans[-1][1] == length  # the answers end the example
        if cfg.get("haystack") == "needle" and length > 2 * task.min_length():  # distractor needles fill it
            assert all(ex.text.count("One of the special magic") > 3 for ex in examples)


@pytest.mark.parametrize("name", ["niah_single_1", "niah_multikey_1"])
def test_niah_puts_one_needle_of_the_asked_key_at_the_depth(name):
    encoder = Encoder(ByteTokenizer())
    task = build_task(task_settings(config(name, haystack="noise")), encoder)
    head = len(NIAH_HEAD[("number", 1)]) + 1
    needle = r"\nOne of the special magic numbers for \S+ is: \d+\.\n"
    length = 1200
    for depth in (0.0, 0.3, 1.0):
        for ex in cell_examples(task, 1, length, depth, 3):
            key = re.search(r"for (\S+) mentioned", ex.text).group(1)
            fixed = head + sum(map(len, re.findall(needle, ex.text))) + len(ex.text) - ex.text.index("\nWhat is")
            n = length - fixed  # filler characters = bytes
            start = ex.text.index(f"\nOne of the special magic numbers for {key} ")
            before = start - head - sum(map(len, re.findall(needle, ex.text[:start])))
            assert before == round(depth * n) and ex.depth == pytest.approx(depth, abs=0.5 / n)


def test_distractor_needles_never_use_an_asked_key(monkeypatch, encoder):
    monkeypatch.setattr("relpos_cli.tasks.niah.WORD_KEYS", ["red-fox", "blue-owl", "tall-elm"])  # collisions certain
    cfg = config("niah_multikey_2")
    task = build_task(task_settings(cfg), encoder)
    for ex in cell_examples(task, 0, 3 * task.min_length(), 0.5, 3):
        assert [encoder.decode(ex.input_ids[s:e]).strip() for s, e in ex.answer_spans] == niah_answers(ex.text, cfg)


def test_ruler_preset_names_the_eleven_configurations():
    preset = OmegaConf.load(conf_dir() / "experiment" / "ruler.yaml")
    assert preset.hydra.sweeper.params.task.split(",") == RULER


@pytest.mark.parametrize("name", RULER)
def test_eval_task_scores_a_tiny_run_zero_shot_on_each_configuration(name, tiny_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    need = build_task(task_settings(config(name)), Encoder(ByteTokenizer())).min_length()
    code, _, err = run_in_process("eval-task", str(run), f"task={name}", "task.samples=1",
                                  f"task.eval_lengths=[{need}]", *(["task.depths=[0.5]"] if name.startswith("niah") else []))
    assert code == 0, err
    written = sorted(p.name for p in run.glob(f"eval_task*task={name}*"))
    assert [n for n in written if n.endswith((".csv", ".json", ".png"))] and len(written) >= 3, written


@pytest.mark.parametrize("cfg, message", [
    (config("niah", haystack="lorem"), "task.haystack='lorem'; choose one of: noise, essay, needle"),
    (config("niah", key_type="names"), "task.key_type='names'; choose one of: words, numbers, uuids"),
    (config("niah", values=0), "task.values must be an integer in [1, 64], got 0"),
    (config("variable_tracking", hops=0), "task.hops must be an integer in [1, 32], got 0"),
    (config("variable_tracking", shot="yes"), "task.shot must be a boolean, got 'yes'"),
    (config("common_words", common_repeats=3), "task.common_repeats must be an integer >= 4, got 3"),
    (config("common_words", common=11), "task.common must be an integer in [1, 10], got 11"),
    (config("frequent_words", alpha=1), "task.alpha must be a number in (1, 10], got 1"),
    (config("frequent_words", word_chars=3), "task.word_chars must be an integer in [4, 12], got 3"),
])
def test_bad_ruler_settings_are_one_line(cfg, message):
    with pytest.raises(RelposError) as e:
        build_task(task_settings(cfg), Encoder(ByteTokenizer()))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_essay_haystack_without_a_corpus_is_one_line():
    task = build_task(task_settings(config("niah_single_2")), Encoder(ByteTokenizer()))
    with pytest.raises(RelposError, match="task.haystack=essay needs"):
        next(cell_examples(task, 0, 600, 0.5, 1))
