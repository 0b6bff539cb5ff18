"""Copy (Kazemnejad et al. 2023, NoPE length generalization; Ruoss et al. 2023, Randomized
Positional Encodings): a random string, a separator, the string again::

    PADS | xqvbmeoa... | = | xqvbmeoa...

- the string's characters are drawn uniformly from ``task.alphabet`` (lowercase letters by
  default); it is as long as the example allows: n tokens each side, 2n + separator = length,
  so the string grows with the length (copying a 16x longer string at 16x);
- the few tokens left over (one at most at byte level, more with BPE, whose token count per
  character varies) are single-token spaces at the start;
- one answer per example, the second copy: exact match = the whole string copied.
"""

from __future__ import annotations

import string

import numpy as np

from relpos_cli.errors import RelposError
from relpos_cli.tasks import register
from relpos_cli.tasks.base import PAD, Encoder, Example, Segments, Task

SEPARATOR = "="


@register("copy")
class Copy(Task):
    paper = "Kazemnejad et al. 2023 (NoPE); Ruoss et al. 2023 (Randomized PE)"

    def __init__(self, encoder: Encoder, alphabet: str = string.ascii_lowercase):
        super().__init__(encoder)
        if not isinstance(alphabet, str) or not alphabet:
            raise RelposError(f"task.alphabet must be a non-empty string of characters, got {alphabet!r}")
        if SEPARATOR in alphabet or PAD in alphabet or len(set(alphabet)) != len(alphabet):
            raise RelposError(f"task.alphabet must hold distinct characters other than {SEPARATOR!r} and spaces, got {alphabet!r}")
        self.alphabet = alphabet

    def min_length(self) -> int:
        one = max(len(self.encoder(c)) for c in self.alphabet)
        return 2 * one + len(self.encoder(SEPARATOR))

    def build(self, rng: np.random.Generator, length: int, depth: float | None) -> Example:
        half = (length - len(self.encoder(SEPARATOR))) // 2  # tokens each copy may take
        chars = "".join(rng.choice(list(self.alphabet), size=half))  # >= 1 token per character
        low, high = 1, half  # the longest prefix that fits in `half` tokens (BPE: fewer tokens than characters)
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if len(self.encoder.encode(chars[:mid])) <= half else (low, mid - 1)
        text = chars[:low]
        pads = length - 2 * len(self.encoder.encode(text)) - len(self.encoder(SEPARATOR))
        return Segments(self.encoder).pad(pads).text(text).text(SEPARATOR).answer(text).finish(length)
