"""RULER's variable tracking (Hsieh et al. 2024, RULER), after NVIDIA/RULER's
scripts/data/synthetic/variable_tracking.py, its template and answer prefix
(scripts/data/synthetic/constants.py) and its ``vt`` configuration (scripts/synthetic.yaml).

``task.chains`` chains of ``task.hops`` + 1 distinct five-letter variables: ``VAR QXWRT = 40712``,
then ``VAR BHAZM = VAR QXWRT `` (RULER's trailing space), ... hidden in a haystack in chain order at
random token offsets; the question asks for every variable that holds the first chain's value::

    [one worked example\\n\\n |] Memorize and track the chain(s) of variable assignment hidden in the
    following text.\\n\\n | HAYSTACK with \\nVAR ...\\n segments | \\nQuestion: Find all variables that
    are assigned the value 40712 in the text above. Answer: According to the chain(s) of variable
    assignment in the text above, 5 variables are assigned the value 40712, they are:  | QXWRT |  BHAZM | ...

- ``task.haystack``: ``noise`` (the classic sentences, RULER's vt setting; a line is
  ``\\nVAR ...\\n``) or ``essay`` (the run's corpus; a line is `` VAR ... . ``, as RULER inserts
  stripped lines with a period between essay sentences); both cut from a token stream;
- ``task.shot=true`` starts with RULER's worked example: the same template over five classic
  lines with chains of three-letter variables (at most 10 hops), its answer after the prefix (RULER
  sizes its haystack to 500 tokens of its tokenizer; five lines keep the fixed parts fixed);
- scored: one answer span per variable of the first chain, in chain order (RULER's reference
  order; it accepts any), the space before each but the first (the prefix ends with one).
  Accuracy = correct spans / spans = RULER's string_match_all (hops + 1 answers per example).
"""

from __future__ import annotations

import string

import numpy as np

from relpos_cli.errors import RelposError
from relpos_cli.tasks import register
from relpos_cli.tasks.base import CLASSIC_FILLER, Encoder, Example, Segments, Task, check_range
from relpos_cli.tasks.ruler_words import HAYSTACKS, check_choice, stream_filler, write_with_inserts

TEMPLATE = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
            "Question: Find all variables that are assigned the value {query} in the text above.")
ANSWER_PREFIX = (" Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables "
                 "are assigned the value {query}, they are: ")
SHOT_LINES, SHOT_LETTERS, LETTERS = 5, 3, 5  # the worked example's noise lines and variable names; the real ones'


def prompt(value: str, num_v: int) -> tuple[str, str]:
    """RULER's template + answer prefix, split at the context: (text before, text after)."""
    head, tail = (TEMPLATE + ANSWER_PREFIX).split("{context}")
    return head, tail.format(query=value, num_v=num_v)


def chains(rng: np.random.Generator, count: int, hops: int, letters: int) -> tuple[list[list[str]], list[str]]:
    """`count` chains of hops + 1 distinct variables (distinct over all chains) and distinct 5-digit values."""
    names: list[str] = []
    while len(names) < count * (hops + 1):
        name = "".join(rng.choice(list(string.ascii_uppercase), size=letters))
        if name not in names:
            names.append(name)
    values: list[str] = []
    while len(values) < count:
        value = str(int(rng.integers(10000, 99999)))  # RULER: np.random.randint(10000, 99999)
        if value not in values:
            values.append(value)
    return [names[i * (hops + 1) : (i + 1) * (hops + 1)] for i in range(count)], values


def chain_lines(names: list[str], value: str) -> list[str]:
    """RULER's assignment lines of one chain, the trailing space of the hops included."""
    return [f"VAR {names[0]} = {value}"] + [f"VAR {b} = VAR {a} " for a, b in zip(names, names[1:])]


@register("variable_tracking")
class VariableTracking(Task):
    paper = "Hsieh et al. 2024 (RULER)"

    def __init__(self, encoder: Encoder, chains: int = 1, hops: int = 4, haystack: str = "noise", shot: bool = True):
        super().__init__(encoder)
        check_range("chains", chains, 1, 16, integer=True)
        check_range("hops", hops, 1, 32, integer=True)
        check_choice("haystack", haystack, HAYSTACKS)
        if not isinstance(shot, bool):
            raise RelposError(f"task.shot must be a boolean, got {shot!r}")
        self.chains, self.hops, self.haystack, self.shot = chains, hops, haystack, shot

    def _line(self, line: str) -> str:
        return f"\n{line}\n" if self.haystack == "noise" else f" {line.strip()}. "

    def _shot(self, rng: np.random.Generator) -> str:
        """RULER's worked example: its noise lines with the chains inserted in order, answered."""
        hops = min(10, self.hops)  # RULER's worked example has at most 10 hops
        names, values = chains(rng, self.chains, hops, SHOT_LETTERS)
        sentences = [CLASSIC_FILLER.strip()] * max(SHOT_LINES, hops + 1)
        for chain, value in zip(names, values):  # RULER: sorted positions, each line after the ones before
            for j, at in enumerate(sorted(rng.choice(len(sentences), size=hops + 1, replace=False))):
                sentences.insert(int(at) + j, chain_lines(chain, value)[j])
        head, tail = prompt(values[0], hops + 1)
        context = "\n".join(sentences).replace(". \n", ".\n")
        # RULER: input + " " + answers + "\n", then another "\n" before the question it is inserted into
        return head + context + tail + " " + " ".join(names[0]) + "\n\n"

    def _draw(self, rng: np.random.Generator):
        shot = self._shot(rng) if self.shot else ""
        names, values = chains(rng, self.chains, self.hops, LETTERS)
        return shot, names, values

    def _fixed(self, shot: str, names: list[list[str]], values: list[str]) -> int:
        e = self.encoder
        head, tail = prompt(values[0], self.hops + 1)
        lines = [self._line(l) for chain, value in zip(names, values) for l in chain_lines(chain, value)]
        answers = [names[0][0]] + [f" {n}" for n in names[0][1:]]
        return len(e(shot)) + len(e(head)) + len(e(tail)) + sum(len(e(l)) for l in lines) + sum(len(e(a)) for a in answers)

    def min_length(self) -> int:
        return self.longest_draw(self._draw, self._fixed)  # bytes: fixed; BPE varies with the draw

    def build(self, rng: np.random.Generator, length: int, depth: float | None) -> Example:
        shot, names, values = self.fitting_draw(rng, length, self._draw, self._fixed)
        n = length - self._fixed(shot, names, values)
        inserts = []
        for chain, value in zip(names, values):  # each chain's lines at sorted offsets: in chain order
            offsets = np.sort(rng.integers(0, n + 1, size=self.hops + 1))
            inserts += [(int(at), self._line(l)) for at, l in zip(offsets, chain_lines(chain, value))]
        head, tail = prompt(values[0], self.hops + 1)
        s = Segments(self.encoder).text(shot).text(head)
        write_with_inserts(s, stream_filler(self.encoder, self.haystack, rng, n), inserts).text(tail)
        s.answer(names[0][0])
        for name in names[0][1:]:
            s.answer(f" {name}")
        return s.finish(length)
