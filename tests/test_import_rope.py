"""RoPE scaling in GGUF files, which transformers' GGUF loader does not read: the
``{arch}.rope.scaling.*`` metadata (llama.cpp's names) and llama.cpp's ``rope_freqs.weight``
(Llama 3.x's llama3 scaling, stored as one divisor per frequency). Each case is a tiny Llama
written as a GGUF here (F32, llama.cpp's q/k permutation), imported by `relpos import`, and
compared with transformers' model of the same weights built with the matching rope scaling
config; what relpos cannot import is refused in one line, nothing written.

Mutation checks: without gguf_rope_scaling (read_gguf keeping the loader's config) every scaled
case fails (plain RoPE, train.seq_len = the context length); a factor without a type read as no
scaling fails linear-untyped; the divisors compared for llama3 with LLAMA3_CONVERTED_ORIGINAL only
(the metadata's original length ignored) fails llama3-original-64 and llama3-other-original;
rope_position (families/base.py) passing the file's float32 betas on as they are fails yarn
(pos.scaling's betas are integers); import.json without max_position_embeddings fails every
positive case.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

import numpy as np  # noqa: E402
from test_import import data_args, nothing_left, save_tiny_llama  # noqa: E402

from relpos_cli import load_run  # noqa: E402
from relpos_cli.errors import RelposError  # noqa: E402
from relpos_cli.importing import IMPORT_FILE, import_checkpoint  # noqa: E402

transformers.logging.set_verbosity_error()
CONTEXT = 128  # the GGUF's context_length: transformers' max_position_embeddings


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> tuple[transformers.LlamaForCausalLM, Path]:
    """A tiny Llama (head_dim 16, rope theta 10000) and the dir it is saved in with its byte-level tokenizer."""
    path = save_tiny_llama(tmp_path_factory.mktemp("hf") / "tiny-llama", max_position_embeddings=CONTEXT)
    return transformers.AutoModelForCausalLM.from_pretrained(path).eval(), path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("import os\nclass A:\n    def main(self):\n        return os.sep\n" * 400)
    return path


def llama3_rope_freqs(dim: int, base: float, factor: float, low: float, high: float, original: int) -> np.ndarray:
    """rope_freqs.weight as llama.cpp's convert_hf_to_gguf.py writes it for a llama3 rope scaling
    (LlamaModel.generate_extra_tensors), transcribed: one divisor per frequency."""
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < original / high:
            factors.append(1)
        elif wavelen > original / low:
            factors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32).numpy()


def write_gguf(path: Path, llama, metadata: dict | None = None, rope_freqs: np.ndarray | None = None) -> Path:
    """`llama` as an F32 GGUF, with extra `metadata` ({arch}.rope.* key -> value) and `rope_freqs`."""
    model, hf_dir = llama
    c = model.config
    heads, kv_heads = c.num_attention_heads, c.num_key_value_heads
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(c.hidden_size // heads)
    for key, value in (metadata or {}).items():
        add = writer.add_string if isinstance(value, str) else writer.add_uint32 if isinstance(value, int) else writer.add_float32
        add(key, value)
    tokenizer = json.loads((hf_dir / "tokenizer.json").read_text())
    tokens = [t for t, _ in sorted(tokenizer["model"]["vocab"].items(), key=lambda kv: kv[1])]
    tokens += [f"<pad{i}>" for i in range(c.vocab_size - len(tokens))]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t == "<|endoftext|>" else 1 for t in tokens])
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tokenizer["model"]["merges"]])
    writer.add_eos_token_id(tokens.index("<|endoftext|>"))

    def permute(t: torch.Tensor, n: int) -> torch.Tensor:  # llama.cpp's q/k row order, undone by the loader
        return t.reshape(n, 2, t.shape[0] // n // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)

    w = model.state_dict()
    tensors = {"token_embd.weight": w["model.embed_tokens.weight"], "output_norm.weight": w["model.norm.weight"],
               "output.weight": w["lm_head.weight"]}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        tensors.update({
            f"blk.{i}.attn_norm.weight": w[p + "input_layernorm.weight"],
            f"blk.{i}.ffn_norm.weight": w[p + "post_attention_layernorm.weight"],
            f"blk.{i}.attn_q.weight": permute(w[p + "self_attn.q_proj.weight"], heads),
            f"blk.{i}.attn_k.weight": permute(w[p + "self_attn.k_proj.weight"], kv_heads),
            f"blk.{i}.attn_v.weight": w[p + "self_attn.v_proj.weight"],
            f"blk.{i}.attn_output.weight": w[p + "self_attn.o_proj.weight"],
            f"blk.{i}.ffn_gate.weight": w[p + "mlp.gate_proj.weight"],
            f"blk.{i}.ffn_up.weight": w[p + "mlp.up_proj.weight"],
            f"blk.{i}.ffn_down.weight": w[p + "mlp.down_proj.weight"]})
    for name, t in tensors.items():
        writer.add_tensor(name, t.float().numpy())
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs)
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        write()
    writer.close()
    return path


def with_scaling(llama, rope_scaling: dict | None) -> transformers.LlamaForCausalLM:
    """transformers' model of `llama`'s weights with `rope_scaling` in its config: the reference."""
    model, _ = llama
    config = transformers.LlamaConfig(**{**model.config.to_dict(), "rope_parameters": None,
                                         "rope_theta": model.config.rope_parameters["rope_theta"],
                                         "rope_scaling": rope_scaling})
    reference = transformers.LlamaForCausalLM(config).eval()
    reference.load_state_dict(model.state_dict())
    return reference


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
R = "llama.rope.scaling."


@pytest.mark.parametrize("metadata,rope_freqs,rope_scaling,train_len", [
    ({}, None, None, CONTEXT),
    ({R + "type": "linear", R + "factor": 4.0}, None, {"rope_type": "linear", "factor": 4.0}, CONTEXT),
    ({R + "factor": 4.0}, None, {"rope_type": "linear", "factor": 4.0}, CONTEXT),  # llama.cpp's default type
    ({R + "type": "yarn", R + "factor": 4.0, R + "original_context_length": 32, R + "yarn_beta_fast": 16.0,
      R + "yarn_beta_slow": 2.0}, None,
     {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 16, "beta_slow": 2}, 32),
    # llama.cpp's converter: the original length 8192 (Llama 3.x), or a length the metadata names
    ({}, llama3_rope_freqs(16, 10000.0, 8.0, 1.0, 4.0, 8192), {**LLAMA3, "original_max_position_embeddings": 8192}, 8192),
    ({R + "original_context_length": 64}, llama3_rope_freqs(16, 10000.0, 8.0, 1.0, 4.0, 64),
     {**LLAMA3, "original_max_position_embeddings": 64}, 64),
], ids=["plain", "linear", "linear-untyped", "yarn", "llama3-rope-freqs", "llama3-original-64"])
def test_gguf_rope_scaling_gives_transformers_logits(llama, corpus, tmp_path, metadata, rope_freqs, rope_scaling,
                                                     train_len):
    source = write_gguf(tmp_path / "tiny.gguf", llama, metadata, rope_freqs)
    run = import_checkpoint(str(source), tmp_path / "run", data_args(corpus))
    model, _, config = load_run(run)
    reference = with_scaling(llama, rope_scaling)
    tokens = torch.randint(0, 290, (2, 96), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(tokens).logits
        torch.testing.assert_close(model(tokens), expected, rtol=1e-4, atol=1e-4)
        if rope_scaling:  # the scaling shows at this length: the plain model is another
            assert (with_scaling(llama, None)(tokens).logits - expected).abs().max() > 1e-3
    assert config.pos.scaling.type == (rope_scaling or {}).get("rope_type", "none")
    assert config.train.seq_len == train_len
    assert json.loads((run / IMPORT_FILE).read_text())["max_position_embeddings"] == CONTEXT


@pytest.mark.parametrize("metadata,rope_freqs,message", [
    ({}, np.full(8, 4.0, dtype=np.float32), r"rope_freqs.weight holds per-frequency RoPE divisors that are not "
                                            r"Llama 3's scaling \(factor 4, .* original length 8192\)"),
    ({}, llama3_rope_freqs(16, 10000.0, 8.0, 1.0, 2.0, 8192), r"rope_freqs.weight holds .* not Llama 3's scaling"),  # another high_freq_factor
    ({R + "original_context_length": 64}, llama3_rope_freqs(16, 10000.0, 8.0, 1.0, 4.0, 32),
     r"rope_freqs.weight holds .* not Llama 3's scaling \(factor 8, .* original length 64 or 8192\)"),
    ({R + "type": "linear", R + "factor": 2.0}, llama3_rope_freqs(16, 10000.0, 8.0, 1.0, 4.0, 8192),
     r"rope_freqs.weight together with llama.rope.scaling metadata"),
    ({R + "type": "longrope", R + "factor": 2.0}, None, r"GGUF rope scaling type 'longrope': relpos imports linear and yarn"),
    ({R + "type": "yarn", R + "factor": 4.0, R + "yarn_log_multiplier": 0.1}, None,
     r"GGUF metadata llama.rope.scaling.yarn_log_multiplier=0.1\d*: relpos does not import this RoPE setting"),
], ids=["uniform-divisors", "llama3-other-high-factor", "llama3-other-original", "freqs-and-metadata", "longrope",
        "yarn-log-multiplier"])
def test_gguf_rope_scaling_relpos_cannot_import_is_refused(llama, corpus, tmp_path, metadata, rope_freqs, message):
    source = write_gguf(tmp_path / "tiny.gguf", llama, metadata, rope_freqs)
    with pytest.raises(RelposError, match=f"^{source}: {message}") as e:
        import_checkpoint(str(source), tmp_path / "run", data_args(corpus))
    assert "\n" not in str(e.value) and nothing_left(tmp_path / "run")


def test_an_import_parses_the_gguf_file_once(llama, corpus, tmp_path, monkeypatch):
    """transformers' loader opens the file for the config, the weights and the tokenizer; relpos hands
    it the reader it opened (importing.reader_reused), so the metadata (a whole vocabulary) is parsed
    once, and gguf.GGUFReader is itself again afterwards. The logits test above runs through the same
    path. Mutation seen failing: the loader's calls without reader_reused (4 readers)."""
    import gguf

    built = []

    class Counted(gguf.GGUFReader):
        def __init__(self, *args, **kwargs):
            built.append(args[0])
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", Counted)
    source = write_gguf(tmp_path / "tiny.gguf", llama, {}, None)
    import_checkpoint(str(source), tmp_path / "run", data_args(corpus))
    assert built == [str(source)] and gguf.GGUFReader is Counted
