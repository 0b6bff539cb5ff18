"""Tokenizers turn documents into one token stream; documents are separated by an end token."""

from __future__ import annotations

from typing import Iterable

import numpy as np

from relpos_cli.errors import RelposError


class ByteTokenizer:
    """UTF-8 bytes, vocab 256. NUL (0) never occurs in text, so it ends each document."""

    name = "bytes"
    vocab_size = 256
    eos_id = 0

    def encode_documents(self, texts: Iterable[str]) -> np.ndarray:
        end = bytes([self.eos_id])
        stream = b"".join(t.encode("utf-8") + end for t in texts if t)
        return np.frombuffer(stream, dtype=np.uint8).copy()

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


TOKENIZERS = {"bytes": ByteTokenizer}


def build_tokenizer(name: str) -> ByteTokenizer:
    if name not in TOKENIZERS:
        raise RelposError(f"unknown data.tokenizer {name!r}; choose one of: {', '.join(TOKENIZERS)}")
    return TOKENIZERS[name]()
