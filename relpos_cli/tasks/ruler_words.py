"""What RULER's synthetic tasks share: embedded word lists, RULER's needle depths, and a haystack
with lines inserted at token offsets (Hsieh et al. 2024, "RULER: What's the Real Context Size of
Your Long-Context Language Models?", https://github.com/NVIDIA/RULER, scripts/data/synthetic/).

RULER draws its words from the ``wonderwords`` package (about 9,000 nouns, adjectives and verbs;
niah keys are adjective-noun pairs from them) and its essay haystack from Paul Graham's essays.
relpos embeds small lists instead (no download, the same words on every machine) and takes the
essay haystack from the run's own corpus, cut from its token stream.
"""

from __future__ import annotations

import numpy as np

from relpos_cli.errors import RelposError
from relpos_cli.tasks.base import Encoder, Segments

ADJECTIVES = tuple("""
able acid angry bitter black bold brave bright broad calm cheap clean clever cold cool crisp curly damp
dark deep dry dull eager early empty fair fancy fast fierce flat fresh gentle glad golden grand green
happy hard heavy hollow huge humble jolly kind large late lazy light little loud lucky mellow mighty
narrow neat noisy odd plain polite proud quick quiet rapid rare rich rough round royal rude rusty sad
sharp shiny short shy silent silver simple slow small smooth soft solid sour spicy steep sticky stiff
strong sunny sweet swift tall tame tender thick thin tidy tiny tough warm weak wet white wide wild wise
young
""".split())
NOUNS = tuple("""
acorn anchor apple arrow badge bakery balloon banana barrel basket beach bell bicycle blanket boat bottle
bridge bucket butter button cabin camera candle canoe canyon carpet castle cherry circus cliff clock
cloud coat comet compass cookie copper cottage crayon crown desert diamond dolphin door dragon drum eagle
engine feather fence fiddle flag flute forest fountain garden giraffe glove guitar hammer harbor helmet
honey island jacket jungle kettle kitten ladder lamp lantern lemon library lizard magnet maple meadow
mirror monkey needle notebook ocean orange owl palace panda parrot peach pencil pepper piano pillow
pirate planet pocket pumpkin puzzle rabbit radio river rocket saddle sailor shadow shell spoon squirrel
statue summit teapot tiger tomato tower tractor trumpet tunnel umbrella valley violin wagon walnut
window wizard zebra
""".split())
VERBS = tuple("""
accept admire allow arrive bake borrow bounce build carry catch chase climb collect cook count crawl
dance deliver describe dig divide drift earn enjoy explain explore fetch fold follow gather giggle glow
greet grow guard hammer hug hunt imagine invent jump juggle knit laugh launch lift listen march measure
melt mend notice obey offer open paint pack plant polish pour promise pull push question reach remember
repair rescue scatter search shout sing sketch skip smile sneeze sort splash squeeze stack stir stretch
swim tickle travel trust unlock visit wander wash whisper wiggle wink wonder wrap yawn
""".split())

# RULER's candidate needle depths (percent): np.round(np.linspace(0, 100, num=40)), as fractions
RULER_DEPTHS = tuple(float(d) / 100 for d in np.round(np.linspace(0, 100, num=40)).astype(int))
HAYSTACKS = ("noise", "essay")  # filler streams: the classic sentences (RULER's "noise"), the run's corpus


def single_words() -> list[str]:
    """Every embedded noun, adjective and verb once, sorted (RULER's common-words pool)."""
    return sorted(set(NOUNS) | set(ADJECTIVES) | set(VERBS))


def compound_words() -> list[str]:
    """adjective-noun pairs, sorted: RULER's niah word keys ("{adj}-{noun}")."""
    return sorted(f"{a}-{n}" for a in ADJECTIVES for n in NOUNS)


def check_choice(key: str, value: object, choices: tuple[str, ...]) -> None:
    """task.<key> must be one of `choices`: one line saying so otherwise."""
    if value not in choices:
        raise RelposError(f"task.{key}={value!r}; choose one of: {', '.join(choices)}")


def stream_filler(encoder: Encoder, haystack: str, rng: np.random.Generator, n: int) -> np.ndarray:
    """n haystack tokens: the classic sentences (noise) or the run's corpus (essay), from a random point."""
    if haystack == "noise":
        return encoder.classic_filler(rng, n)
    have = 0 if encoder.corpus is None else len(encoder.corpus)
    if have <= n:  # named by this task's key, not passkey's task.filler
        raise RelposError(f"task.haystack=essay needs {n} tokens of the run's corpus; the corpus split has {have}")
    return encoder.corpus_filler(rng, n)


def write_with_inserts(s: Segments, filler: np.ndarray, inserts: list[tuple[int, str]]) -> Segments:
    """The filler tokens with each text of `inserts` (token offset into the filler, text) written as its
    own segment before the filler token at that offset; inserts are taken in order of offset, ties
    in the order given (so a chain's lines keep their order)."""
    previous = 0
    for offset, text in sorted(inserts, key=lambda item: item[0]):
        s.filler(filler[previous:offset]).text(text)
        previous = offset
    return s.filler(filler[previous:])
