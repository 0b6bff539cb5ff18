"""RULER's frequent words extraction (Hsieh et al. 2024, RULER), after NVIDIA/RULER's
scripts/data/synthetic/freq_words_extraction.py, its template and answer prefix
(scripts/data/synthetic/constants.py) and its ``fwe`` configuration (scripts/synthetic.yaml).

A coded text of random ``task.word_chars``-letter words whose counts follow a Zipf law: the word of
rank k appears int(N k^-alpha / zeta(alpha)) times, rank 1 is the noise word ``...``, all shuffled;
the question asks for the three most frequent coded words (ranks 2-4)::

    [PADS |] Read the following coded text and track the frequency of each coded word. Find the three
    most frequently appeared coded words. |  qzmhtr |  ... |  bwkxle | ... | \\nQuestion: Do not provide
    any explanation. Please ignore the dots '....'. What are the three most frequently appeared words
    in the above coded text? Answer: According to the coded text above, the three most frequently
    appeared words are: |  qzmhtr |  bwkxle |  pofaye

- the vocabulary holds max(5, length // 50) words (RULER: max_seq_length // 50); N is the largest
  that fits the example, never below the N from which ranks 2, 3, 4 and 5 have strictly falling
  counts (so the answer is unique); the tokens left over are single-token spaces at the start;
- scored: one answer span per word, `` WORD``, most frequent first (RULER's reference order; it
  accepts any). Accuracy = correct spans / spans = RULER's string_match_all (3 answers per example).
"""

from __future__ import annotations

import math
import string

import numpy as np

from relpos_cli.errors import RelposError
from relpos_cli.tasks import register
from relpos_cli.tasks.base import Encoder, Example, Segments, Task, check_range

TEMPLATE = ("Read the following coded text and track the frequency of each coded word. Find the three most "
            "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore "
            "the dots '....'. What are the three most frequently appeared words in the above coded text?")
ANSWER_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"
NOISE = "..."  # RULER's rank-1 word
ANSWERS = 3


def zeta(alpha: float, terms: int = 1000) -> float:
    """Riemann zeta(alpha), alpha > 1: a partial sum plus its Euler-Maclaurin tail (error < 1e-12 at 1000 terms)."""
    m = float(terms)
    head = sum(k**-alpha for k in range(1, terms))
    return head + m ** (1 - alpha) / (alpha - 1) + m**-alpha / 2 + alpha * m ** (-alpha - 1) / 12


def prompt() -> tuple[str, str]:
    """RULER's template + answer prefix, split at the context (the space before it goes with each word)."""
    head, tail = (TEMPLATE + ANSWER_PREFIX).split("{context}")
    return head.removesuffix(" "), tail


@register("frequent_words")
class FrequentWords(Task):
    paper = "Hsieh et al. 2024 (RULER)"

    def __init__(self, encoder: Encoder, alpha: float = 2.0, word_chars: int = 6):
        super().__init__(encoder)
        check_range("alpha", alpha, 1, 10)
        if alpha == 1:  # zeta diverges
            raise RelposError("task.alpha must be a number in (1, 10], got 1")
        check_range("word_chars", word_chars, 4, 12, integer=True)
        self.alpha, self.word_chars = float(alpha), word_chars
        self.zeta = zeta(self.alpha)
        # from this N on, ranks 2 > 3 > 4 > 5 in count: consecutive shares differ by >= 1 word
        gaps = [(k**-self.alpha - (k + 1) ** -self.alpha) / self.zeta for k in range(2, ANSWERS + 2)]
        self.least = math.ceil(1 / min(gaps))
        # words with a count at that N: a larger vocabulary adds only words that appear 0 times
        self.ranks = max(ANSWERS + 2, int(np.count_nonzero(self.counts(self.least, self.least))))

    def counts(self, n: int, size: int) -> np.ndarray:
        """RULER's sampled counts of ranks 1..size: int(n k^-alpha / zeta(alpha))."""
        k = np.arange(1, size + 1, dtype=np.float64)
        return (n * k**-self.alpha / self.zeta).astype(np.int64)

    def _vocab(self, rng: np.random.Generator, size: int) -> list[str]:
        """`size` words: the noise word, then distinct random coded words, in rank order."""
        words: list[str] = []
        while len(words) < size - 1:
            word = "".join(rng.choice(list(string.ascii_lowercase), size=self.word_chars))
            if word not in words:
                words.append(word)
        return [NOISE, *words]

    def _total(self, vocab: list[str], n: int) -> int:
        """Tokens of the example with N = n, the prompt and answers included."""
        e = self.encoder
        head, tail = prompt()
        words = int((self.counts(n, len(vocab)) * np.array([len(e(f" {w}")) for w in vocab])).sum())
        return len(e(head)) + words + len(e(tail)) + sum(len(e(f" {w}")) for w in vocab[1 : ANSWERS + 1])

    @staticmethod
    def _size(length: int) -> int:
        return max(ANSWERS + 2, length // 50)

    def min_length(self) -> int:
        # the least N, every word it gives a count; BPE varies: the longest of 16 draws (redrawn in build)
        rng = np.random.default_rng(0)
        return max(self._total(self._vocab(rng, self.ranks), self.least) for _ in range(16))

    def build(self, rng: np.random.Generator, length: int, depth: float | None) -> Example:
        size = self._size(length)
        if size > 26**self.word_chars // 2:
            raise RelposError(f"task=frequent_words at length {length} needs {size} distinct coded words; "
                              f"raise task.word_chars")
        vocab = self._vocab(rng, size)
        while self._total(vocab, self.least) > length:
            vocab = self._vocab(rng, size)
        low, high = self.least, int((length + 1) * self.zeta) + 1  # rank 1 alone takes >= n / zeta tokens
        while low < high:  # the largest N that fits
            mid = (low + high + 1) // 2
            low, high = (mid, high) if self._total(vocab, mid) <= length else (low, mid - 1)
        counts = self.counts(low, size)
        words = np.repeat(np.arange(size), counts)[rng.permutation(int(counts.sum()))]
        head, tail = prompt()
        s = Segments(self.encoder).text(head)
        for i in words:
            s.text(f" {vocab[i]}")
        s.pad(length - self._total(vocab, low)).text(tail)  # after the text: the prompt opens the example
        for word in vocab[1 : ANSWERS + 1]:
            s.answer(f" {word}")
        return s.finish(length)
