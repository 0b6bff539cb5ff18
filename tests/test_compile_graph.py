"""train.compile sees one graph: the model's forward has no graph break on the bias paths it
compiles (a break splits the compiled model and costs a device sync per layer on CUDA). The model
tells attention its default positions are consecutive, so the distance table's span is not read off
the positions tensor (int(offsets[-1]), a sync and a break), and flex inside a compiled graph is
traced as part of it (no dynamo config patch around it)."""

from __future__ import annotations

import pytest
import torch

from relpos_cli.attention import flex_available
from relpos_cli.model import build_model


def graph_breaks(backend: str, pos: str) -> list[str]:
    cfg = {"model": {"d_model": 32, "n_layers": 1, "n_heads": 2, "attn_backend": backend}, "train": {"seq_len": 64},
           "pos": {"name": pos}}
    model = build_model(cfg, 50).eval()
    torch._dynamo.reset()
    with torch.no_grad():
        explained = torch._dynamo.explain(model)(torch.randint(0, 50, (1, 64)))
    return [str(b.reason).splitlines()[0] for b in explained.break_reasons]


@pytest.mark.skipif(not flex_available(), reason="FlexAttention needs torch >= 2.5")
@pytest.mark.parametrize("pos", ["alibi", "t5"])
def test_a_distance_table_under_flex_compiles_without_a_graph_break(pos):
    assert graph_breaks("flex", pos) == []


def test_sdpa_with_a_bias_compiles_without_a_graph_break():
    assert graph_breaks("sdpa", "alibi") == []


@pytest.mark.parametrize("pos", ["none", "alibi", "rope", "t5", "fire"])
def test_training_steps_compile_the_loss_once(pos):
    """train.compile's steps after the first run the first step's graph: nothing the first call caches
    on the model (its positions, a layer's dense bias) is guarded on by the second, whose recompile
    took as long as the first compile (a 125M model: tens of seconds on a GPU)."""
    cfg = {"model": {"d_model": 32, "n_layers": 1, "n_heads": 2}, "train": {"seq_len": 64}, "pos": {"name": pos}}
    model = build_model(cfg, 50)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 50, (2, 65), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    loss_fn = torch.compile(model.loss, backend="eager")  # dynamo's guards decide a recompile, whatever the backend
    for step in range(3):
        with torch._dynamo.config.patch(error_on_recompile=step > 0):
            loss_fn(tokens[:, :-1], tokens[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad()
