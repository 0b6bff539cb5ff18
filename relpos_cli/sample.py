"""`relpos sample`: text from a trained run, to eyeball what its numbers mean.

Greedy (temperature 0), temperature and top-k decoding as in litgpt's and x-transformers'
`generate`, seeded. The prompt is encoded with the run's own tokenizer (bytes, or the BPE saved in
its data cache) after the end-of-document token, as a document starts in the training stream.
The model has no KV cache: each new token runs the last `context` tokens again (fine for the small
models relpos trains; the scheme sees positions 0..context-1, as in training).
"""

from __future__ import annotations

import math

from pathlib import Path
from typing import Iterable, Iterator

import torch
from omegaconf import OmegaConf

from relpos_cli.checkpoint import load_config, load_trained_model
from relpos_cli.config import apply_overrides, check_override_keys, validate_run_config
from relpos_cli.data import load_token_data
from relpos_cli.distributed import resolve_device
from relpos_cli.errors import RelposError
from relpos_cli.extension import resolve_longest_factor
from relpos_cli.model import Transformer

SAMPLE_KEYS = ("eval.*",)  # how positions are used at evaluation: the model eval-length scores with them


def next_token(logits: torch.Tensor, temperature: float, top_k: int, generator: torch.Generator) -> int:
    """One token id from logits (V,): argmax at temperature 0, else a draw from
    softmax(logits / temperature) restricted to the top_k most likely tokens (0: all of them)."""
    if temperature == 0:
        return int(logits.argmax())
    # shifted so the largest is 0 before dividing: a tiny temperature sends the others to -inf, never to inf - inf
    scaled = (logits.double() - logits.max()) / temperature
    if 0 < top_k < scaled.numel():
        kth = torch.topk(scaled, top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    return int(torch.multinomial(scaled.softmax(-1), 1, generator=generator))


@torch.no_grad()
def generate(model: Transformer, prompt: list[int], max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
             seed: int = 0, context: int | None = None, stop_id: int | None = None) -> Iterator[int]:
    """Token ids after `prompt`, one at a time; stops after max_new_tokens or at stop_id (not yielded)."""
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)  # CPU generator: the same draws on any device
    ids = list(prompt)
    for _ in range(max_new_tokens):
        window = torch.tensor(ids[-context:] if context else ids, device=device)[None]  # (1, T)
        token = next_token(model(window)[0, -1].float().cpu(), temperature, top_k, generator)
        if token == stop_id:
            return
        ids.append(token)
        yield token


def check_sampling(max_new_tokens: int, temperature: float, top_k: int, context: int | None,
                   vocab_size: int | None = None) -> None:
    """The options, before the run is loaded; top_k against the vocabulary once it is known."""
    if max_new_tokens <= 0:
        raise RelposError(f"--max-new-tokens must be positive, got {max_new_tokens}")
    if not 0 <= temperature < math.inf:  # NaN too
        raise RelposError(f"--temperature must be a finite number >= 0 (0 = greedy), got {temperature}")
    if top_k < 0 or (vocab_size is not None and top_k > vocab_size):
        raise RelposError(f"--top-k must be between 0 (all tokens) and the vocabulary size {vocab_size or 'V'}, got {top_k}")
    if context is not None and context <= 0:
        raise RelposError(f"--context must be positive, got {context}")


def check_prompt(prompt: str) -> None:
    """The prompt is text: bytes that are not UTF-8 on the command line reach Python as lone surrogates,
    which no tokenizer encodes."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = prompt[e.start]
        byte = f"byte 0x{ord(bad) - 0xDC00:02x}" if 0xDC80 <= ord(bad) <= 0xDCFF else f"U+{ord(bad):04X}"
        raise RelposError(f"--prompt is not UTF-8 text ({byte} at character {e.start}): give the prompt as UTF-8") \
            from None


def sample_run(run_dir: Path, prompt: str, max_new_tokens: int, temperature: float, top_k: int, seed: int,
               context: int | None, device_name: str, overrides: list[str] = ()) -> Iterator[str]:
    """Decoded text pieces after the prompt, as they are generated. overrides: eval.* settings
    (eval.rope_scaling, eval.self_extend, ...), the model built as eval-length builds it."""
    check_sampling(max_new_tokens, temperature, top_k, context)
    check_prompt(prompt)
    check_override_keys(list(overrides), SAMPLE_KEYS, "sample")
    device = resolve_device(device_name)
    cfg = apply_overrides(load_config(Path(run_dir), whole_run=True), list(overrides))
    validate_run_config(cfg)
    context = context or int(cfg.train.seq_len)
    resolve_longest_factor(cfg.eval, context, int(cfg.train.seq_len))  # factor=longest: the longest window sampled
    cfg, model = load_trained_model(Path(run_dir), device, cfg)
    tokenizer = load_token_data(OmegaConf.to_container(cfg.data, resolve=True)).tokenizer
    check_sampling(max_new_tokens, temperature, top_k, context, tokenizer.vocab_size)
    prompt_ids = tokenizer.encode(prompt)
    ids = [tokenizer.eos_id, *prompt_ids]
    model.scheme.check_length(min(context, len(ids) + max_new_tokens - 1))  # the longest window it will run
    tokens = generate(model, ids, max_new_tokens, temperature, top_k, seed, context, tokenizer.eos_id)
    yield from continuation_text(tokenizer, prompt_ids, tokens)


def continuation_text(tokenizer, prompt_ids: list[int], tokens: Iterable[int]) -> Iterator[str]:
    """The text the new tokens add after the prompt, in pieces as they come. It is decoded together
    with the prompt: a tokenizer whose decoder strips the text's first space (SentencePiece's, Llama's
    and Mistral's: "▁Paris" alone decodes to "Paris") would otherwise glue the first word to the prompt.
    A piece waits while the text ends in an incomplete multi-byte character."""
    before = tokenizer.decode(prompt_ids)
    new: list[int] = []
    shown = ""

    def added() -> str:
        text = tokenizer.decode([*prompt_ids, *new])
        return text[len(before):] if text.startswith(before) else tokenizer.decode(new)

    for token in tokens:
        new.append(token)
        text = added()
        if not text.endswith("\ufffd"):  # a multi-byte character still incomplete: wait for its other bytes
            yield text[len(shown):]
            shown = text
    text = added()
    if text != shown:
        yield text[len(shown):]
