"""Flip-flop language modelling (Liu et al. 2023, "Exposing Attention Glitches with Flip-Flop
Language Modeling"), the first task of the CoPE paper (Golovneva et al. 2024)::

    PADS | w1 i0 i1 r | 1 |  i0 w0 i1 r | 0 | ...

A sequence of instructions, each an op and a bit: ``w`` writes its bit, ``i`` is ignored, ``r``
reads, and the bit after a read is its answer: the bit of the most recent write. The first
instruction is a write, the last a read; between them ops are drawn with ``task.p_write``,
``task.p_read`` and the rest ignore (Liu et al.'s FFL(0.8): 0.1, 0.1). Instructions are separated by
single spaces and each is encoded on its own, so every instruction costs a fixed number of tokens;
the example is filled with instructions and the tokens left over are single-token spaces at the
start. Scored per read (chance: 0.5): accuracy = correct reads / reads.

Why this one of CoPE's three tasks (flip-flop, selective copy, counting): it is the paper's lead
task; each answer is one token in either tokenizer, so exact match is unambiguous; and it isolates
what position schemes differ on, attending to the latest instance of a pattern among distractors
at any distance: with sparse writes (a low p_write) the relevant write lies far back, and at 16x the
training length every read also sits at positions never seen in training.
"""

from __future__ import annotations

import numpy as np

from relpos_cli.errors import RelposError
from relpos_cli.tasks import register
from relpos_cli.tasks.base import Encoder, Example, Segments, Task, check_range


@register("flip_flop")
class FlipFlop(Task):
    paper = "Liu et al. 2023 (flip-flop); Golovneva et al. 2024 (CoPE)"

    def __init__(self, encoder: Encoder, p_write: float = 0.1, p_read: float = 0.1):
        super().__init__(encoder)
        check_range("p_write", p_write, 0, 1)
        check_range("p_read", p_read, 0, 1)
        if p_write + p_read > 1:
            raise RelposError(f"task.p_write + task.p_read must be at most 1 (the rest ignore), got {p_write + p_read:g}")
        self.probs = np.array([p_write, p_read, 1 - p_write - p_read])  # w, r, i

    def _cost(self, op: str, bit: int, first: bool) -> int:
        """Tokens of one instruction: its text (with the separating space unless first), plus the answer for reads."""
        lead = "" if first else " "
        if op == "r":
            return len(self.encoder(f"{lead}r")) + len(self.encoder(str(bit)))
        return len(self.encoder(f"{lead}{op}{bit}"))

    def min_length(self) -> int:
        return max(self._cost("w", b, True) for b in (0, 1)) + max(self._cost("r", b, False) for b in (0, 1))

    def build(self, rng: np.random.Generator, length: int, depth: float | None) -> Example:
        written = int(rng.integers(2))
        program = [("w", written)]
        used = self._cost("w", written, True)
        last_read = max(self._cost("r", b, False) for b in (0, 1))
        while True:
            op = "wri"[rng.choice(3, p=self.probs)]
            bit = int(rng.integers(2))
            bit = written if op == "r" else bit
            if used + self._cost(op, bit, False) + last_read > length:
                break
            program.append((op, bit))
            used += self._cost(op, bit, False)
            written = bit if op == "w" else written
        program.append(("r", written))
        used += self._cost("r", written, False)

        s = Segments(self.encoder).pad(length - used)
        for i, (op, bit) in enumerate(program):
            lead = "" if i == 0 else " "
            if op == "r":
                s.text(f"{lead}r").answer(str(bit))
            else:
                s.text(f"{lead}{op}{bit}")
        return s.finish(length)
