"""Tokenizers turn documents into one token stream; documents are separated by an end token.

Every token id stands for a fixed byte string (the end token for one separator byte), so
`token_bytes` gives the UTF-8 bytes any slice of the stream covers: what bits per byte divide by.
"""

from __future__ import annotations

from itertools import chain
from pathlib import Path
from typing import Any, Iterable, Union

import numpy as np

from relpos_cli.atomic import atomic_write_text
from relpos_cli.errors import RelposError

# NUL ends a document for both tokenizers: one byte, as good as never in text
END_TOKEN = "\x00"
# what a text is encoded after to get its mid-document tokens (HfTokenizer.encode_segment): a newline is
# a token of its own (a byte fallback) in SentencePiece vocabularies, merged with nothing that follows it
SEGMENT_SENTINEL = "\n"
BOS_PROBE = "relpos"  # any text: the special tokens a tokenizer adds before it, it adds before every text


class ByteTokenizer:
    """UTF-8 bytes, vocab 256. NUL (0) never occurs in text, so it ends each document."""

    name = "bytes"
    vocab_size = 256
    eos_id = 0

    def encode_documents(self, texts: Iterable[str]) -> np.ndarray:
        end = bytes([self.eos_id])
        stream = b"".join(t.encode("utf-8") + end for t in texts if t)
        return np.frombuffer(stream, dtype=np.uint8).copy()

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    encode_segment = encode  # bytes are the same wherever they stand
    start_ids: list[int] = []  # nothing before a text: a document starts after the end token

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    @property
    def token_bytes(self) -> np.ndarray:
        return np.ones(self.vocab_size, dtype=np.int64)  # (vocab,)


class BpeTokenizer:
    """Byte-level BPE (Hugging Face `tokenizers`, GPT-2 style): each byte is first mapped to one of
    256 printable characters, so no byte is unknown and decode(encode(text)) == text for any text."""

    name = "bpe"

    def __init__(self, tokenizer: Any):  # a tokenizers.Tokenizer; imported lazily, as `datasets` is
        self._tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size()
        self.eos_id = tokenizer.token_to_id(END_TOKEN)

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> "BpeTokenizer":
        """Learn merges from `texts` (an iterator is read once, so a streamed corpus never sits in RAM)."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tokenizer = Tokenizer(models.BPE())
        # no normalizer and no prefix space: anything else would change the text and break round trips
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=[END_TOKEN], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tokenizer.train_from_iterator(texts, trainer)
        return cls(tokenizer)

    @classmethod
    def load(cls, path: Path) -> "BpeTokenizer":
        from tokenizers import Tokenizer

        return cls(Tokenizer.from_file(str(path)))

    def save(self, path: Path) -> None:
        atomic_write_text(path, self._tokenizer.to_str())

    def encode_documents(self, texts: Iterable[str]) -> np.ndarray:
        docs = [t for t in texts if t]
        # a NUL inside a text is split out as the end token too, exactly as in the byte stream
        encodings = self._tokenizer.encode_batch_fast(docs)
        return np.fromiter(chain.from_iterable(e.ids + [self.eos_id] for e in encodings), dtype=np.uint32)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text).ids

    encode_segment = encode  # no normalizer and no prefix space: a text's tokens are the same mid-document
    start_ids: list[int] = []  # nothing before a text: a document starts after the end token

    def decode(self, ids: Iterable[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    @property
    def token_bytes(self) -> np.ndarray:
        # byte-level tokens spell one character per byte (the end token is the one-byte NUL itself), so
        # a token's byte length is its string length; decoding single tokens would garble split UTF-8
        lengths = [len(self._tokenizer.id_to_token(i)) for i in range(self.vocab_size)]
        return np.array(lengths, dtype=np.int64)  # (vocab,)


class HfTokenizer:
    """A pretrained model's own tokenizer (its tokenizer.json, Hugging Face `tokenizers`), saved in
    the imported run dir. Documents are encoded without the special tokens the model's template
    would add and end with its end-of-sequence token (data.eos_token)."""

    name = "hf"

    def __init__(self, tokenizer: Any, eos_token: str, path: Path | None = None):
        self._tokenizer = tokenizer
        self.path = path
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_id = tokenizer.token_to_id(eos_token)
        self._marks_start: bool | None = None  # probed at the first encode_segment
        self._start_ids: list[int] | None = None  # probed at the first start_ids
        if self.eos_id is None:
            raise RelposError(f"data.eos_token={eos_token!r} is not a token of {path or 'the tokenizer'}")

    @classmethod
    def load(cls, path: Path, eos_token: str) -> "HfTokenizer":
        from tokenizers import Tokenizer

        try:
            return cls(Tokenizer.from_file(str(path)), eos_token, Path(path))
        except RelposError:
            raise
        except Exception as e:  # tokenizers raises a bare Exception for a broken file
            if isinstance(e, OSError):
                raise
            raise RelposError(f"{path}: unreadable tokenizer ({str(e).splitlines()[0][:100]})") from None

    def encode_documents(self, texts: Iterable[str]) -> np.ndarray:
        docs = [t for t in texts if t]
        encodings = self._tokenizer.encode_batch_fast(docs, add_special_tokens=False)
        return np.fromiter(chain.from_iterable(e.ids + [self.eos_id] for e in encodings), dtype=np.uint32)

    def encode(self, text: str, special_tokens: bool = False) -> list[int]:
        """The text's ids; with special_tokens, also those the tokenizer's post-processor adds around
        it (a BOS for Llama or Mistral), as transformers' encode adds them by default."""
        return self._tokenizer.encode(text, add_special_tokens=special_tokens).ids

    def encode_segment(self, text: str) -> list[int]:
        """The ids of `text` where it stands inside a document, after other text. A SentencePiece
        tokenizer (Llama 2, Mistral: normalizer Prepend("▁"), or Metaspace) marks the start of every
        text it encodes with "▁", a space the text has not mid-document: " 4171826" alone is
        "▁▁4171826", in running text "▁4171826". Such text is encoded after SEGMENT_SENTINEL, whose ids
        are then dropped; a tokenizer that adds nothing encodes it as it is."""
        if not self._marks_text_start:
            return self.encode(text)
        sentinel = self.encode(SEGMENT_SENTINEL)
        ids = self.encode(SEGMENT_SENTINEL + text)
        if ids[: len(sentinel)] != sentinel:  # merged with the text: its tokens cannot be told apart
            raise RelposError(f"{self.path or 'the tokenizer'} merges {SEGMENT_SENTINEL!r} with the text {text[:40]!r}: "
                              f"the tasks cannot encode that text on its own as it stands mid-document")
        return ids[len(sentinel):]

    @property
    def start_ids(self) -> list[int]:
        """The special token the tokenizer's post-processor puts before every text (Llama's and
        Mistral's BOS), which transformers' encode, and so a pretrained model's every prompt, has by
        default; [] where it adds none (GPT-2, Qwen2, SmolLM2)."""
        if self._start_ids is None:
            bare, full = self.encode(BOS_PROBE), self.encode(BOS_PROBE, special_tokens=True)
            self._start_ids = [] if full[: len(bare)] == bare else full[:1]
        return self._start_ids

    @property
    def _marks_text_start(self) -> bool:
        """Whether the tokenizer adds something at the start of every text (SentencePiece's "▁", a
        byte-level BPE's add_prefix_space): "x" alone is then not "x" after other text."""
        if self._marks_start is None:
            alone = self.encode("x")
            after = self.encode(SEGMENT_SENTINEL + "x")[len(self.encode(SEGMENT_SENTINEL)):]
            self._marks_start = alone != after
        return self._marks_start

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """The text of ids; skip_special_tokens leaves out special tokens (BOS, EOS, chat markers), as
        transformers' decode(skip_special_tokens=True)."""
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    @property
    def token_bytes(self) -> np.ndarray:
        """UTF-8 bytes per token: byte-level vocabularies spell one character per byte; SentencePiece
        ones write a space as U+2581 and a raw byte as <0xNN>; an added token that is not special is
        its text; a special token (the document separator among them) counts one byte, as the end
        token of the other tokenizers."""
        import json
        import re

        spec = json.loads(self._tokenizer.to_str())
        byte_level = "ByteLevel" in json.dumps(spec.get("decoder")) or "ByteLevel" in json.dumps(spec.get("pre_tokenizer"))
        special = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
        # an added token that is not special is matched in the raw text before the model's own vocabulary
        # (its content is text, not byte-level characters or U+2581): its UTF-8 bytes, whatever the vocabulary
        added = {t["id"]: t["content"] for t in spec.get("added_tokens", []) if not t.get("special")}
        raw_byte = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")
        lengths = np.ones(self.vocab_size, dtype=np.int64)  # (vocab,)
        for i in range(self.vocab_size):
            token = self._tokenizer.id_to_token(i)
            if token is None or i in special:
                continue
            if i in added:
                lengths[i] = len(added[i].encode("utf-8"))
            elif byte_level:
                lengths[i] = len(token)
            elif raw_byte.match(token):
                lengths[i] = 1
            else:
                lengths[i] = len(token.replace("\u2581", " ").encode("utf-8"))
        return lengths


Tokenizer = Union[ByteTokenizer, BpeTokenizer, HfTokenizer]
