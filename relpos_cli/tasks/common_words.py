"""RULER's common words extraction (Hsieh et al. 2024, RULER), after NVIDIA/RULER's
scripts/data/synthetic/common_words_extraction.py, its template and answer prefix
(scripts/data/synthetic/constants.py) and its ``cwe`` configuration (scripts/synthetic.yaml).

A numbered list of words in which ``task.common`` words appear ``task.common_repeats`` times each
and the others ``task.uncommon_repeats`` times, shuffled; the question asks for the common ones::

    [PADS |] [worked example\\n |] Below is a numbered list of words. In these words, some appear
    more often than others. Memorize the ones that appear most often.\\n | 1. |  lamp |  2. |  rapid |
    ... | \\nQuestion: What are the 10 most common words in the above list? Answer: The top 10 words
    that appear most often in the list are: |  1. |  lamp |  2. |  swim | ...

- as RULER: below 4096 tokens the common words appear 6 times and the others once, and the worked
  example (``task.shot=true``) lists 20 words (10 common x 3, 10 x 1); from 4096 tokens on, the
  configured repeats and a worked example of 40 words (10 x 10, 30 x 3); here the long shape starts
  at the first length >= 4096 whose fixed parts fit it (RULER counts its own tokenizer's tokens);
- the list is as long as the example allows: uncommon words are added while they fit, the tokens
  left over are single-token spaces at the start; words come from the embedded nouns, adjectives
  and verbs, or, when a list needs more distinct words than those, from adjective-noun pairs (as
  RULER falls back from wonderwords to a larger English list);
- the worked example answers as RULER's does (`` 1. w 2. w ...``, its common words in drawn order);
- scored: one answer span per common word, `` WORD`` after its number, in the order the words first
  appear in the list (RULER's reference order is random and it accepts any; teacher forcing needs
  one the model can infer). Accuracy = correct spans / spans = RULER's string_match_all.
"""

from __future__ import annotations

import numpy as np

from relpos_cli.errors import RelposError
from relpos_cli.tasks import register
from relpos_cli.tasks.base import Encoder, Example, Segments, Task, check_range
from relpos_cli.tasks.ruler_words import compound_words, single_words

TEMPLATE = ("Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
            "ones that appear most often.\n{context}\nQuestion: What are the {num_cw} most common words in the above list?")
ANSWER_PREFIX = " Answer: The top {num_cw} words that appear most often in the list are:"
LONG = 4096  # RULER's max_seq_length from which the configured repeats and the larger worked example apply
POOLS = (single_words(), compound_words())


def prompt(num_cw: int) -> tuple[str, str]:
    """RULER's template + answer prefix, split at the context (RULER writes 10 where num_cw stands)."""
    head, tail = (TEMPLATE + ANSWER_PREFIX).split("{context}")
    return head, tail.format(num_cw=num_cw)


def numbered(words: list[str]) -> str:
    """RULER's list format: "1. w1 2. w2 ..."."""
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))


@register("common_words")
class CommonWords(Task):
    paper = "Hsieh et al. 2024 (RULER)"

    def __init__(self, encoder: Encoder, common: int = 10, common_repeats: int = 30, uncommon_repeats: int = 3,
                 shot: bool = True):
        super().__init__(encoder)
        check_range("common", common, 1, 10, integer=True)  # the worked examples hold 10 common words
        check_range("uncommon_repeats", uncommon_repeats, 1, integer=True)
        check_range("common_repeats", common_repeats, uncommon_repeats + 1, integer=True)
        if not isinstance(shot, bool):
            raise RelposError(f"task.shot must be a boolean, got {shot!r}")
        self.common, self.repeats, self.shot = common, (common_repeats, uncommon_repeats), shot
        self._long_fits = None

    def _shot(self, rng: np.random.Generator, long: bool) -> str:
        """RULER's worked example (get_example(20, 3, 1) or (40, 10, 3)) answered, then a newline."""
        if not self.shot:
            return ""
        size, cr, ur = (40, 10, 3) if long else (20, 3, 1)
        words = list(rng.choice(POOLS[0], size=size, replace=False))
        common = words[: self.common]
        listed = common * cr + words[self.common :] * ur
        listed = [listed[i] for i in rng.permutation(len(listed))]
        head, tail = prompt(self.common)
        return head + numbered(listed) + tail + " " + numbered(common) + "\n"

    def _item(self, i: int, word: str) -> tuple[str, str]:
        """The segments of list item i (from 1): its number, then the word."""
        return (f"{i}." if i == 1 else f" {i}."), f" {word}"

    def _cost(self, first: int, word: str, times: int) -> int:
        """Tokens of `times` items of `word` numbered from `first` on."""
        e = self.encoder
        return sum(len(e(self._item(i, word)[0])) for i in range(first, first + times)) + times * len(e(f" {word}"))

    def _repeats(self, long: bool) -> tuple[int, int]:
        return self.repeats if long else (6, 1)  # RULER below 4096 tokens: 6 and 1

    def _start(self, rng: np.random.Generator, long: bool, pool: list[str]):
        """One draw's fixed parts (worked example, prompt, the common words' items, the answers):
        (worked example, common words, the pool's order, their tokens)."""
        e = self.encoder
        cr = self._repeats(long)[0]
        shot = self._shot(rng, long)
        head, tail = prompt(self.common)
        order = rng.permutation(len(pool))
        common = [pool[i] for i in order[: self.common]]
        used = (len(e(shot)) + len(e(head)) + len(e(tail)) + sum(self._cost(1 + j * cr, w, cr) for j, w in enumerate(common))
                + sum(len(e(f" {j + 1}.")) + len(e(f" {w}")) for j, w in enumerate(common)))
        return shot, common, order, used

    def _fill(self, rng: np.random.Generator, length: int, long: bool):
        """(worked example, common words, uncommon words, tokens used): uncommon words added while they
        fit; None when the fixed parts do not fit (the caller draws again)."""
        cr, ur = self._repeats(long)
        for pool in POOLS:  # the embedded words, then (a list too long for them) adjective-noun pairs
            shot, common, order, used = self._start(rng, long, pool)
            if used > length:
                return None
            count, uncommon = cr * self.common, []
            for i in order[self.common :]:
                add = self._cost(count + 1, pool[i], ur)
                if used + add > length:
                    return shot, common, uncommon, used
                used, count = used + add, count + ur
                uncommon.append(pool[i])
        raise RelposError(f"task=common_words at length {length} needs more than {len(POOLS[-1])} distinct words, "
                          f"the embedded lists' most; use shorter task.eval_lengths")

    def _long(self, length: int) -> bool:
        """RULER's long shape from 4096 tokens on, once its fixed parts fit (the longest of 16 draws)."""
        if self._long_fits is None:
            rng = np.random.default_rng(0)
            self._long_fits = max(self._start(rng, True, POOLS[0])[3] for _ in range(16))
        return length >= max(LONG, self._long_fits)

    def min_length(self) -> int:
        # bytes: close to fixed (words differ in length); BPE varies: the longest of 16 fixed draws
        rng = np.random.default_rng(0)
        return max(self._start(rng, False, POOLS[0])[3] for _ in range(16))

    def build(self, rng: np.random.Generator, length: int, depth: float | None) -> Example:
        long = self._long(length)
        drawn = self._fill(rng, length, long)
        while drawn is None:
            drawn = self._fill(rng, length, long)
        shot, common, uncommon, used = drawn
        cr, ur = self._repeats(long)
        listed = common * cr + uncommon * ur
        listed = [listed[i] for i in rng.permutation(len(listed))]
        head, tail = prompt(self.common)
        s = Segments(self.encoder).text(shot).text(head)
        for i, word in enumerate(listed, 1):
            number, text = self._item(i, word)
            s.text(number).text(text)
        s.pad(length - used).text(tail)  # after the list: the prompt opens the example, as RULER's does
        first_seen = sorted(common, key=listed.index)
        for j, word in enumerate(first_seen, 1):
            s.text(f" {j}.").answer(f" {word}")
        return s.finish(length)
