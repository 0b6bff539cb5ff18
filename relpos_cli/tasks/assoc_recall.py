"""Multi-query associative recall (Arora, Eyuboglu et al. 2023, Zoology: MQAR), written as text.

Zoology's MQAR draws ``num_kv_pairs`` distinct keys and values, lists each key with its value right
after it, then asks for every key once at positions drawn from a power law over the rest of the
sequence (random tokens between). Here keys are ``task.key_chars`` capital letters and values
``task.value_chars`` digits, each value written right after its key as in Zoology::

    Q8 Z0 M4 ... | FILLER |  Q | 8 | FILLER |  M | 4 | FILLER ...  Z | 0 | FILLER

(``|`` separates segments; each query is a space and the key, its answer the value, a scored span.)

- ``task.pairs`` pairs (distinct keys, distinct values) at the start, each key queried once, in a
  random order;
- the rest of the example is classic filler, which holds no digit and none of the key letters (the
  capitals but T and H): as in Zoology, whose noise tokens almost never hit one of the keys in an
  8k vocabulary, a key in the text is a key (lowercase keys, amid filler letters, took several
  times more training steps to learn in our runs);
  the filler is split before the queries at offsets drawn, like Zoology's gaps, with probability
  proportional to (k + 1)^(power_a - 1) for offset k in [0, n]: ``task.power_a=1`` (default)
  spreads the queries uniformly over the example, so at 16x the training length most queries sit
  much further from their pair than any seen in training; Zoology's 0.01 piles them up near the pairs;
- scored per query: accuracy = correct values / queries.

With one-letter keys and one-digit values (the defaults: Zoology's single-token keys and values)
a query is answered by an induction head: attend to the token after the earlier copy of the key
and copy it. At byte level the fixed parts of the default 8 pairs take 48 tokens.
"""

from __future__ import annotations

import string

import numpy as np

from relpos_cli.errors import RelposError
from relpos_cli.tasks import register
from relpos_cli.tasks.base import CLASSIC_FILLER, Encoder, Example, Segments, Task, check_range


KEY_ALPHABET = "".join(c for c in string.ascii_uppercase if c not in CLASSIC_FILLER)  # A-Z but H, T


def _strings(rng: np.random.Generator, alphabet: str, width: int, count: int) -> list[str]:
    """`count` distinct strings of `width` characters from `alphabet`."""
    codes = rng.choice(len(alphabet) ** width, size=count, replace=False)
    out = []
    for code in codes:
        chars = []
        for _ in range(width):
            code, digit = divmod(int(code), len(alphabet))
            chars.append(alphabet[digit])
        out.append("".join(chars))
    return out


@register("assoc_recall")
class AssociativeRecall(Task):
    paper = "Arora, Eyuboglu et al. 2023 (Zoology, MQAR)"

    def __init__(self, encoder: Encoder, pairs: int = 8, key_chars: int = 1, value_chars: int = 1,
                 power_a: float = 1.0):
        super().__init__(encoder)
        check_range("key_chars", key_chars, 1, 4, integer=True)
        check_range("value_chars", value_chars, 1, 6, integer=True)
        most = min(len(KEY_ALPHABET) ** key_chars, 10**value_chars)
        check_range("pairs", pairs, 1, most, integer=True)  # distinct keys and distinct values
        check_range("power_a", power_a, 0, 1)
        if power_a == 0:
            raise RelposError("task.power_a must be a number in (0, 1], got 0")
        self.pairs, self.key_chars, self.value_chars, self.power_a = pairs, key_chars, value_chars, float(power_a)

    def _draw(self, rng: np.random.Generator) -> tuple[list[str], list[str], np.ndarray]:
        keys = _strings(rng, KEY_ALPHABET, self.key_chars, self.pairs)
        values = _strings(rng, string.digits, self.value_chars, self.pairs)
        return keys, values, rng.permutation(self.pairs)

    def _fixed(self, keys: list[str], values: list[str]) -> int:
        e = self.encoder
        return len(e.encode(self._context(keys, values))) + sum(len(e(f" {k}")) + len(e(v)) for k, v in zip(keys, values))

    @staticmethod
    def _context(keys: list[str], values: list[str]) -> str:
        return "".join(f"{k}{v} " for k, v in zip(keys, values))

    def _fixed_of_draw(self, keys: list[str], values: list[str], order: np.ndarray) -> int:
        return self._fixed(keys, values)  # the order of the queries takes no tokens

    def min_length(self) -> int:
        return self.longest_draw(self._draw, self._fixed_of_draw)  # bytes: fixed; BPE varies with the draw

    def build(self, rng: np.random.Generator, length: int, depth: float | None) -> Example:
        keys, values, order = self.fitting_draw(rng, length, self._draw, self._fixed_of_draw)
        n = length - self._fixed(keys, values)
        filler = self.encoder.classic_filler(rng, n)
        weights = np.arange(1, n + 2, dtype=np.float64) ** (self.power_a - 1)  # offset k in [0, n]
        offsets = np.sort(rng.choice(n + 1, size=self.pairs, p=weights / weights.sum()))
        s = Segments(self.encoder).tokens(self.encoder.encode(self._context(keys, values)))
        previous = 0
        for offset, i in zip(offsets, order):
            s.filler(filler[previous:offset]).text(f" {keys[i]}").answer(values[i])
            previous = offset
        return s.filler(filler[previous:]).finish(length)
