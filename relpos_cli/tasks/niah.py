"""RULER's needle in a haystack (Hsieh et al. 2024, RULER), after NVIDIA/RULER's
scripts/data/synthetic/niah.py, its template and answer prefix (scripts/data/synthetic/constants.py)
and its eight niah configurations (scripts/synthetic.yaml: conf/task/niah_*.yaml).

Needles are ``One of the special magic {numbers} for {key} is: {value}.``; ``task.keys`` keys get
``task.values`` values each (one needle per value), ``task.queries`` of the keys are asked for (as
RULER, keys = max(keys, queries)). The prompt is RULER's template with its answer prefix (the
"base" model template), singular when one value is asked for (RULER's replacements)::

    [PADS |] Some special magic numbers are hidden within the following text. Make sure to memorize
    it. I will quiz you about the numbers afterwards.\\n | HAYSTACK with needle segments |
    \\nWhat are all the special magic numbers for KEY mentioned in the provided text? The special
    magic numbers for KEY mentioned in the provided text are |  4171826 | , |  9027465

- ``task.haystack``: ``noise`` = the classic grass/sky/sun sentences (RULER's noise), ``essay`` =
  the run's corpus (RULER's Paul Graham essays), both cut from a token stream with each needle a
  segment ``\\nNEEDLE\\n`` (noise, RULER joins lines with newlines) or `` NEEDLE `` (essay, RULER joins
  sentences with spaces); ``needle`` = RULER's haystack of distractor needles (random keys other
  than the asked ones, random values), lines ``\\nNEEDLE`` exactly like the real ones, whole lines
  only, the tokens left over as single-token spaces at the start;
- ``task.key_type`` / ``task.value_type``: ``words`` (adjective-noun pairs of the embedded lists,
  RULER's wonderwords pairs), ``numbers`` (7 digits, as RULER) or ``uuids`` (version-4 UUIDs);
- depth d (the eval grid) places one needle of the first asked key after round(d * n) of the n
  haystack tokens (lines for ``needle``); the other needles sit at distinct depths drawn from
  RULER's 40 depths, as RULER places all of them (past 41 needles, keys x values up to 64 x 64,
  depths repeat: RULER's essay haystack cannot place more than 40);
- scored: one answer span per asked value, `` VALUE`` (the space a generating model writes after
  the prefix), ``,`` between them, asked keys in the query's order, a key's values in the order
  they appear in the haystack (RULER accepts any order; teacher forcing needs one the model can
  infer). Accuracy = correct spans / spans = RULER's string_match_all, since every example of a
  setting has as many answers.
"""

from __future__ import annotations

import uuid

import numpy as np

from relpos_cli.tasks import register
from relpos_cli.tasks.base import Encoder, Example, Segments, Task, check_range
from relpos_cli.tasks.ruler_words import (HAYSTACKS, RULER_DEPTHS, check_choice, compound_words, stream_filler,
                                          write_with_inserts)

TEMPLATE = ("Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
            "I will quiz you about the {type_needle_v} afterwards.\n{context}\n"
            "What are all the special magic {type_needle_v} for {query} mentioned in the provided text?")
ANSWER_PREFIX = " The special magic {type_needle_v} for {query} mentioned in the provided text are"
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
# RULER's rewording when a single value is asked for, applied in this order to template + prefix
SINGULAR = (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer"))
NEEDLE_TYPES = ("words", "numbers", "uuids")
NIAH_HAYSTACKS = (*HAYSTACKS, "needle")
WORD_KEYS = compound_words()


def prompt(type_needle_v: str, query: str, singular: bool) -> tuple[str, str]:
    """RULER's template + answer prefix, split at the context: (text before, text after)."""
    template = TEMPLATE + ANSWER_PREFIX
    if singular:
        for old, new in SINGULAR:
            template = template.replace(old, new)
        type_needle_v = type_needle_v[:-1]  # RULER: drop the plural "s"
    head, tail = template.split("{context}")
    return head.format(type_needle_v=type_needle_v), tail.format(type_needle_v=type_needle_v, query=query)


def query_text(keys: list[str]) -> str:
    """RULER's list of asked keys: "a", "a, and b", "a, b, and c"."""
    return ", ".join(keys[:-1]) + ", and " + keys[-1] if len(keys) > 1 else keys[0]


@register("niah")
class Niah(Task):
    paper = "Hsieh et al. 2024 (RULER)"
    has_depth = True

    def __init__(self, encoder: Encoder, keys: int = 1, values: int = 1, queries: int = 1, key_type: str = "words",
                 value_type: str = "numbers", haystack: str = "noise"):
        super().__init__(encoder)
        check_range("keys", keys, 1, 64, integer=True)
        check_range("values", values, 1, 64, integer=True)
        check_range("queries", queries, 1, 64, integer=True)
        check_choice("key_type", key_type, NEEDLE_TYPES)
        check_choice("value_type", value_type, NEEDLE_TYPES)
        check_choice("haystack", haystack, NIAH_HAYSTACKS)
        self.keys, self.values, self.queries = max(keys, queries), values, queries  # RULER: k = max(k, q)
        self.key_type, self.value_type, self.haystack = key_type, value_type, haystack

    @staticmethod
    def _random(rng: np.random.Generator, kind: str) -> str:
        if kind == "numbers":
            return str(int(rng.integers(10**6, 10**7)))  # RULER: 7 digits
        if kind == "words":
            return WORD_KEYS[int(rng.integers(len(WORD_KEYS)))]
        return str(uuid.UUID(int=int.from_bytes(rng.bytes(16), "big"), version=4))

    def _distinct(self, rng: np.random.Generator, kind: str, count: int, avoid: set[str] = frozenset()) -> list[str]:
        """`count` distinct draws none of which is in `avoid` (an asked key twice would make two answers right)."""
        out: list[str] = []
        while len(out) < count:
            x = self._random(rng, kind)
            if x not in avoid and x not in out:
                out.append(x)
        return out

    def _needle(self, key: str, value: str) -> str:
        text = NEEDLE.format(type_needle_v=self.value_type, key=key, value=value)
        return {"noise": f"\n{text}\n", "essay": f" {text} ", "needle": f"\n{text}"}[self.haystack]

    def _draw(self, rng: np.random.Generator):
        """keys, their values, the asked keys' indices, the needles as (key index, value) in a random order."""
        keys = self._distinct(rng, self.key_type, self.keys)
        values = [self._distinct(rng, self.value_type, self.values) for _ in keys]
        asked = [int(i) for i in rng.choice(self.keys, size=self.queries, replace=False)]
        needles = [(k, v) for k in range(self.keys) for v in values[k]]
        order = rng.permutation(len(needles))
        return keys, asked, [needles[i] for i in order]

    def _prompt(self, keys: list[str], asked: list[int]) -> tuple[str, str]:
        head, tail = prompt(self.value_type, query_text([keys[i] for i in asked]), self.queries * self.values == 1)
        return (head.removesuffix("\n") if self.haystack == "needle" else head), tail  # needle lines bring their "\n"

    def _fixed(self, keys: list[str], asked: list[int], needles: list[tuple[int, str]]) -> int:
        e = self.encoder
        head, tail = self._prompt(keys, asked)
        answers = [v for i in asked for k, v in needles if k == i]
        return (len(e(head)) + len(e(tail)) + sum(len(e(self._needle(keys[k], v))) for k, v in needles)
                + sum(len(e(f" {v}")) for v in answers) + (len(answers) - 1) * len(e(",")))

    def min_length(self) -> int:
        # bytes: the same for every draw but uuids' and words' lengths; BPE varies
        return self.longest_draw(self._draw, self._fixed)

    def build(self, rng: np.random.Generator, length: int, depth: float | None) -> Example:
        keys, asked, needles = self.fitting_draw(rng, length, self._draw, self._fixed)
        n = length - self._fixed(keys, asked, needles)
        # one needle of the first asked key at the eval depth, the others at RULER's depths: distinct
        # while its 40 last (RULER draws them without replacement), repeated past 41 needles
        first = next(j for j, (k, _) in enumerate(needles) if k == asked[0])
        others = iter(rng.choice(RULER_DEPTHS, size=len(needles) - 1, replace=len(needles) - 1 > len(RULER_DEPTHS)))
        depths = [depth if j == first else float(next(others)) for j in range(len(needles))]

        s = Segments(self.encoder)
        head, tail = self._prompt(keys, asked)
        if self.haystack == "needle":
            lines, used = self._distractors(rng, n, set(keys))
            s.text(head)
            units = len(lines)
            inserts = sorted((round(d * units), j) for j, d in enumerate(depths))
            previous = 0
            for at, j in inserts:
                for line in lines[previous:at]:
                    s.text(line)
                s.text(self._needle(keys[needles[j][0]], needles[j][1]))
                previous = at
            for line in lines[previous:]:
                s.text(line)
            s.pad(n - used)  # after the haystack: the prompt opens the example, as RULER's does
        else:
            units = n
            s.text(head)
            inserts = sorted((round(d * n), j) for j, d in enumerate(depths))
            filler = stream_filler(self.encoder, self.haystack, rng, n)
            write_with_inserts(s, filler, [(at, self._needle(keys[needles[j][0]], needles[j][1])) for at, j in inserts])
        s.text(tail)
        in_context = [needles[j] for _, j in inserts]  # needles in the order they stand
        for i, value in enumerate(v for k in asked for kk, v in in_context if kk == k):
            if i:
                s.text(",")
            s.answer(f" {value}")
        at_first = next(at for at, j in inserts if j == first)
        return s.finish(length, at_first / units if units else depth)

    def _distractors(self, rng: np.random.Generator, budget: int, keys: set[str]) -> tuple[list[str], int]:
        """RULER's needle haystack: needle lines with random keys (none of the real ones) and values, as
        many whole lines as fit in `budget` tokens; (lines, tokens they take)."""
        lines, used = [], 0
        while True:
            line = self._needle(self._distinct(rng, self.key_type, 1, keys)[0], self._random(rng, self.value_type))
            cost = len(self.encoder(line))
            if used + cost > budget:
                return lines, used
            lines.append(line)
            used += cost
