"""Data and sample faults found by use: an edit that keeps a text file's size and mtime (the token
cache and data.json used to trust them), a held-out validation tail too short, a BPE smaller than
asked, a SentencePiece tokenizer's continuation glued to the prompt, a prompt that is not UTF-8."""

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest

from conftest import run_in_process
from relpos_cli.data import load_token_data
from relpos_cli.errors import RelposError
from relpos_cli.fingerprint import check_data_unchanged, record_data


def cfg(tmp_path, files, **kw):
    return {"source": "text_files", "files": [str(f) for f in files], "validation_files": None, "val_fraction": 0.1,
            "tokenizer": "bytes", "vocab_size": None, "tokenizer_file": None, "eos_token": None, "streaming": False,
            "cache_dir": str(tmp_path / "cache"), **kw}


def edit_keeping_size_and_mtime(path: Path, old: str, new: str) -> None:
    """What `sed` then `touch -r backup` does: other text, the same byte count, the old mtime."""
    assert len(old.encode()) == len(new.encode())
    stat = path.stat()
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (stat.st_size, stat.st_mtime_ns)


@pytest.mark.parametrize("streaming, tokenizer, vocab_size", [(False, "bytes", None), (True, "bytes", None),
                                                              (False, "bpe", 300)])
def test_an_edit_keeping_size_and_mtime_is_tokenized_again(tmp_path, capsys, streaming, tokenizer, vocab_size):
    """The cache used to be found by (path, size, mtime) alone: the edited file's old tokens came back,
    and a run trained on them recorded the new file's sha256 in data.json."""
    corpus = tmp_path / "a.txt"
    corpus.write_text("def main():\n    return 1\n" * 200)
    c = cfg(tmp_path, [corpus], streaming=streaming, tokenizer=tokenizer, vocab_size=vocab_size)
    before = load_token_data(c)
    old_train = np.array(before.train)
    edit_keeping_size_and_mtime(corpus, "def ", "fed ")
    capsys.readouterr()
    after = load_token_data(c)
    assert after.cache_dir == before.cache_dir  # the same key: size and mtime are as they were
    assert "was built from an earlier version of" in capsys.readouterr().err
    fresh = load_token_data({**c, "cache_dir": str(tmp_path / "fresh")})  # tokenized from scratch
    assert np.array_equal(after.train, fresh.train) and np.array_equal(after.validation, fresh.validation)
    assert not np.array_equal(np.array(after.train), old_train)
    assert after.tokenizer.decode(np.asarray(after.train[:8])).startswith("fed ")


def test_a_file_touched_but_not_changed_keeps_its_cache(tmp_path, capsys):
    """A new ctime with the same content (restored with cp -p, chmod) is hashed once, not rebuilt."""
    corpus = tmp_path / "a.txt"
    corpus.write_text("some text\n" * 300)
    c = cfg(tmp_path, [corpus])
    first = load_token_data(c)
    meta = first.cache_dir / "meta.json"
    tokens_mtime = (first.cache_dir / "train.npy").stat().st_mtime_ns
    os.chmod(corpus, 0o600)  # ctime moves, content and mtime do not
    capsys.readouterr()
    again = load_token_data(c)
    assert "rebuilding" not in capsys.readouterr().err
    assert (again.cache_dir / "train.npy").stat().st_mtime_ns == tokens_mtime
    assert json.loads(meta.read_text())["sources"][0]["ctime_ns"] == corpus.stat().st_ctime_ns  # not hashed again


def recorded_run(tmp_path, text: str) -> tuple[Path, Path, dict]:
    """(corpus file holding `text`, a run dir whose data.json records it, the data config)."""
    corpus = tmp_path / "a.txt"
    corpus.write_text(text)
    c = cfg(tmp_path, [corpus])
    run = tmp_path / "run"
    run.mkdir()
    record_data(run, c, load_token_data(c))
    return corpus, run, c


def test_data_json_catches_an_edit_keeping_size_and_mtime(tmp_path):
    """check_data_unchanged skipped any file whose size and mtime were those recorded."""
    corpus, run, c = recorded_run(tmp_path, "def main():\n    return 1\n" * 200)
    assert check_data_unchanged(run, c, allow=False, how="eval") == []
    os.chmod(corpus, 0o600)  # a new ctime alone: the content is hashed and found the same
    assert check_data_unchanged(run, c, allow=False, how="eval") == []
    edit_keeping_size_and_mtime(corpus, "def ", "fed ")
    with pytest.raises(RelposError, match=re.escape(f"{corpus} changed (other content, the same")):
        check_data_unchanged(run, c, allow=False, how="eval")


def test_a_data_json_without_ctime_is_checked_as_before(tmp_path):
    corpus, run, c = recorded_run(tmp_path, "text\n" * 100)
    record = json.loads((run / "data.json").read_text())
    del record["files"]["files"][0]["ctime_ns"]  # written by an earlier relpos
    (run / "data.json").write_text(json.dumps(record))
    os.chmod(corpus, 0o600)
    assert check_data_unchanged(run, c, allow=False, how="eval") == []


@pytest.mark.parametrize("streaming", [False, True])
def test_a_held_out_tail_without_text_names_the_fraction_and_writes_nothing(tmp_path, streaming):
    """A 3-byte file: its held-out tail is the end token alone. The error said the validation split
    'has no text', and the in-memory cache's token files were left without a meta.json."""
    small = tmp_path / "small.txt"
    small.write_text("abc")
    message = "the last data.val_fraction=0.1 of its 4 tokens, holds 1 token(s)"
    with pytest.raises(RelposError, match=re.escape(message)) as e:
        load_token_data(cfg(tmp_path, [small], streaming=streaming))
    assert "\n" not in str(e.value)
    leftover = [p.name for p in (tmp_path / "cache").rglob("*") if p.is_file()] if (tmp_path / "cache").exists() else []
    assert not [n for n in leftover if n.startswith("train.")], leftover


def test_a_bpe_smaller_than_asked_is_said(tmp_path, capsys):
    corpus = tmp_path / "a.txt"
    corpus.write_text("abab cdcd\n" * 50)
    data = load_token_data(cfg(tmp_path, [corpus], tokenizer="bpe", vocab_size=5000))
    assert data.vocab_size < 5000
    err = " ".join(capsys.readouterr().err.split())
    assert f"has {data.vocab_size:,} tokens, fewer than data.vocab_size=5,000" in err


def llama_style_tokenizer():
    """A SentencePiece-style vocabulary as Llama's and Mistral's tokenizer.json have it: "▁" for a
    space, and a decoder that strips the text's first space."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = ["<unk>", "</s>", "▁the", "▁capital", "▁is", "▁paris", "▁", "s"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return tok


def test_a_continuation_keeps_the_space_a_sentencepiece_decoder_strips():
    """decode(["▁paris"]) is "paris": decoded alone, the new tokens lost their first space and the
    sample read "the capital isparis"."""
    from relpos_cli.sample import continuation_text
    from relpos_cli.tokenizers import HfTokenizer

    hf = HfTokenizer(llama_style_tokenizer(), "</s>")
    prompt = hf.encode("the capital is")
    assert hf.decode(prompt) == "the capital is"
    paris = hf.encode("the capital is paris")[len(prompt):]
    assert hf.decode(paris) == "paris"  # the decoder's strip, alone
    assert "".join(continuation_text(hf, prompt, iter(paris))) == " paris"
    assert "".join(continuation_text(hf, prompt, iter(paris * 2))) == " paris paris"
    assert "".join(continuation_text(hf, [], iter(paris))) == "paris"  # a document's start: no space


def test_continuation_pieces_wait_for_a_whole_character():
    from relpos_cli.sample import continuation_text
    from relpos_cli.tokenizers import ByteTokenizer

    tok = ByteTokenizer()
    pieces = list(continuation_text(tok, tok.encode("caf"), iter("é!".encode())))
    assert pieces == ["é", "!"]


@pytest.mark.usefixtures("in_temp_cwd")
def test_a_prompt_that_is_not_utf8_is_one_line(tiny_run):
    prompt = b"ab\xff".decode("utf-8", errors="surrogateescape")  # what argv holds for these bytes
    code, out, err = run_in_process("sample", str(tiny_run), "--prompt", prompt, "-n", "3")
    assert code == 2 and err.startswith("error: --prompt is not UTF-8 text (byte 0xff at character 2)")
    assert err.count("\n") == 1 and out == ""
