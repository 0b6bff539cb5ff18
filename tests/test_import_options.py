"""Config options and checkpoint formats a real checkpoint has, beyond test_families' defaults:
a setting of 0 taken for "unset", keys a family's transformers module ignores, half-precision and
sharded weight files (safetensors and .bin, each with its index).

Mutation checks: rope_position reading the rotary fraction with `or` (0 falls through to 1.0, full
rotary) fails test_zero_rotary_fraction_is_refused; Mistral / Qwen2 reading Llama's
attention_bias / mlp_bias fails test_mistral_and_qwen2_ignore_llamas_bias_options; Family.convert
tying the head whatever the checkpoint's own head holds fails test_a_tied_config_with_its_own_head_reads_untied;
importing.convert without its quantisation message fails test_a_quantised_checkpoint_is_named_as_such.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_families import LLAMA, VOCAB, assert_same_logits, random_hf_model  # noqa: E402
from test_import import data_args, save_tiny_llama  # noqa: E402

from relpos_cli import load_run  # noqa: E402
from relpos_cli.errors import RelposError  # noqa: E402
from relpos_cli.families import family_for  # noqa: E402
from relpos_cli.importing import import_checkpoint  # noqa: E402
from relpos_cli.model import build_model  # noqa: E402

T = transformers
T.logging.set_verbosity_error()


def test_zero_rotary_fraction_is_refused():
    """rotary_pct=0 rotates nothing in transformers' GPT-NeoX (logits 1.9 from full rotary's):
    refused, not imported as rotary_fraction 1."""
    c = T.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, rotary_pct=0.0).to_dict()
    with pytest.raises(RelposError, match=r"gpt_neox checkpoint with partial_rotary_factor=0.0 \(no rotated "
                                          r"dimensions\): relpos does not import this variant"):
        family_for(c).convert_config(c)


@pytest.mark.parametrize("config_cls,model_cls", [(T.MistralConfig, T.MistralForCausalLM),
                                                  (T.Qwen2Config, T.Qwen2ForCausalLM)], ids=["mistral", "qwen2"])
def test_mistral_and_qwen2_ignore_llamas_bias_options(config_cls, model_cls):
    """attention_bias and mlp_bias are Llama's: transformers' Mistral and Qwen2 build their fixed
    biases whatever the config names, so the checkpoint holds none of those biases."""
    hf = random_hf_model(config_cls, model_cls, **LLAMA, attention_bias=True, mlp_bias=True)
    assert not any(name.endswith(("o_proj.bias", "mlp.up_proj.bias")) for name in hf.state_dict())
    assert_same_logits(hf)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("import os\nclass A:\n    def main(self):\n        return os.sep\n" * 100)
    return path


@pytest.mark.parametrize("dtype,kind", [(torch.bfloat16, "safetensors"), (torch.float16, "bin")])
def test_half_precision_sharded_weights_import(dtype, kind, corpus, tmp_path):
    """A bf16 / fp16 checkpoint in two shards and an index (model.safetensors.index.json,
    pytorch_model.bin.index.json): relpos's fp32 run gives transformers' logits of the same weights
    (transformers loading the dir in fp32)."""
    model_dir = save_tiny_llama(tmp_path / "llama")
    whole = transformers.AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    (model_dir / "model.safetensors").unlink()
    names = sorted(whole)
    shards = {f"model-0000{i + 1}-of-00002.{kind}": names[i::2] for i in range(2)}
    for file, shard_names in shards.items():
        tensors = {name: whole[name].to(dtype).contiguous() for name in shard_names}
        if kind == "safetensors":
            from safetensors.torch import save_file

            save_file(tensors, model_dir / file, metadata={"format": "pt"})
        else:
            torch.save(tensors, model_dir / file)
    index = "model.safetensors.index.json" if kind == "safetensors" else "pytorch_model.bin.index.json"
    weight_map = {name: file for file, shard_names in shards.items() for name in shard_names}
    (model_dir / index).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))

    model, _, _ = load_run(import_checkpoint(str(model_dir), tmp_path / "run", data_args(corpus)))
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert next(reference.parameters()).dtype == torch.float32
    tokens = torch.randint(0, 300, (1, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), reference(tokens).logits, rtol=1e-4, atol=1e-4)


def test_a_tied_config_with_its_own_head_reads_untied(tmp_path):
    """tie_word_embeddings=true, but the checkpoint's lm_head.weight differs from the embedding:
    transformers loads that head (it ties only equal tensors, modeling_utils.tie_weights), 7 logits
    apart from the embedding's; the same head stored again (as .bin checkpoints do) stays tied."""
    from safetensors.torch import load_file, save_file

    model_dir = save_tiny_llama(tmp_path / "llama", tie_word_embeddings=True)
    weights = load_file(model_dir / "model.safetensors")
    for head, tied in ((weights["model.embed_tokens.weight"].clone(), True), (torch.randn(300, 64) * 0.15, False)):
        save_file({**weights, "lm_head.weight": head}, model_dir / "model.safetensors", metadata={"format": "pt"})
        config = transformers.AutoConfig.from_pretrained(model_dir).to_dict()
        conversion, state = family_for(config).convert(load_file(model_dir / "model.safetensors"), config)
        assert conversion.model["tie_embeddings"] is tied and bool(conversion.notes) is not tied
        ours = build_model({"model": conversion.model, "pos": conversion.pos, "train": {"seq_len": 128}}, 300)
        ours.load_state_dict(state, strict=True)
        reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
        tokens = torch.randint(0, 300, (1, 48), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            torch.testing.assert_close(ours.eval()(tokens), reference(tokens).logits, rtol=1e-4, atol=1e-4)


def test_a_quantised_checkpoint_is_named_as_such(corpus, tmp_path):
    """GPTQ's packed weights (qweight, scales in place of weight) are refused as a quantised
    checkpoint, not as "a weight file is missing or truncated"; nothing is written."""
    from safetensors.torch import load_file, save_file

    model_dir = save_tiny_llama(tmp_path / "llama")
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32}
    (model_dir / "config.json").write_text(json.dumps(config))
    packed = {}
    for name, t in load_file(model_dir / "model.safetensors").items():
        if name.endswith("_proj.weight"):
            stem = name[: -len("weight")]
            packed[stem + "qweight"] = torch.zeros(t.shape[1] // 8, t.shape[0], dtype=torch.int32)
            packed[stem + "scales"] = torch.ones(t.shape[1] // 32, t.shape[0], dtype=torch.float16)
        else:
            packed[name] = t
    save_file(packed, model_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(RelposError, match=r"^the checkpoint's weights are quantised \(config.json's "
                                          r"quantization_config: quant_method 'gptq'\); relpos imports unquantised"):
        import_checkpoint(str(model_dir), tmp_path / "run", data_args(corpus))
    assert not (tmp_path / "run").exists() and not list(tmp_path.glob(".run.importing-*"))


def test_a_gguf_whose_tensors_do_not_fit_its_metadata_says_so(tmp_path):
    """transformers' loader reports the mismatched sizes to the log relpos silences and raises a line
    pointing at that report: the refusal says what it found instead."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    from relpos_cli.importing import read_gguf

    path = tmp_path / "mismatched.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((writer.add_block_count, 0), (writer.add_context_length, 64), (writer.add_embedding_length, 256),
                       (writer.add_feed_forward_length, 256), (writer.add_head_count, 4), (writer.add_head_count_kv, 4),
                       (writer.add_layer_norm_rms_eps, 1e-5), (writer.add_rope_freq_base, 10000.0),
                       (writer.add_tokenizer_model, "gpt2"), (writer.add_token_list, ["a", "b", "c", "<e>"]),
                       (writer.add_token_types, [1, 1, 1, 3]), (writer.add_token_merges, []), (writer.add_eos_token_id, 3)):
        add(value)
    writer.add_tensor("token_embd.weight", np.zeros((4, 128), dtype=np.float32))  # the metadata says 256 wide
    writer.add_tensor("output_norm.weight", np.ones((256,), dtype=np.float32))
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        write()
    writer.close()
    with pytest.raises(RelposError, match=r"its tensors' shapes do not fit the model the loader builds from the "
                                          r"file's metadata") as e:
        read_gguf(path, str(path))
    assert "above report" not in str(e.value)
