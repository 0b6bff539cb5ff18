"""`relpos import`: a Hugging Face model dir, a hub id (from a local hub cache built here, offline)
or a GGUF file becomes a run dir that every command reads like a trained run.

test_imported_run_matches_transformers checks the whole path (weights written, config saved,
tokenizer kept) against transformers' forward on the same dir; mutation checked: saving the
config without the family options (cfg.model = relpos's defaults) fails it. The bad-input tests
each check a one-line error, a non-zero exit where the CLI runs, and that nothing is left at
OUT_DIR or beside it.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

transformers = pytest.importorskip("transformers")

from conftest import run_cli  # noqa: E402
from relpos_cli import load_run  # noqa: E402
from relpos_cli.errors import Interrupted, RelposError  # noqa: E402
from relpos_cli.importing import IMPORT_FILE, import_checkpoint  # noqa: E402

transformers.logging.set_verbosity_error()
EOS = "<|endoftext|>"


def byte_level_tokenizer(vocab_size: int = 290):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["def main():\n    return 1\n" * 50, "import os\nclass A:\n    pass\n" * 50], trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)


def save_tiny_llama(path: Path, vocab_size: int = 300, **config) -> Path:
    torch.manual_seed(0)
    settings = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    settings.update(config)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**settings))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.15) if p.dim() > 1 else p.uniform_(0.7, 1.3)
    model.save_pretrained(path)
    byte_level_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("hf") / "tiny-llama")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("".join(p.read_text(errors="replace") for p in sorted(root.glob("*.py"))[:30]))
    return path


def data_args(corpus: Path) -> list[str]:
    return ["data=text_files", f"data.files=[{corpus}]"]


def nothing_left(out: Path) -> bool:
    return not out.exists() and not list(out.parent.glob(f".{out.name}.importing-*"))


def test_imported_run_matches_transformers(llama_dir, corpus, tmp_path):
    run = import_checkpoint(str(llama_dir), tmp_path / "run", data_args(corpus))
    model, tokenizer, config = load_run(run)
    reference = transformers.AutoModelForCausalLM.from_pretrained(llama_dir).eval()
    text = "import os\nclass Main:\n    def main(self):\n        return os.sep\n"
    ids = tokenizer.encode(text)
    assert ids == transformers.AutoTokenizer.from_pretrained(llama_dir)(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    tokens = torch.tensor([ids])
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), reference(tokens).logits, rtol=1e-4, atol=1e-4)
    assert config.train.seq_len == 128 and config.model.n_kv_heads == 2 and config.data.tokenizer == "hf"
    assert config.name == llama_dir.name  # compare rows and W&B name the run after its model
    record = json.loads((run / IMPORT_FILE).read_text())
    assert record["family"] == "llama" and record["transformers"] == transformers.__version__
    assert record["max_position_embeddings"] == 128  # the context lm-eval's hf model gives the checkpoint
    from relpos_cli.fingerprint import file_sha256

    assert record["weights"] == {"model.safetensors": file_sha256(llama_dir / "model.safetensors")}
    assert {p.name for p in run.iterdir()} >= {"config.yaml", "checkpoint.pt", "tokenizer.json", "data.json", IMPORT_FILE}


def test_max_position_embeddings_is_where_lm_eval_reads_it():
    """import.json's max_position_embeddings: lm-eval's hf model reads n_positions, then
    max_position_embeddings; BLOOM's config names neither."""
    from relpos_cli.importing import max_position_embeddings

    assert max_position_embeddings(transformers.GPT2Config(n_positions=64).to_dict()) == 64
    assert max_position_embeddings(transformers.LlamaConfig(max_position_embeddings=96).to_dict()) == 96
    assert max_position_embeddings(transformers.BloomConfig().to_dict()) is None


def hub_cache(root: Path, repo_id: str, model_dir: Path) -> str:
    """The Hugging Face hub cache layout: models--ORG--NAME/{snapshots/<commit>/..., refs/main}."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = root / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for f in model_dir.iterdir():
        (snapshot / f.name).write_bytes(f.read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return commit


def test_hub_source_from_the_local_cache(llama_dir, corpus, tmp_path):
    commit = hub_cache(tmp_path / "hub", "acme/tiny-llama", llama_dir)
    env = {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    run_cli("import", "hf:acme/tiny-llama", str(tmp_path / "run"), *data_args(corpus), env=env)
    record = json.loads((tmp_path / "run" / IMPORT_FILE).read_text())
    assert record["revision"] == commit and record["repo_id"] == "acme/tiny-llama" and record["kind"] == "hf"
    run_cli("import", f"hf:acme/tiny-llama@{commit}", str(tmp_path / "pinned"), *data_args(corpus), env=env)
    assert json.loads((tmp_path / "pinned" / IMPORT_FILE).read_text())["requested_revision"] == commit
    assert OmegaConf.load(tmp_path / "run" / "config.yaml").name == "tiny-llama"
    # a model the cache does not hold: one line that says what to pass instead
    proc = run_cli("import", "hf:acme/absent", str(tmp_path / "other"), env=env, check=False)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "the Hugging Face hub is unreachable" in proc.stderr and "pass a local model dir or a .gguf file" in proc.stderr
    assert nothing_left(tmp_path / "other")


def write_gguf(path: Path, quant: str) -> Path:
    """A tiny llama GGUF whose token embedding is stored in `quant`."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(256)
    writer.add_feed_forward_length(256)
    writer.add_head_count(4)
    writer.add_head_count_kv(4)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["a", "b", "c", "<e>"])
    writer.add_token_types([1, 1, 1, 3])
    writer.add_token_merges([])
    writer.add_eos_token_id(3)
    kind = getattr(gguf.GGMLQuantizationType, quant)
    block, size = gguf.GGML_QUANT_SIZES[kind]
    writer.add_tensor("token_embd.weight", np.zeros((4, 256 // block * size), dtype=np.uint8), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_bad_sources_one_line_nothing_written(llama_dir, corpus, tmp_path):
    out = tmp_path / "run"

    def refused(source: str, message: str, *overrides: str) -> None:
        with pytest.raises(RelposError, match=message) as e:
            import_checkpoint(source, out, [*data_args(corpus), *overrides])
        assert "\n" not in str(e.value)
        assert nothing_left(out)

    def model_copy(name: str) -> Path:
        copy = tmp_path / name
        copy.mkdir()
        for f in llama_dir.iterdir():
            (copy / f.name).write_bytes(f.read_bytes())
        return copy

    falcon = model_copy("falcon")
    config = json.loads((falcon / "config.json").read_text())
    (falcon / "config.json").write_text(json.dumps({**config, "model_type": "falcon"}))
    refused(str(falcon), r"architecture 'falcon' is not supported; relpos imports these families: bloom")

    missing = model_copy("missing")
    (missing / "model.safetensors").unlink()
    refused(str(missing), "holds no weights")

    sharded = tmp_path / "sharded"
    transformers.AutoModelForCausalLM.from_pretrained(llama_dir).save_pretrained(sharded, max_shard_size="100KB")
    byte_level_tokenizer().save_pretrained(sharded)
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[-1].unlink()
    refused(str(sharded), f"{shards[-1].name} is missing \\(listed in model.safetensors.index.json\\)")

    truncated = model_copy("truncated")
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    refused(str(truncated), "model.safetensors is unreadable")

    small_embedding = save_tiny_llama(tmp_path / "small-embedding", vocab_size=200)  # the tokenizer has 289
    refused(str(small_embedding), r"the tokenizer has \d+ tokens but model.vocab_size=200: its vocabulary does not fit the embedding")

    refused(str(write_gguf(tmp_path / "q8_1.gguf", "Q8_1")), "transformers cannot load this GGUF file.*Q8_1")
    (tmp_path / "garbage.gguf").write_bytes(b"not a gguf file at all")
    refused(str(tmp_path / "garbage.gguf"), "unreadable as GGUF")
    refused(str(tmp_path / "nowhere"), "is neither hf:ORG/NAME")
    refused(str(llama_dir), "relpos import takes only", "model.n_layers=3")


def test_bad_files_in_a_model_dir_one_line_naming_the_file(llama_dir, corpus, tmp_path):
    """config.json, tokenizer files and weight indexes that are no JSON object, not UTF-8 or name
    nothing usable: each refused in one line naming the source's file (not relpos's temp dir)."""
    out = tmp_path / "new" / "parents" / "run"  # the parent dirs the import makes go with it

    def refused(files: dict[str, bytes | dict], message: str) -> None:
        copy = tmp_path / f"model-{len(list(tmp_path.glob('model-*')))}"
        copy.mkdir()
        for f in llama_dir.iterdir():
            (copy / f.name).write_bytes(f.read_bytes())
        for name, content in files.items():
            (copy / name).write_bytes(content if isinstance(content, bytes) else json.dumps(content).encode())
        with pytest.raises(RelposError, match=message.format(dir=copy)) as e:
            import_checkpoint(str(copy), out, data_args(corpus))
        assert "\n" not in str(e.value) and ".importing-" not in str(e.value)
        assert nothing_left(out) and not (tmp_path / "new").exists()

    config = json.loads((llama_dir / "config.json").read_text())
    refused({"config.json": b"[1, 2]"}, "{dir}/config.json holds an array, not a JSON object")
    refused({"config.json": b"3"}, "{dir}/config.json holds a number, not a JSON object")
    refused({"config.json": b"\xff\xfe{}"}, "{dir}/config.json is not UTF-8 text")
    refused({"config.json": {k: v for k, v in config.items() if k != "model_type"}}, "{dir}/config.json names no model_type")
    refused({"config.json": {**config, "num_hidden_layers": "2"}},
            "{dir}/config.json: transformers cannot read it .*num_hidden_layers' expected int, got str")
    refused({"tokenizer.json": b"garbage"}, "{dir}/tokenizer.json is unreadable as a tokenizer")
    refused({"tokenizer.json": b"\xff\xfe"}, "{dir}/tokenizer.json is not UTF-8 text")
    refused({"tokenizer_config.json": b"[1]"}, "{dir}/tokenizer_config.json holds an array")
    refused({"tokenizer_config.json": {"eos_token": "<nope>"}},
            "{dir}: the end-of-sequence token '<nope>' \\(tokenizer_config.json\\) is not a token of tokenizer.json")
    refused({"tokenizer_config.json": {}, "config.json": {**config, "eos_token_id": 99999}},
            "{dir}: config.json's eos_token_id 99999 is not a token id of tokenizer.json")
    refused({"model.safetensors.index.json": b"[1]"}, "{dir}/model.safetensors.index.json holds an array")
    refused({"model.safetensors.index.json": {"weight_map": ["model.safetensors"]}}, "has no weight_map")


def test_an_unsupported_gguf_architecture_is_refused_before_loading(tmp_path, monkeypatch):
    """The architecture is read from the GGUF metadata: an unsupported one is said with those relpos
    reads, without transformers loading (and dequantising) the file."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(tmp_path / "falcon.gguf"), "falcon")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 256), dtype=np.float32))
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        write()
    writer.close()

    def not_loaded(*args, **kwargs):
        raise AssertionError("transformers loaded the GGUF file")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", not_loaded)
    with pytest.raises(RelposError, match=r"falcon.gguf: GGUF architecture 'falcon' is not supported; relpos imports "
                                          r"GGUF files of bloom, gpt2, llama, mistral, qwen2"):
        import_checkpoint(str(tmp_path / "falcon.gguf"), tmp_path / "run", [])
    assert nothing_left(tmp_path / "run")


def test_gguf_error_is_one_line_without_progress_bars(tmp_path):
    """transformers' dequantising progress bar used to precede the error on stderr."""
    proc = run_cli("import", str(write_gguf(tmp_path / "q8_1.gguf", "Q8_1")), str(tmp_path / "run"), check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "Dequantization for Q8_1" in proc.stderr and "it/s" not in proc.stdout + proc.stderr
    assert nothing_left(tmp_path / "run")


@pytest.mark.parametrize("override", ["data.tokenizer=bytes", "data.vocab_size=512", "data.tokenizer_file=x.json",
                                      "data.eos_token=a"])
def test_tokenizer_settings_import_sets_are_refused(llama_dir, tmp_path, override):
    with pytest.raises(RelposError, match=f"relpos import sets data.tokenizer, .* from the model's own tokenizer; "
                                          f"'{override}' would change nothing: leave it out"):
        import_checkpoint(str(llama_dir), tmp_path / "run", [override])
    assert nothing_left(tmp_path / "run")


def test_data_files_are_stored_absolute(llama_dir, corpus, tmp_path):
    """A relative data.files named at import still finds the corpus from another directory."""
    (tmp_path / "here").mkdir()
    (tmp_path / "here" / "corpus.txt").write_bytes(corpus.read_bytes())
    run_cli("import", str(llama_dir), str(tmp_path / "run"), "data=text_files", "data.files=[corpus.txt]",
            cwd=tmp_path / "here")
    files = OmegaConf.load(tmp_path / "run" / "config.yaml").data.files
    assert list(files) == [str(tmp_path / "here" / "corpus.txt")]


def test_swish_llama_imports(corpus, tmp_path):
    """transformers takes hidden_act="swish" as SiLU: such a Llama imports and gives transformers' logits."""
    hf_dir = save_tiny_llama(tmp_path / "swish", hidden_act="swish")
    model, tokenizer, _ = load_run(import_checkpoint(str(hf_dir), tmp_path / "run", data_args(corpus)))
    tokens = torch.tensor([tokenizer.encode("def main():\n    return 1\n")])
    reference = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), reference(tokens).logits, rtol=1e-4, atol=1e-4)


def test_a_write_error_names_out_dir_not_the_temp_dir(llama_dir, corpus, tmp_path, monkeypatch):
    import errno

    import relpos_cli.importing as importing

    def disk_full(run_dir, *args):
        raise OSError(errno.ENOSPC, "No space left on device", str(run_dir / "data.json"))

    monkeypatch.setattr(importing, "record_data", disk_full)
    out = tmp_path / "made" / "run"
    with pytest.raises(RelposError, match=f"^{out}/data.json: no space left on the device") as e:
        import_checkpoint(str(llama_dir), out, data_args(corpus))
    assert ".importing-" not in str(e.value) and nothing_left(out) and not out.parent.exists()


def test_out_dir_with_files_is_left_untouched(llama_dir, tmp_path):
    out = tmp_path / "someones"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    proc = run_cli("import", str(llama_dir), str(out), check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "already holds files" in proc.stderr
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"
    assert not list(tmp_path.glob(".someones.importing-*"))


def test_ctrl_c_during_import_leaves_nothing(llama_dir, corpus, tmp_path, monkeypatch):
    import relpos_cli.importing as importing

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(importing, "record_data", interrupted)  # while the run dir is half written
    with pytest.raises(Interrupted, match="SIGINT: import interrupted; nothing was written") as e:
        import_checkpoint(str(llama_dir), tmp_path / "made" / "run", data_args(corpus))
    assert e.value.exit_code == 128 + signal.SIGINT
    assert nothing_left(tmp_path / "made" / "run") and not (tmp_path / "made").exists()


# `relpos ARGS` whose import stalls while its temp dir is half written (weights and tokenizer there,
# data.json not yet): a marker file is touched there, so a test can signal the process at that point
STALLED_IMPORT = """
import pathlib, sys, time
import relpos_cli.importing as importing
marker = pathlib.Path(sys.argv.pop(1))
def stalled(*args, **kwargs):
    marker.touch()
    time.sleep(300)
importing.record_data = stalled
from relpos_cli.cli import main
sys.argv[0] = "relpos"
main()
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_kill_or_hangup_during_import_leaves_nothing(llama_dir, corpus, tmp_path, sig):
    """`kill` and a closed terminal used to end the import at once (exit -15, no message), leaving
    .OUT.importing-* and the parent dirs it made; now they stop it as Ctrl-C does."""
    import subprocess
    import sys
    import time

    from conftest import REPO

    marker, out = tmp_path / "stalled", tmp_path / "made" / "run"
    proc = subprocess.Popen([sys.executable, "-c", STALLED_IMPORT, str(marker), "import", str(llama_dir), str(out),
                             *data_args(corpus)], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert marker.exists(), proc.communicate()
    assert list(out.parent.glob(".run.importing-*"))  # half written at this point
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, err
    assert err.strip().splitlines() == [f"error: {sig.name}: import interrupted; nothing was written to {out}"]
    assert nothing_left(out) and not out.parent.exists()


@pytest.mark.slow
def test_every_command_on_an_imported_run(corpus, tmp_path):
    """eval-length (both protocols, eval-time rope scaling, context use), eval-task (passkey with
    the instruction line), inspect, sample, compare with a trained run, and fine-tuning with
    init_from: at a longer length with YaRN, and with RoPE dropped (DroPE); other scheme changes
    are refused in one line."""
    llama_dir = save_tiny_llama(tmp_path / "llama-256", max_position_embeddings=256)  # passkey's instruction fits
    run = tmp_path / "imported"
    run_cli("import", str(llama_dir), str(run), *data_args(corpus))
    run_cli("eval-length", str(run), "eval.lengths=[64,512]", "eval.tokens=1024")
    run_cli("eval-length", str(run), "eval.lengths=[512]", "eval.tokens=1024", "eval.protocol=sliding",
            "eval.stride=128", "eval.context_use=true", "eval.rope_scaling.type=yarn")
    rows = json.loads(next(run.glob("eval_length.*yarn*.json")).read_text())
    assert all("context_gain" in row for row in rows)
    run_cli("eval-task", str(run), "task=passkey", "task.instruction=true", "task.samples=2", "task.eval_lengths=[512]",
            "task.depths=[0.5]")
    run_cli("inspect", str(run))
    out = run_cli("sample", str(run), "-p", "def ", "-n", "5").stdout
    assert out.startswith("def ")
    child = tmp_path / "yarn-child"
    run_cli("train", f"init_from={run}", *data_args(corpus), "train.seq_len=512", "pos.scaling.type=yarn",
            "train.steps=2", "train.batch_size=2", "train.val_batches=1", f"hydra.run.dir={child}")

    cfg = OmegaConf.load(child / "config.yaml")
    assert cfg.pos.scaling.type == "yarn" and cfg.pos.scaling.original_length == 256 and cfg.model.n_kv_heads == 2
    assert cfg.data.tokenizer == "hf"
    run_cli("train", f"init_from={run}", *data_args(corpus), "pos=none", "train.steps=2", "train.batch_size=2",
            "train.val_batches=1", f"hydra.run.dir={tmp_path / 'drope'}")
    proc = run_cli("train", f"init_from={run}", *data_args(corpus), "pos=t5", "train.steps=2",
                   f"hydra.run.dir={tmp_path / 't5'}", check=False)
    assert proc.returncode != 0 and "or drops one that holds no weights for pos=none" in proc.stderr
    run_cli("eval-length", str(child), "eval.lengths=[64,512]", "eval.tokens=1024")
    table = run_cli("compare", str(run), str(child), "--out", str(tmp_path / "cmp")).stdout
    assert "512" in table
    # the imported run goes by its model's name; the child, by what tells it apart
    rows = (tmp_path / "cmp" / "compare.csv").read_text().splitlines()
    assert any(r.startswith("llama-256,") for r in rows) and any(r.startswith("seq_len=512,") for r in rows)
    assert os.path.isfile(tmp_path / "cmp" / "compare.csv")


def test_trained_only_commands_do_not_import_transformers():
    """transformers, gguf and the families load with `relpos import` alone: start-up stays light, and
    relpos runs without the [pretrained] extra."""
    import subprocess
    import sys

    code = ("import sys, relpos_cli, relpos_cli.cli, relpos_cli.evaluate, relpos_cli.eval_task, relpos_cli.train, "
            "relpos_cli.sample, relpos_cli.checkpoint; "
            "print([m for m in ('transformers', 'gguf', 'huggingface_hub', 'relpos_cli.families') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}).stdout
    assert out.strip() == "[]"
