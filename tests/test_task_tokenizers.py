"""Task examples under a pretrained model's tokenizer: each segment is encoded as it stands inside
a document (tokenizers.HfTokenizer.encode_segment), so an example's tokens are those of its running
text. A SentencePiece tokenizer (Llama 2, Mistral) marks the start of every text it encodes with
"▁"; encoded alone, the passkey answer "71432" began with a "▁" the running text has not, and no
model could reproduce it (accuracy 0 for every such import)."""

from __future__ import annotations

import numpy as np
import pytest
from omegaconf import OmegaConf

from relpos_cli.config import conf_dir
from relpos_cli.errors import RelposError
from relpos_cli.tasks import build_task, task_settings
from relpos_cli.tasks.base import CLASSIC_FILLER, Encoder
from relpos_cli.tasks.examples import cell_examples, cell_rng
from relpos_cli.tokenizers import HfTokenizer

TRAINING_TEXT = [CLASSIC_FILLER * 3, "The pass key is 71432. Remember it. 71432 is the pass key.",
                 "What is the pass key? The pass key is 90210.", "the special magic number is 1234567"] * 20
SPECIAL = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]  # SentencePiece's byte fallback


def sentencepiece_like(pre_tokenizer, normalizer=None, decoder=None):
    """A BPE with byte fallback whose merges stay within words and digits (SentencePiece's pieces never
    span a space, and Llama's split_digits keeps digits apart: trained with those splits), encoding
    with the given pre-tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first"),
                                                 pre_tokenizers.Digits(individual_digits=True)])
    tok.train_from_iterator(TRAINING_TEXT, trainers.BpeTrainer(vocab_size=700, special_tokens=SPECIAL, show_progress=False))
    tok.pre_tokenizer, tok.decoder = pre_tokenizer, decoder
    return tok


def sentencepiece_decoder():
    """"▁" back to spaces, byte-fallback tokens to bytes, the text's first space stripped."""
    from tokenizers import decoders

    return decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])


def llama2_style():
    """Llama 2's and Mistral's tokenizer.json: normalizer Prepend("▁") + Replace(" ", "▁"), no pre-tokenizer."""
    from tokenizers import normalizers

    return sentencepiece_like(None, normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]),
                              sentencepiece_decoder())


def metaspace_first():
    """The newer conversion: no normalizer, Metaspace(prepend_scheme="first", split=False)."""
    from tokenizers import pre_tokenizers

    return sentencepiece_like(pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False),
                              decoder=sentencepiece_decoder())


def byte_level(add_prefix_space: bool):
    """Byte-level BPE with digits one by one (SmolLM2's tokenizer; GPT-2's add_prefix_space, RoBERTa's
    default, puts "Ġ" before every text)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space),
                                                 pre_tokenizers.Digits(individual_digits=True)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TRAINING_TEXT, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    return tok


def gpt2_prefix_space():
    return byte_level(add_prefix_space=True)


def gpt2_plain():
    return byte_level(add_prefix_space=False)


MARKING = [llama2_style, metaspace_first, gpt2_prefix_space]

# (text before, segment): the segment's tokens in running text are the tail of encode(before + segment)
IN_RUNNING_TEXT = [("What is the pass key? The pass key is ", "71432"), ("The pass key is", " 71432"),
                   ("the special magic number is", " 1234567"), ("Remember it.", "\nWhat is the pass key?")]


@pytest.mark.parametrize("make", MARKING + [gpt2_plain])
@pytest.mark.parametrize("before, segment", IN_RUNNING_TEXT)
def test_a_segment_gets_the_tokens_of_running_text(make, before, segment):
    hf = HfTokenizer(make(), "</s>")
    whole, mine = hf.encode(before + segment), hf.encode_segment(segment)
    assert whole[len(whole) - len(mine):] == mine
    # the reason for encode_segment: encoded alone, the text gains a start mark (Prepend always; Metaspace
    # and add_prefix_space unless it starts with a space)
    if make is llama2_style or (make in MARKING and not segment.startswith(" ")):
        assert hf.encode(segment) != mine


@pytest.mark.parametrize("make", MARKING)
def test_segments_side_by_side_decode_to_their_text(make):
    hf = HfTokenizer(make(), "</s>")
    encoder = Encoder(hf)
    pieces = ["The pass key is", " 71432", ". Remember it.", "\nWhat is the pass key? The pass key is ", "71432"]
    ids = np.concatenate([encoder(p) for p in pieces])
    assert hf.decode(ids).strip() == "".join(pieces).strip()  # no doubled space at a segment's start
    assert len(encoder(" ")) == 1  # the one-token pad every task relies on


@pytest.mark.parametrize("make", MARKING + [gpt2_plain])
def test_passkey_answers_are_the_digits_as_the_running_text_has_them(make):
    """A passkey example's answer span holds exactly the tokens "...The pass key is 71432" gives its digits."""
    hf = HfTokenizer(make(), "</s>")
    cfg = OmegaConf.to_container(OmegaConf.load(conf_dir() / "task" / "passkey.yaml"))
    task = build_task(task_settings(cfg), Encoder(hf))
    length = task.min_length() + 40
    for ex in cell_examples(task, 0, length, 0.5, 3):
        (start, end), = ex.answer_spans
        answer = hf.decode(ex.input_ids[start:end]).strip()
        assert answer.isdigit() and len(answer) == cfg["digits"]
        question = hf.encode(f"\nWhat is the pass key? The pass key is {answer}")
        assert question[len(question) - (end - start):] == ex.input_ids[start:end].tolist()
        # the answer follows the question's own space: the example reads as the text does ("is  71432" before)
        assert hf.decode(ex.input_ids).endswith(f"\nWhat is the pass key? The pass key is {answer}")


def test_a_sentinel_merged_with_the_text_is_one_line():
    """A vocabulary that merges the newline with what follows cannot tell the text's tokens apart."""
    from tokenizers import Tokenizer, models, normalizers

    words = {"<unk>": 0, "</s>": 1, "▁": 2, "▁\n": 3, "▁\nx": 4, "x": 5, "▁x": 6, "y": 7}
    tok = Tokenizer(models.WordPiece(words, unk_token="<unk>", continuing_subword_prefix=""))
    tok.normalizer = normalizers.Prepend("▁")
    hf = HfTokenizer(tok, "</s>")
    with pytest.raises(RelposError, match="merges '\\\\n' with the text 'x'"):
        hf.encode_segment("x")


def with_bos(tok):
    """The post-processor of Llama's and Mistral's tokenizer.json: "<s>" before every text."""
    from tokenizers import processors

    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return tok


def test_an_example_begins_with_the_bos_every_prompt_of_the_model_has():
    """transformers (and so RULER's and lm-eval's runs of Llama or Mistral) puts the BOS before every
    prompt; a task example started on the text's first token, a position such models never saw text
    at. It now starts with the BOS, within the example's length."""
    hf = HfTokenizer(with_bos(llama2_style()), "</s>")
    bos = hf.encode("x", special_tokens=True)[0]
    assert hf.start_ids == [bos] and HfTokenizer(llama2_style(), "</s>").start_ids == []
    cfg = OmegaConf.to_container(OmegaConf.load(conf_dir() / "task" / "passkey.yaml"))
    task = build_task(task_settings(cfg), Encoder(hf))
    plain = build_task(task_settings(cfg), Encoder(HfTokenizer(llama2_style(), "</s>")))
    assert task.shortest_example() == plain.shortest_example() + 1
    with pytest.raises(RelposError, match="needs|too short"):
        task.check_length(plain.shortest_example(), "length")
    length = task.shortest_example() + 40
    for index, ex in enumerate(cell_examples(task, 0, length, 0.5, 3)):
        other = plain.build(cell_rng(0, length, 0.5, index), length - 1, 0.5)
        assert len(ex.input_ids) == length and ex.input_ids[0] == bos and bos not in ex.input_ids[1:].tolist()
        assert ex.input_ids[1:].tolist() == other.input_ids.tolist()  # the same example after it
        assert [(a - 1, b - 1) for a, b in ex.answer_spans] == other.answer_spans


class MarksTextStart:
    """Bytes, but a text encoded on its own begins with a mark as SentencePiece's "▁" marks it: "same",
    its first byte b as 256 + b (the count mid-document); "more", a "▁" token (512) before the bytes (a
    word the vocabulary has no marked piece of); "fewer", its first two bytes as one marked token,
    1024 + 256 * b0 + b1 (a word held marked in one piece, unmarked in two). None marks nothing."""

    start_ids = [600]  # a BOS

    def __init__(self, mark: str | None):
        self.mark = mark

    def encode_segment(self, text: str) -> list[int]:
        return list(text.encode())

    def encode(self, text: str) -> list[int]:
        ids = self.encode_segment(text)
        if self.mark == "same":
            return [256 + ids[0], *ids[1:]]
        if self.mark == "more":
            return [512, *ids]
        if self.mark == "fewer":
            return [1024 + 256 * ids[0] + ids[1], *ids[2:]]
        return ids

    def decode(self, ids) -> str:
        def as_bytes(i: int) -> list[int]:
            return [] if i in (512, 600) else [(i - 1024) // 256, i % 256] if i >= 1024 else [i % 256]

        return bytes(b for i in ids for b in as_bytes(int(i))).decode(errors="replace")


def test_the_opening_text_is_marked_and_the_first_filler_after_it_makes_up_the_count():
    """Segments.finish by hand: the opening "AB" gets its mark; a mark one token longer takes the last
    token of the first filler or pads after it that has one, a mark one token shorter gives it a pad
    (a space, 32) to the first, even empty; nothing after that segment moves, the answers neither. With
    no filler or pads to take from before the answers, the opening keeps its mid-document ids."""
    from relpos_cli.tasks.base import Segments

    def example(mark, filler):
        s = Segments(Encoder(MarksTextStart(mark))).text("AB").pad(0).filler(filler).text("x").answer("y").pad(1)
        return s.finish(5 + len(filler))

    assert example(None, [1, 2]).input_ids.tolist() == [65, 66, 1, 2, 120, 121, 32]
    assert example("same", [1, 2]).input_ids.tolist() == [256 + 65, 66, 1, 2, 120, 121, 32]
    assert example("more", [1, 2]).input_ids.tolist() == [512, 65, 66, 1, 120, 121, 32]
    assert example("fewer", [1, 2]).input_ids.tolist() == [1024 + 256 * 65 + 66, 32, 1, 2, 120, 121, 32]
    assert example("more", []).input_ids.tolist() == [65, 66, 120, 121, 32]  # only pads after the answer: kept
    assert example("fewer", []).input_ids.tolist() == [1024 + 256 * 65 + 66, 32, 120, 121, 32]
    for mark in (None, "same", "more", "fewer"):
        assert example(mark, [1, 2]).answer_spans == [(5, 6)] and example(mark, []).answer_spans == [(3, 4)]


HAYSTACK = ["passkey", "niah_single_1", "variable_tracking"]  # filler after the opening: always room
PADDED = ["niah_multikey_3", "common_words", "frequent_words"]  # only pads: none when the example is full


@pytest.mark.parametrize("name", HAYSTACK + PADDED)
@pytest.mark.parametrize("mark", ["same", "more", "fewer"])
def test_the_text_that_opens_an_example_is_encoded_as_a_document_start(name, mark):
    """transformers encodes a prompt as a document: its first text marked ("<s> ▁A ▁special" for RULER's
    niah under a Llama 2). The example opens so, whatever the mark's token count; the tokens after the
    BOS are the unmarked example's with that count made up inside its haystack (one token fewer, or one
    pad more), before the answers, which stand where they stood. A task whose only room is pads keeps
    the unmarked opening in an example with none (a mark one token longer). Fails with Segments.text
    encoding every text mid-document, and (more, fewer) with the opening marked only where its count is
    kept."""
    cfg = OmegaConf.to_container(OmegaConf.load(conf_dir() / "task" / f"{name}.yaml"))
    if name == "passkey":
        cfg["instruction"] = True  # the instruction opens the example (the default opens with filler)
    plain_task, task = (build_task(task_settings(cfg), Encoder(MarksTextStart(m))) for m in (None, mark))
    length = plain_task.shortest_example() + 50
    marked = 0
    for plain, ex in zip(*(cell_examples(t, 0, length, 0.5, 8) for t in (plain_task, task))):
        p, e = plain.input_ids.tolist(), ex.input_ids.tolist()
        assert len(e) == len(p) == length and e[0] == p[0] == 600 and ex.answer_spans == plain.answer_spans
        first_answer = min(a for a, _ in plain.answer_spans)
        if mark == "same":
            assert e[1] == 256 + p[1] and e[2:] == p[2:]
        elif mark == "more" and e == p:
            assert name in PADDED  # kept: no pads to take the mark's token from
            continue
        else:
            body, rest = (e[2:], p[1:]) if mark == "more" else (p[3:], e[2:])  # rest less one token is body
            assert e[1] == (512 if mark == "more" else 1024 + 256 * p[1] + p[2])
            cuts = [r for r in range(len(rest)) if rest[:r] + rest[r + 1:] == body]
            assert cuts, "the marked example is not the unmarked one with one token made up"
            assert mark == "more" or rest[cuts[0]] == 32  # the pad given
            assert max(cuts) + 2 < first_answer  # in the haystack, before every answer
            assert min(cuts) >= 40  # past the opening text (every task's is longer)
        marked += 1
    assert marked >= 4
