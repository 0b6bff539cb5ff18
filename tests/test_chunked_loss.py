"""Evaluation's loss in chunks (Transformer.token_losses): the same per-token losses as the whole
(B, T, V) logits give, while the head never sees more rows than its chunk.

Mutation checked: slicing the targets one row late (flat_targets[start + 1 : ...]) fails
test_chunked_losses_equal_whole_logits; dropping the chunking (rows = B*T) fails
test_head_never_sees_more_than_a_chunk."""

import pytest
import torch

from relpos_cli.model import build_model

TINY = {"d_model": 32, "n_layers": 2, "n_heads": 4, "mlp_ratio": 2, "dropout": 0.0, "attn_backend": "auto"}
LLAMA_LIKE = {**TINY, "n_kv_heads": 2, "mlp": "swiglu", "norm": "rmsnorm", "tie_embeddings": False, "vocab_size": 300}


@pytest.mark.parametrize("model_cfg", [TINY, LLAMA_LIKE], ids=["relpos", "llama-like"])
@pytest.mark.parametrize("chunk_bytes", [4 * 300 * 7, 4 * 300 * 64, 1])
def test_chunked_losses_equal_whole_logits(model_cfg, chunk_bytes):
    torch.manual_seed(0)
    model = build_model({"model": model_cfg, "pos": {"name": "rope"}, "train": {"seq_len": 64}}, 300).eval()
    tokens = torch.randint(0, 300, (3, 41))
    with torch.no_grad():
        whole = model.loss(tokens[:, :-1], tokens[:, 1:], reduction="none")
        chunked = model.token_losses(tokens[:, :-1], tokens[:, 1:], chunk_bytes=chunk_bytes)
    assert chunked.shape == (3, 40)
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-5)


def test_head_never_sees_more_than_a_chunk():
    model = build_model({"model": LLAMA_LIKE, "pos": {"name": "rope"}, "train": {"seq_len": 64}}, 300).eval()
    seen = []
    model.lm_head.register_forward_hook(lambda module, args, out: seen.append(out.shape[0]))
    tokens = torch.randint(0, 300, (2, 100))
    with torch.no_grad():
        model.token_losses(tokens[:, :-1], tokens[:, 1:], chunk_bytes=4 * 300 * 16)
    assert max(seen) == 16 and sum(seen) == 2 * 99
