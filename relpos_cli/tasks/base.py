"""What every task shares: how an example is written as text and tokenized to an exact length.

An example is a list of text segments, each encoded on its own by the run's tokenizer (bytes,
BPE or an imported model's) as it stands inside a document (``encode_segment``: without the "▁" a
SentencePiece tokenizer puts before every text it encodes) and concatenated; answer segments are
remembered as token spans. Encoding segment by segment is what makes lengths and answer spans exact
for any tokenizer: BPE merges never cross a segment boundary, so the answer's tokens are
``encode_segment(answer)`` wherever it stands. The text that opens the example is then written as a
document start (``Encoder.document_start``: with the "▁", as transformers encodes a prompt); where that
mark takes more or fewer tokens, the first filler or pads after it give or take them, so the length and
everything past them stay as counted. Filler is cut from a
token stream (the classic sentences, or the run's own corpus), so it fills any number of tokens.

Task modules subclass :class:`Task` and implement ``min_length`` (the tokens of the fixed parts)
and ``build`` (one example of an exact length from a numpy Generator); everything else
(datasets, training, scoring) works on :class:`Example`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from relpos_cli.errors import RelposError

# The Landmark Attention / Position Interpolation haystack (Mohtashami & Jaggi 2023; Chen et al. 2023)
CLASSIC_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
MIN_LENGTH_DRAWS = 16  # draws Task.longest_draw takes the longest fixed parts of
PAD = " "  # one token in both tokenizers: pads an example to its exact length where filler would not fit
MEMO_SIZE, MEMO_CHARS = 4096, 256


@dataclass
class Example:
    input_ids: np.ndarray  # (length,) int64 token ids: the prompt and its answers, exactly `length` of them
    answer_spans: list[tuple[int, int]]  # [start, end) token ranges of the answers, scored one by one
    text: str  # the same example decoded: what a person reads
    depth: float | None = None  # where the needle sits (passkey), as placed after rounding to tokens


class Encoder:
    """The run's tokenizer as the tasks use it: text -> token ids without the end-of-document token,
    memoised (templates repeat), plus the filler streams."""

    def __init__(self, tokenizer: Any, corpus: np.ndarray | None = None):
        self.tokenizer = tokenizer
        self.corpus = corpus  # (N,) token ids of a corpus split, for filler=corpus
        self._memo: dict[str, np.ndarray] = {}
        self._classic = self(CLASSIC_FILLER)  # one period of the classic filler
        self.start_ids = tokenizer.start_ids  # what an example begins with (Task.example)
        if len(self(PAD)) != 1:
            raise RelposError(f"the tokenizer encodes a space as {len(self(PAD))} tokens; the tasks pad examples "
                              f"to their exact length with one-token spaces")

    def __call__(self, text: str) -> np.ndarray:
        """Token ids of a text; short ones (templates, keys, values recur) are memoised."""
        if len(text) > MEMO_CHARS:
            return self.encode(text)
        if text not in self._memo:
            if len(self._memo) >= MEMO_SIZE:  # keys and values are random: keep the memo bounded
                self._memo.clear()
            self._memo[text] = self.encode(text)
        return self._memo[text]

    def encode(self, text: str) -> np.ndarray:
        """The text's ids as they stand mid-document (tokenizer.encode_segment): the example is its
        segments' ids side by side, so an answer's tokens are those of the running text."""
        return np.asarray(self.tokenizer.encode_segment(text) if text else [], dtype=np.int64)

    def document_start(self, text: str) -> np.ndarray:
        """The ids of a text that opens an example, as a tokenizer marks the start of every text it
        encodes (SentencePiece's "▁": RULER's niah prompt read by a Llama 2 begins "<s> ▁Some", where
        the text mid-document is "Some"), which is how transformers encodes a prompt. The count may differ
        from the text's mid-document one (a word the vocabulary holds marked in one piece and unmarked in
        two, or the other way round): Segments.finish makes up the difference. A tokenizer that marks
        nothing (bytes, GPT-2's BPE) encodes it the same either way."""
        return np.asarray(self.tokenizer.encode(text) if text else [], dtype=np.int64)

    def decode(self, ids: np.ndarray) -> str:
        return self.tokenizer.decode(ids)

    def classic_filler(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """n tokens of the repeated classic sentences, starting at a random point of the period.

        Each period is encoded on its own (it ends with a space), so the stream is exactly periodic."""
        period = len(self._classic)
        start = int(rng.integers(period))
        reps = (start + n) // period + 1
        return np.tile(self._classic, reps)[start : start + n]

    def corpus_filler(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """n consecutive tokens of the corpus split at a random offset, any of its len - n + 1."""
        if self.corpus is None or len(self.corpus) < n:
            have = 0 if self.corpus is None else len(self.corpus)
            raise RelposError(f"task.filler=corpus needs {n} filler tokens; the corpus split has {have}")
        start = int(rng.integers(len(self.corpus) - n + 1))  # integers' bound is exclusive
        return np.asarray(self.corpus[start : start + n], dtype=np.int64)


class Segments:
    """An example under construction: segments encoded one by one as they stand mid-document, answers
    remembered as the segments they are. Tasks count their fixed parts by those ids; finish writes the
    opening text as a document start."""

    def __init__(self, encoder: Encoder):
        self.encoder = encoder
        self.pieces: list[np.ndarray] = []
        self.stretchy: list[bool] = []  # filler or pads: may give or take the tokens the opening's mark differs by
        self.answers: list[int] = []  # indices into pieces
        self.opening: tuple[int, str] | None = None  # (index into pieces, text) of the text no token precedes
        self.size = 0

    def tokens(self, ids: np.ndarray, stretchy: bool = False) -> "Segments":
        self.pieces.append(np.asarray(ids, dtype=np.int64))
        self.stretchy.append(stretchy)
        self.size += len(ids)
        return self

    def filler(self, ids: np.ndarray) -> "Segments":
        """Haystack tokens, cut from a stream at any token: finish may give the opening a few of them."""
        return self.tokens(ids, stretchy=True)

    def text(self, text: str) -> "Segments":
        if self.size == 0 and self.opening is None and text:
            self.opening = (len(self.pieces), text)
        return self.tokens(self.encoder(text))

    def answer(self, text: str) -> "Segments":
        self.answers.append(len(self.pieces))
        return self.text(text)

    def pad(self, n: int) -> "Segments":
        """n single-token pads (spaces encoded one by one)."""
        return self.tokens(np.repeat(self.encoder(PAD), n), stretchy=True)

    def finish(self, length: int, depth: float | None = None) -> Example:
        """The example, its opening text written as a document start. A task's depth is kept as it counted
        it: the first filler after the opening may since have given or taken the mark's few tokens."""
        assert self.size == length, f"built {self.size} tokens for an example of {length}"  # a task's own bug
        if self.opening is not None:
            self._open(*self.opening)
        ids = np.concatenate(self.pieces) if self.pieces else np.zeros(0, dtype=np.int64)
        starts = np.cumsum([0] + [len(p) for p in self.pieces]).tolist()
        assert len(ids) == length, f"the opening's mark left {len(ids)} tokens of {length}"
        return Example(ids, [(starts[i], starts[i + 1]) for i in self.answers], self.encoder.decode(ids), depth)

    def _open(self, index: int, text: str) -> None:
        """pieces[index] -> the text as a document start. A mark that takes `more` tokens than the text
        mid-document takes them from the end of the first filler or pads after it, and before the answers,
        that has them (or gives -more pads to the first); nothing past that segment moves. With no such
        segment (an example with no room), the opening keeps its mid-document ids."""
        start = self.encoder.document_start(text)
        more = len(start) - len(self.pieces[index])
        if more:
            before_answers = min(self.answers, default=len(self.pieces))
            giver = next((j for j in range(index + 1, before_answers)
                          if self.stretchy[j] and len(self.pieces[j]) >= more), None)
            if giver is None:
                return
            piece = self.pieces[giver]
            self.pieces[giver] = np.concatenate([piece[: len(piece) - max(more, 0)],
                                                 np.repeat(self.encoder(PAD), max(-more, 0))])
        self.pieces[index] = start


class Task:
    """One task: a seeded generator of examples of an exact token length.

    Subclasses take their own conf/task/<name>.yaml keys as keyword arguments (after the encoder)
    and check them with one-line RelposErrors that state the allowed range."""

    name: str = ""
    paper: str = ""
    has_depth = False  # examples are placed on a depth axis (passkey): eval-task scores a depth x length grid

    def __init__(self, encoder: Encoder):
        self.encoder = encoder

    def min_length(self) -> int:
        """Tokens of build's shortest example (its fixed parts)."""
        raise NotImplementedError

    def build(self, rng: np.random.Generator, length: int, depth: float | None) -> Example:
        """One example of exactly `length` tokens (>= min_length()); depth in [0, 1] if has_depth."""
        raise NotImplementedError

    def shortest_example(self) -> int:
        """Tokens of the shortest example(): build's and the tokenizer's start token; shorter lengths are refused."""
        return self.min_length() + len(self.encoder.start_ids)

    def example(self, rng: np.random.Generator, length: int, depth: float | None) -> Example:
        """One example of exactly `length` tokens as the model reads it: the tokenizer's start token (an
        imported Llama's or Mistral's BOS, which every prompt of theirs begins with), then build()'s."""
        start = self.encoder.start_ids
        if not start:
            return self.build(rng, length, depth)
        ex = self.build(rng, length - len(start), depth)
        return Example(np.concatenate([np.asarray(start, dtype=np.int64), ex.input_ids]),
                       [(a + len(start), b + len(start)) for a, b in ex.answer_spans], ex.text, ex.depth)

    def longest_draw(self, draw: Callable[[np.random.Generator], tuple], fixed: Callable[..., int]) -> int:
        """min_length of a task whose fixed parts vary with its random draw (word, uuid and BPE
        lengths): the longest fixed(*draw) of MIN_LENGTH_DRAWS draws from seed 0; a draw that needs
        more is drawn again by fitting_draw."""
        rng = np.random.default_rng(0)
        return max(fixed(*draw(rng)) for _ in range(MIN_LENGTH_DRAWS))

    def fitting_draw(self, rng: np.random.Generator, length: int, draw: Callable[[np.random.Generator], tuple],
                     fixed: Callable[..., int]) -> tuple:
        """draw(rng), drawn again until its fixed parts fixed(*drawn) fit in `length` tokens."""
        drawn = draw(rng)
        while fixed(*drawn) > length:
            drawn = draw(rng)
        return drawn

    def check_length(self, length: int, setting: str) -> None:
        """setting: how the message names the length, e.g. "train.seq_len=64"."""
        need = self.shortest_example()
        if length < need:
            raise RelposError(f"{setting} is too short for task={self.name}: its fixed parts take {need} tokens "
                              f"with this tokenizer (use >= {need})")


def check_range(key: str, value: Any, low: float, high: float | None = None, integer: bool = False) -> None:
    """task.<key> must be a finite number (an integer if asked) in [low, high]: one line saying so otherwise."""
    kind = "an integer" if integer else "a number"
    # nan compares False with every bound, so it would pass `value < low`; inf is no setting either
    # (a float only: math.isfinite cannot take an int past float's range, and every int is finite)
    ok_type = isinstance(value, int) or (not integer and isinstance(value, float) and math.isfinite(value))
    bounds = f"[{low}, {high}]" if high is not None else f">= {low}"
    if isinstance(value, bool) or not ok_type or value < low or (high is not None and value > high):
        raise RelposError(f"task.{key} must be {kind} {'in ' + bounds if high is not None else bounds}, got {value!r}")

