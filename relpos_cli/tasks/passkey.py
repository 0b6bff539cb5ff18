"""Passkey retrieval (Mohtashami & Jaggi 2023, Landmark Attention; Chen et al. 2023, Position
Interpolation): a number hidden in a haystack of filler, asked for at the end.

Format (segments encoded one by one; ``|`` marks a segment boundary, not a character)::

    [INSTRUCTION\\n |] FILLER(a tokens) | \\nThe pass key is 71432. Remember it. 71432 is the pass key.\\n |
    FILLER(n - a tokens) | \\nWhat is the pass key? The pass key is  | 71432

- the answer is the digits alone (``task.digits`` of them, the first non-zero); the space before it
  ends the question;
- the filler fills the example to exactly its length: n = length - fixed parts; a = round(depth * n)
  filler tokens stand before the needle, so depth 0 puts the needle first and depth 1 right before
  the question (the "needle in a haystack" depth);
- ``task.filler=classic`` repeats "The grass is green. The sky is blue. The sun is yellow. Here we go.
  There and back again." from a random point of the period; ``task.filler=corpus`` cuts the filler
  from the run's corpus at a random offset (the train split in training, validation when evaluating);
- ``task.instruction=true`` starts with the Landmark / PI instruction line ("There is an important
  info hidden inside a lot of irrelevant text. ..."); off by default: a model trained from scratch
  gains nothing from it and it costs ~150 byte tokens.

At byte level the fixed parts take 104 tokens (5 digits, no instruction). One answer per example.
"""

from __future__ import annotations

import numpy as np

from relpos_cli.errors import RelposError
from relpos_cli.tasks import register
from relpos_cli.tasks.base import Encoder, Example, Segments, Task, check_range

INSTRUCTION = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
               "I will quiz you about the important information there.\n")
FILLERS = ("classic", "corpus")


def needle(key: str) -> str:
    return f"\nThe pass key is {key}. Remember it. {key} is the pass key.\n"


QUESTION = "\nWhat is the pass key? The pass key is "


@register("passkey")
class Passkey(Task):
    paper = "Mohtashami & Jaggi 2023 (Landmark); Chen et al. 2023 (Position Interpolation)"
    has_depth = True

    def __init__(self, encoder: Encoder, digits: int = 5, filler: str = "classic", instruction: bool = False):
        super().__init__(encoder)
        check_range("digits", digits, 1, 18, integer=True)
        if filler not in FILLERS:
            raise RelposError(f"task.filler={filler!r}; choose one of: {', '.join(FILLERS)}")
        if not isinstance(instruction, bool):
            raise RelposError(f"task.instruction must be a boolean, got {instruction!r}")
        self.digits, self.filler, self.instruction = digits, filler, instruction

    def _fixed(self, key: str) -> int:
        e = self.encoder
        return len(e(INSTRUCTION)) * self.instruction + len(e(needle(key))) + len(e(QUESTION)) + len(e(key))

    def _key(self, rng: np.random.Generator) -> str:
        return str(int(rng.integers(10 ** (self.digits - 1), 10**self.digits)))

    def min_length(self) -> int:
        # bytes: the same for every key; BPE may spend more tokens on some digit strings than on
        # others: the longest of 64 fixed keys (a key that needs more is redrawn in build)
        rng = np.random.default_rng(0)
        return max(self._fixed(self._key(rng)) for _ in range(64))

    def build(self, rng: np.random.Generator, length: int, depth: float | None) -> Example:
        key = self._key(rng)
        while self._fixed(key) > length:
            key = self._key(rng)
        n = length - self._fixed(key)
        take = self.encoder.classic_filler if self.filler == "classic" else self.encoder.corpus_filler
        filler = take(rng, n)
        before = round(depth * n)
        s = Segments(self.encoder)
        if self.instruction:
            s.text(INSTRUCTION)
        s.filler(filler[:before]).text(needle(key)).filler(filler[before:]).text(QUESTION).answer(key)
        return s.finish(length, before / n if n else depth)
