"""Every bad input named in the docs ends as one `error: ...` line and a non-zero exit, never a
traceback; random override strings either run or fail that way. In-process for speed."""

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import TINY
from conftest import run_in_process as relpos
from relpos_cli.errors import RelposError
from relpos_cli.positions import scheme_names


def assert_one_clear_line(code: int, stderr: str, *fragments: str) -> None:
    lines = [l for l in stderr.splitlines() if l.strip()]
    assert code != 0
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    joined = lines[0]
    for fragment in fragments:
        assert fragment in joined, (fragment, stderr)


pytestmark = pytest.mark.usefixtures("in_temp_cwd")  # in-process runs point outputs/latest: not in the checkout


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    code, out, err = relpos("train", *TINY, "pos=learned", "pos.max_positions=64", f"hydra.run.dir={run_dir}")
    assert code == 0, err
    return run_dir


@pytest.mark.parametrize("overrides, fragments", [
    (["pos=nope"], ["unknown pos 'nope'", "choose one of: " + ", ".join(scheme_names())]),
    (["pos.name=nope"], ["unknown position scheme 'nope'", ", ".join(scheme_names())]),
    (["foo=1"], ["unknown config key 'foo'", "+foo"]),
    (["train.nope=1"], ["unknown config key 'train.nope'"]),
    (["train.steps=abc"], ["train.steps must be an integer, got 'abc'"]),
    (["train.lr=fast"], ["train.lr must be a number"]),
    (["train.steps=[1"], ["bad override"]),
    (["--bogus"], ["bad override: cannot parse --bogus (overrides look like key=value"]),  # was LexerNoViableAltException
    (["+="], ["bad override '+='", "no key before '='"]),  # was Hydra's AssertionError, with a traceback
    (["~="], ["bad override '~='", "no key before '='"]),
    (["+seed=1"], ["already at 'seed'"]),
    # torch keeps a seed's low 32 bits: 2^32 would be seed 0's run again, counted as another seed by compare
    (["seed=4294967296"], ["seed=4294967296: give an integer in [0, 2^32 - 1]"]),
    (["seed=-1"], ["seed=-1: give an integer in [0, 2^32 - 1]"]),
    (["seed=18446744073709551616"], ["seed=18446744073709551616: give an integer in [0, 2^32 - 1]"]),
    (["train.steps=0"], ["train.steps must be positive"]),
    (["train.seq_len=-4"], ["train.seq_len must be positive"]),
    (["model.d_model=33"], ["model.d_model=33 is not divisible by model.n_heads=2"]),
    (["model.d_model=6", "pos=rope"], ["head_dim=3", "even number"]),
    (["train.precision=bf16", "device=cpu"], ["train.precision=bf16 needs a CUDA device"]),
    (["train.precision=fp16"], ["train.precision='fp16'; choose one of: auto, fp32, bf16"]),
    (["train.on_nan=maybe"], ["train.on_nan='maybe'; choose one of: stop, skip"]),
    (["data=nope"], ["unknown data 'nope'", "stdlib"]),
    (["data.source=nope"], ["unknown data source 'nope'"]),
    (["data=hub", "data.path=nobody/no-such-dataset"], ["cannot load dataset", "unreachable"]),
    (["data=text_files", "data.files=[/no/such/file.txt]"], ["no such file: /no/such/file.txt"]),
    (["data.tokenizer=nope"], ["unknown data.tokenizer 'nope'; choose one of: bytes, bpe"]),
    (["data.tokenizer=bpe"], ["data.tokenizer=bpe needs data.vocab_size"]),
    (["data.tokenizer=bpe", "data.vocab_size=100"], ["data.vocab_size=100 is too small for bpe"]),
    (["data.streaming=true"], ["data.streaming=true reads data=hub or data=text_files; data=stdlib"]),
    (["data.streaming=maybe"], ["data.streaming must be a boolean"]),
    (["model.sliding_window=0"], ["model.sliding_window must be positive"]),
    (["model.sliding_layers=[1]"], ["model.sliding_layers names the layers of model.sliding_window, which is null"]),
    (["model.sliding_window=8", "model.sliding_layers=[2]"], ["model.sliding_layers must list distinct layers in [0, 1]"]),
    (["model.sliding_window=8", "model.sliding_layers=[1,1]"], ["distinct layers"]),
    (["model.sliding_window=8", "pos=cope"], ["model.sliding_window", "pos=cope has a bias that reads the keys between"]),
])
def test_bad_train_input_is_one_clear_line(tmp_path, overrides, fragments):
    code, _, err = relpos("train", *TINY, *overrides, f"hydra.run.dir={tmp_path / 'run'}")
    assert code == 2
    assert_one_clear_line(code, err, *fragments)


def test_empty_data_file_is_one_clear_line(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    code, _, err = relpos("train", *TINY, "data=text_files", f"data.files=[{empty}]", f"hydra.run.dir={tmp_path / 'run'}")
    assert_one_clear_line(code, err, "file is empty")


def test_cfg_job_with_a_bad_override_is_one_clear_line():
    code, _, err = relpos("train", "--cfg", "job", "model.nope=3")
    assert_one_clear_line(code, err, "unknown config key 'model.nope'")


@pytest.mark.parametrize("overrides, fragments", [
    (["eval.lengths=[0,32]"], ["eval.lengths must be positive"]),
    (["eval.lengths=[32,128]", "eval.tokens=256"], ["length 128 is past it"]),
    (["eval.lengths=[32]", "eval.tokens=100000000"], ["validation tokens; the split has"]),
    (["eval.tokens=lots"], ["eval.tokens must be an integer"]),
    (["eval.nope=1"], ["unknown config key 'eval.nope'"]),
])
def test_bad_eval_input_is_one_clear_line(trained, overrides, fragments):
    code, _, err = relpos("eval-length", str(trained), *overrides)
    assert_one_clear_line(code, err, *fragments)


def test_bad_run_dirs_are_one_clear_line(tmp_path, trained):
    code, _, err = relpos("eval-length", str(tmp_path / "missing"))
    assert_one_clear_line(code, err, "run dir not found")
    (tmp_path / "empty").mkdir()
    code, _, err = relpos("eval-length", str(tmp_path / "empty"))
    assert_one_clear_line(code, err, "no config.yaml")
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "config.yaml").write_text((trained / "config.yaml").read_text())
    (corrupt / "checkpoint.pt").write_bytes(b"\x00" * 100)
    code, _, err = relpos("eval-length", str(corrupt))
    assert_one_clear_line(code, err, "corrupt checkpoint")


def test_out_of_memory_at_an_eval_length_suggests_the_batch_budget(trained, monkeypatch):
    from relpos_cli import evaluate

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")

    monkeypatch.setattr(evaluate, "score_windows", out_of_memory)
    with pytest.raises(RelposError, match="out of memory at eval length 32 .*lower eval.max_tokens_per_batch"):
        evaluate.evaluate_run(trained, ["eval.lengths=[32]", "eval.tokens=256"])


KEYS = ["train.steps", "train.seq_len", "train.batch_size", "train.lr", "train.betas", "train.on_nan",
        "train.ckpt_every", "train.val_batches", "train.warmup_steps", "train.grad_clip", "train.min_lr_ratio",
        "train.weight_decay", "model.d_model", "model.n_heads", "model.n_layers", "model.dropout", "pos", "pos.name",
        "data", "data.vocab_size", "data.streaming", "data.val_fraction", "seed", "device", "eval.lengths",
        "eval.tokens", "eval.stride", "eval.protocol", "eval.allow_changed_data", "wandb.init_timeout", "nope",
        "+extra", "~train.lr", "~pos", "train"]  # task keys: the task branch adds its own
VALUES = st.one_of(
    st.integers(-3, 8).map(str),
    st.sampled_from(["0.5", "1e-3", "-0.5", "abc", "", "null", "true", "[1,2]", "[0.9,0.5]", "[a]", "[a", "rope",
                     "t5", "skip", "cpu", "{a:1}"]),
)
WELL_FORMED = st.builds(lambda k, v: f"{k}={v}" if not k.startswith("~") else k, st.sampled_from(KEYS), VALUES)
GARBAGE = st.text(alphabet="=.,[]{}+~:ab1 _'\"", min_size=1, max_size=10)
OVERRIDES = st.tuples(st.lists(WELL_FORMED, max_size=3), st.lists(GARBAGE, max_size=1)).map(lambda t: t[0] + t[1][:1])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(overrides=OVERRIDES)
def test_random_overrides_run_or_fail_in_the_clear_form(tmp_path, overrides):
    run_dir = tmp_path / f"run{abs(hash(tuple(overrides)))}"
    code, _, err = relpos("train", *TINY, "train.steps=2", *overrides, f"hydra.run.dir={run_dir}")
    if code != 0:
        assert code == 2, err
        assert_one_clear_line(code, err)


def test_a_failing_sweep_job_does_not_stop_the_others(tmp_path):
    sweep = tmp_path / "sweep"
    code, _, err = relpos("train", "-m", *TINY, "pos=learned", "pos.max_positions=16,64", f"hydra.sweep.dir={sweep}")
    assert code == 1 and "Traceback" not in err
    assert "1 sweep job(s) failed" in " ".join(err.split())
    failed = json.loads(next(sweep.glob("0_*/failed.json")).read_text())
    assert "pos.max_positions=16 is shorter than train.seq_len=32" in failed["error"]
    assert "pos.max_positions=16" in failed["overrides"]
    assert next(sweep.glob("1_*/checkpoint.pt")).is_file() and not list(sweep.glob("1_*/failed.json"))


def test_a_sliding_window_run_evaluates_and_refuses_extension_methods(tmp_path):
    run_dir = tmp_path / "windowed"
    code, _, err = relpos("train", *TINY, "pos=rope", "model.sliding_window=8", f"hydra.run.dir={run_dir}")
    assert code == 0, err
    code, _, err = relpos("eval-length", str(run_dir), "eval.lengths=[32,64]", "eval.tokens=128")
    assert code == 0, err
    before = sorted(p.name for p in run_dir.iterdir())
    code, _, err = relpos("eval-length", str(run_dir), "eval.lengths=[64]", "eval.tokens=128", "eval.rerope.window=4")
    assert_one_clear_line(code, err, "eval.rerope extends full causal attention", "sliding window of 8 tokens")
    assert sorted(p.name for p in run_dir.iterdir()) == before


def test_a_sweep_never_counts_another_sweeps_run_as_its_failure(tmp_path):
    """Two sweeps into one dir: the first to finish finds the other's run without results yet, held by
    a live process or left unfinished. Neither is this sweep's job: it is compared (listed as not
    evaluated), never reported as a failed job (before: `1 sweep job(s) failed`, exit 1)."""
    from filelock import FileLock

    sweep = tmp_path / "sweep"
    args = [*TINY, "eval.lengths=[32]", "eval.tokens=128", f"hydra.sweep.dir={sweep}"]
    code, _, err = relpos("sweep", *args, "pos=alibi")
    assert code == 0, err
    other = sweep / "other_sweeps_job"
    other.mkdir()
    (other / "config.yaml").write_text("pos:\n  name: rope\n")  # a run that has started but not evaluated
    with FileLock(other / ".relpos.lock"):
        code, _, err = relpos("sweep", *args, "pos=rope")
    assert code == 0 and "other_sweeps_job" not in err, err
    code, _, err = relpos("sweep", *args, "pos=t5")
    assert code == 0 and "other_sweeps_job" not in err, err  # no process holds it now: still not this sweep's
