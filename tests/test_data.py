"""Data sources through Hugging Face `datasets`, the token cache (in memory or streamed), the
tokenizers, and training windows read from the cache's memmap."""

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from relpos_cli import data as data_module
from relpos_cli.checkpoint import load_config
from relpos_cli.config import conf_dir, validate_run_config
from relpos_cli.data import cache_key, held_out, load_token_data, stdlib_files
from relpos_cli.errors import RelposError
from relpos_cli.settings import ADDED_KEYS
from relpos_cli.tokenizers import BpeTokenizer, ByteTokenizer, HfTokenizer
from relpos_cli.train import WindowSampler


def cfg(tmp_path, **kw):
    return {"tokenizer": "bytes", "val_fraction": 0.1, "cache_dir": str(tmp_path / "cache"), **kw}


def test_stdlib_excludes_tests_and_splits_by_path():
    root, files = stdlib_files()
    rel = [f.relative_to(root).as_posix() for f in files]
    assert rel and not any("/test/" in f"/{r}" or "/tests/" in f"/{r}" or r.split("/")[-1].startswith("test_") for r in rel)
    assert not any(r.startswith("site-packages") for r in rel)
    held = [r for r in rel if held_out(r, 0.05)]
    assert 0.01 < len(held) / len(rel) < 0.12
    assert held == [r for r in rel if held_out(r, 0.05)]  # deterministic


def test_text_files_through_datasets_and_cache(tmp_path):
    a, b, v = tmp_path / "a.txt", tmp_path / "b.txt", tmp_path / "v.txt"
    a.write_text("hello world\n" * 50)
    b.write_text("second file\n" * 50)
    v.write_text("validation text\n" * 10)
    c = cfg(tmp_path, source="text_files", files=[str(a), str(b)], validation_files=[str(v)])
    data = load_token_data(c)
    assert data.vocab_size == 256
    assert bytes(np.asarray(data.validation)).startswith(b"validation text\n")
    assert len(data.train) == 600 + 600 + 2  # two documents, each ended by the end token
    again = load_token_data(c)  # from the cache: memory-mapped
    assert isinstance(again.train, np.memmap) and np.array_equal(again.train, data.train)


def test_text_files_without_validation_hold_out_the_tail(tmp_path):
    a = tmp_path / "a.txt"
    a.write_text("x" * 1000)
    data = load_token_data(cfg(tmp_path, source="text_files", files=[str(a)]))
    assert len(data.validation) == 101 and len(data.train) == 900


@pytest.mark.parametrize(
    "files,message",
    [(["missing.txt"], "no such file: missing.txt"), ([], "needs data.files"), (["EMPTY"], "file is empty")],
)
def test_text_files_errors(tmp_path, files, message):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    files = [str(empty) if f == "EMPTY" else f for f in files]
    with pytest.raises(RelposError, match=message):
        load_token_data(cfg(tmp_path, source="text_files", files=files))


def test_hub_unreachable_is_one_clear_line(tmp_path):
    c = cfg(tmp_path, source="hub", path="Salesforce/wikitext", name="wikitext-103-raw-v1", text_field="text",
            train_split="train", validation_split="validation")
    with pytest.raises(RelposError, match="cannot load dataset 'Salesforce/wikitext'.*offline choices: data=stdlib") as e:
        load_token_data(c)
    assert "\n" not in str(e.value)


def test_unknown_source(tmp_path):
    with pytest.raises(RelposError, match="unknown data source 'nope'"):
        load_token_data(cfg(tmp_path, source="nope"))


def write_corpus(tmp_path, n: int = 12) -> list[str]:
    """n small files (~3 kB of real Python each, plus a non-ASCII line): one document per file."""
    _, files = stdlib_files()
    paths = []
    for i, f in enumerate(files[:n]):
        path = tmp_path / f"doc{i}.txt"
        path.write_text(f.read_text(encoding="utf-8", errors="replace")[:3000] + "\n# naïve café 😀\n", encoding="utf-8")
        paths.append(str(path))
    return paths


def text_bytes(files: list[str]) -> int:
    """UTF-8 bytes of the documents plus one separator byte each."""
    return sum(len(Path(f).read_bytes()) + 1 for f in files)


@pytest.mark.parametrize("tokenizer, vocab_size, separate_validation", [("bytes", None, False), ("bpe", 300, True)])
def test_streaming_gives_the_same_tokens_as_in_memory(tmp_path, tokenizer, vocab_size, separate_validation):
    files = write_corpus(tmp_path)
    c = cfg(tmp_path, source="text_files", files=files[:-1] if separate_validation else files,
            validation_files=files[-1:] if separate_validation else None, tokenizer=tokenizer, vocab_size=vocab_size)
    in_memory, streamed = load_token_data(c), load_token_data({**c, "streaming": True})
    assert streamed.cache_dir != in_memory.cache_dir
    assert sorted(p.name for p in streamed.cache_dir.glob("*.bin")) == ["train.bin", "validation.bin"]
    assert isinstance(streamed.train, np.memmap) and isinstance(streamed.validation, np.memmap)
    assert np.array_equal(streamed.train, in_memory.train) and np.array_equal(streamed.validation, in_memory.validation)
    meta = json.loads((streamed.cache_dir / "meta.json").read_text())
    assert meta["tokens"] == {"train": len(in_memory.train), "validation": len(in_memory.validation)}
    assert sum(meta["bytes"].values()) == text_bytes(files)
    if tokenizer == "bytes":
        assert meta["bytes"] == meta["tokens"]
    else:  # the held-out file is its own split: its bytes exactly
        assert meta["bytes"]["validation"] == text_bytes(files[-1:]) and len(streamed.validation) < meta["bytes"]["validation"]


def test_streaming_tokenizes_in_bounded_chunks(tmp_path, monkeypatch):
    files = write_corpus(tmp_path)
    monkeypatch.setattr(data_module, "STREAM_CHUNK_CHARS", 5000)
    calls = []
    encode = ByteTokenizer.encode_documents
    monkeypatch.setattr(ByteTokenizer, "encode_documents",
                        lambda self, texts: calls.append([len(t) for t in texts]) or encode(self, texts))
    load_token_data(cfg(tmp_path, source="text_files", files=files, streaming=True))
    assert len(calls) >= 4
    assert all(sum(c) - c[-1] < 5000 for c in calls)  # a chunk is closed by the document that reaches the bound
    assert sum(map(sum, calls)) == sum(len(Path(f).read_text(encoding="utf-8")) for f in files)


def test_bpe_round_trips_honours_the_vocab_and_knows_its_bytes(tmp_path):
    docs = [Path(f).read_text(encoding="utf-8") for f in write_corpus(tmp_path)]
    tok = BpeTokenizer.train(iter(docs), 300)
    assert tok.vocab_size == 300 and tok.eos_id == 0
    for text in docs + ["naïve café 😀 \t\n  ", "a\x00b"]:
        assert tok.decode(tok.encode_documents([text])[:-1]) == text
    ids = tok.encode_documents(docs)
    n_bytes = sum(len(d.encode("utf-8")) + 1 for d in docs)
    assert int((ids == tok.eos_id).sum()) == len(docs)
    assert int(tok.token_bytes[ids].sum()) == n_bytes
    assert len(ids) < 0.8 * n_bytes  # the merges compress


def test_a_pretrained_tokenizers_token_bytes_count_the_utf8_bytes_of_its_added_tokens(tmp_path):
    """A pretrained model's byte-level vocabulary with added tokens (GPT-NeoX's runs of spaces, chat
    markers): an added token that is not special is matched in the raw text, so it stands for its
    text's UTF-8 bytes, not one byte per character; a special one (the end token) for one byte."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    docs = [Path(f).read_text(encoding="utf-8") for f in write_corpus(tmp_path)]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=300, special_tokens=["</s>"], show_progress=False,
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.add_tokens([AddedToken("é€", normalized=False), AddedToken("    ", normalized=False)])
    hf = HfTokenizer(tokenizer, "</s>")
    texts = [*docs, "naïve é€ café\n    x", "é€é€ 😀"]
    ids = hf.encode_documents(texts)
    assert {tokenizer.token_to_id("é€"), tokenizer.token_to_id("    ")} <= set(ids.tolist())  # the added tokens are used
    assert int(hf.token_bytes[ids].sum()) == sum(len(t.encode("utf-8")) + 1 for t in texts)


def test_bpe_is_learnt_on_the_train_split_once_per_cache(tmp_path, monkeypatch):
    files = write_corpus(tmp_path)
    c = cfg(tmp_path, source="text_files", files=files[:-1], validation_files=files[-1:], tokenizer="bpe", vocab_size=300)
    seen = []
    learn = BpeTokenizer.train.__func__

    def recording(cls, texts, vocab_size):
        seen.extend(texts)
        return learn(cls, seen, vocab_size)

    monkeypatch.setattr(BpeTokenizer, "train", classmethod(recording))
    first = load_token_data(c)
    assert seen == [Path(f).read_text(encoding="utf-8") for f in files[:-1]]
    assert first.vocab_size == 300 and (first.cache_dir / "tokenizer.json").is_file()

    def no_training(*args):
        raise AssertionError("the cached tokenizer.json should have been used")

    monkeypatch.setattr(BpeTokenizer, "train", no_training)
    (first.cache_dir / "meta.json").unlink()  # the tokens are rebuilt, the tokenizer is not learnt again
    again = load_token_data(c)
    assert np.array_equal(again.train, first.train) and np.array_equal(again.token_bytes, first.token_bytes)


def test_cache_key_kept_for_old_caches_and_new_for_streaming_and_vocab(tmp_path):
    old = cfg(tmp_path, source="text_files", files=write_corpus(tmp_path, 1))  # a config from before the new keys
    key = cache_key(old)
    assert cache_key({**old, "vocab_size": None, "streaming": False}) == key
    others = [{"streaming": True}, {"tokenizer": "bpe", "vocab_size": 300}, {"tokenizer": "bpe", "vocab_size": 400}]
    assert len({key, *(cache_key({**old, **o}) for o in others)}) == 4


def test_a_run_config_saved_before_the_new_data_keys_still_checks(tmp_path):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        composed = OmegaConf.to_container(compose("config"), resolve=True)
    for key in ADDED_KEYS:
        del composed["data"][key]
    # and the keys added with the settings schema, data fingerprints and the W&B time limit
    for section, key in (("wandb", "init_timeout"), ("eval", "allow_changed_data"), ("inspect", "allow_changed_data")):
        del composed[section][key]
    OmegaConf.save(OmegaConf.create(composed), tmp_path / "config.yaml")
    loaded = load_config(tmp_path)
    validate_run_config(loaded)  # what resume runs: a missing key would be "config key ... is missing"
    assert loaded.data.vocab_size is None and loaded.data.streaming is False
    assert loaded.wandb.init_timeout == 60 and loaded.eval.allow_changed_data is False


@pytest.mark.parametrize("overrides, message", [
    ({"tokenizer": "nope"}, "unknown data.tokenizer 'nope'; choose one of: bytes, bpe"),
    ({"tokenizer": "bpe"}, "data.tokenizer=bpe needs data.vocab_size=<N>, N >= 258"),
    ({"tokenizer": "bpe", "vocab_size": 257}, "data.vocab_size=257 is too small for bpe"),
    ({"tokenizer": "bpe", "vocab_size": "big"}, "data.vocab_size must be an integer, got 'big'"),
    ({"vocab_size": 300}, "data.vocab_size=300 applies to data.tokenizer=bpe"),
    ({"streaming": True}, "data.streaming=true reads data=hub or data=text_files; data=stdlib is small"),
])
def test_bad_data_choices_are_one_line_before_any_reading(tmp_path, overrides, message):
    with pytest.raises(RelposError, match=re.escape(message)) as e:
        load_token_data(cfg(tmp_path, source="stdlib", **overrides))
    assert "\n" not in str(e.value) and not (tmp_path / "cache").exists()


def test_sampler_reads_only_windows_from_a_memmap_as_it_did_from_a_tensor(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 256, 5000).astype(np.uint8)
    tokens.tofile(tmp_path / "train.bin")
    mapped = np.memmap(tmp_path / "train.bin", dtype=np.uint8, mode="r")
    sampler = WindowSampler(mapped, seq_len=16, batch_size=4, seed=3, device=torch.device("cpu"))
    assert sampler.tokens is mapped  # no copy of the split
    # the sampler before memmaps: the whole split as one int64 tensor, indexed with the same starts
    whole, generator = torch.from_numpy(tokens.astype(np.int64)), torch.Generator().manual_seed(3)
    for _ in range(3):
        x, y = sampler()
        starts = torch.randint(0, len(whole) - 16, (4,), generator=generator)
        expected = whole[starts[:, None] + torch.arange(17)]  # (B, T+1)
        assert x.dtype == torch.int64 and torch.equal(x, expected[:, :-1]) and torch.equal(y, expected[:, 1:])


@pytest.mark.parametrize("source, keys, refused", [
    ("stdlib", {}, True),  # always holds files out by their path's hash
    ("hub", {"validation_split": None}, True),  # holds the train tokens' tail out
    ("hub", {"validation_split": "validation"}, False),  # a split of its own: the fraction is not read
    ("text_files", {"validation_files": None}, True),
    ("text_files", {"validation_files": ["v.txt"]}, False),
])
def test_a_null_val_fraction_is_refused_where_the_source_reads_it(source, keys, refused):
    """data.val_fraction=null used to reach the split (a TypeError from the stdlib source's hash)."""
    from relpos_cli.settings import DataSettings

    settings = dict(source=source, tokenizer="bytes", vocab_size=None, streaming=False, cache_dir="unused",
                    val_fraction=None, **keys)
    if refused:
        with pytest.raises(RelposError, match=f"data.val_fraction=null, but data={source}"):
            DataSettings(**settings)
    else:
        DataSettings(**settings)
