"""Data sources through Hugging Face `datasets`, and the token cache."""

import numpy as np
import pytest
import torch

from relpos_cli.data import _held_out, load_token_data, stdlib_files
from relpos_cli.errors import RelposError
from relpos_cli.train import WindowSampler


def cfg(tmp_path, **kw):
    return {"tokenizer": "bytes", "val_fraction": 0.1, "cache_dir": str(tmp_path / "cache"), **kw}


def test_stdlib_excludes_tests_and_splits_by_path():
    root, files = stdlib_files()
    rel = [f.relative_to(root).as_posix() for f in files]
    assert rel and not any("/test/" in f"/{r}" or "/tests/" in f"/{r}" or r.split("/")[-1].startswith("test_") for r in rel)
    assert not any(r.startswith("site-packages") for r in rel)
    held = [r for r in rel if _held_out(r, 0.05)]
    assert 0.01 < len(held) / len(rel) < 0.12
    assert held == [r for r in rel if _held_out(r, 0.05)]  # deterministic


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
        starts = torch.randint(0, len(whole) - 17, (4,), generator=generator)
        expected = whole[starts[:, None] + torch.arange(17)]  # (B, T+1)
        assert x.dtype == torch.int64 and torch.equal(x, expected[:, :-1]) and torch.equal(y, expected[:, 1:])
