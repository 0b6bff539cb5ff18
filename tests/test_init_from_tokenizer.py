"""init_from reads token ids as its parent did: a child whose BPE was learnt from other text, with the
same vocabulary size (which `parent_weights` checks), is refused before anything is trained; the
parent's own data, or a byte-level parent on any corpus, is accepted."""

import json

import pytest

from conftest import run_in_process
from relpos_cli.data import stdlib_files

pytestmark = pytest.mark.usefixtures("in_temp_cwd")
RUN = ["model=tiny", "train.steps=1", "train.batch_size=2", "train.seq_len=16", "train.log_every=1",
       "train.val_batches=1", "wandb.mode=disabled", "device=cpu"]


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """Two text files of different Python sources, each rich enough for 300 BPE tokens."""
    root = tmp_path_factory.mktemp("corpora")
    _, sources = stdlib_files()
    paths = []
    for name, source in zip(("a.txt", "b.txt"), (sources[-1], sources[-40])):
        (root / name).write_text(source.read_text(encoding="utf-8")[:20000])
        paths.append(root / name)
    return paths


def data(path, tokenizer="bpe"):
    return ["data=text_files", f"data.files=[{path}]", f"data.tokenizer={tokenizer}",
            *(["data.vocab_size=300"] if tokenizer == "bpe" else [])]


def test_a_bpe_learnt_from_other_text_is_refused(corpora, tmp_path):
    a, b = corpora
    code, _, err = run_in_process("train", *RUN, *data(a), f"hydra.run.dir={tmp_path / 'parent'}")
    assert code == 0, err
    code, _, err = run_in_process("train", *RUN, *data(b), f"init_from={tmp_path / 'parent'}",
                                  f"hydra.run.dir={tmp_path / 'child'}")
    assert code != 0
    assert "is not its parent's" in err and "tokenizer.json sha256" in err and "Traceback" not in err
    assert not (tmp_path / "child" / "checkpoint.pt").exists() and not (tmp_path / "child" / "config.yaml").exists()
    # the same vocabulary size, so parent_weights alone let the child train (it did, before this check)
    assert json.loads((tmp_path / "parent" / "data.json").read_text())["tokenizer"]["vocab_size"] == 300

    # the parent's own data: its tokenizer, accepted
    code, _, err = run_in_process("train", *RUN, *data(a), f"init_from={tmp_path / 'parent'}",
                                  f"hydra.run.dir={tmp_path / 'same'}")
    assert code == 0, err


def test_bytes_read_any_corpus_alike(corpora, tmp_path):
    a, b = corpora
    assert run_in_process("train", *RUN, *data(a, "bytes"), f"hydra.run.dir={tmp_path / 'parent'}")[0] == 0
    code, _, err = run_in_process("train", *RUN, *data(b, "bytes"), f"init_from={tmp_path / 'parent'}",
                                  f"hydra.run.dir={tmp_path / 'child'}")
    assert code == 0, err
