"""Nothing lost, nothing silently wrong: one test per failure class, each as a user meets it.

One writer per run dir (real processes), settings validated in one schema, data fingerprinted,
no NaN result, checkpoints verified on load, environment faults as one line at the boundary,
bounded network waits, files that follow the umask, a Ctrl-C'd sweep naming what never ran."""

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from conftest import REPO, TINY, final_weights, run_cli
from test_errors import assert_one_clear_line, relpos

ENV = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}


def start(*args, cwd=REPO, env=None):
    return subprocess.Popen([sys.executable, "-m", "relpos_cli", *args], cwd=cwd, env={**ENV, **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(predicate, proc, what):
    deadline = time.monotonic() + 120
    while not predicate():
        assert proc.poll() is None, f"{what}: {proc.communicate()}"
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


pytestmark = pytest.mark.usefixtures("in_temp_cwd")  # every test here works in a fresh directory of its own


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """Two small UTF-8 text files, a corpus of the user's own."""
    root = tmp_path_factory.mktemp("corpus")
    text = (Path(REPO) / "relpos_cli" / "evaluate.py").read_text()
    (root / "a.txt").write_text(text * 3)
    (root / "v.txt").write_text(text)
    return root


@pytest.fixture(scope="module")
def text_run(corpus) -> Path:
    """A run trained on text files named by relative paths, from the corpus dir."""
    run_dir, cwd = corpus.parent / "text_run", os.getcwd()
    os.chdir(corpus)
    try:
        code, _, err = relpos("train", *TINY, "train.ckpt_every=2", "data=text_files", "data.files=[a.txt]",
                              "data.validation_files=[v.txt]", f"hydra.run.dir={run_dir}")
    finally:
        os.chdir(cwd)
    assert code == 0, err
    return run_dir


def test_one_writer_per_run_dir(tmp_path):
    """A second resume= or an eval-length while a run trains is refused naming its PID; two trains
    started together on one dir: one trains, the other is refused and rewrites nothing."""
    run_dir = tmp_path / "run"
    first = start("train", *TINY, "train.steps=100000", "train.ckpt_every=1000", f"hydra.run.dir={run_dir}")
    wait_for(lambda: (run_dir / "metrics.jsonl").is_file(), first, "the first run never logged")
    second = [start("train", f"resume={run_dir}"), start("eval-length", str(run_dir), "eval.lengths=[32]", "eval.tokens=256")]
    for proc in second:
        _, err = proc.communicate(timeout=120)
        assert_one_clear_line(proc.returncode, err, f"{run_dir} is in use by another relpos process (PID {first.pid}")
    assert [json.loads(l)["step"] for l in (run_dir / "metrics.jsonl").read_text().splitlines()][:2] == [2, 4]
    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=120) == 128 + signal.SIGTERM

    together = tmp_path / "together"
    procs = [start("train", *TINY, "train.steps=20", f"seed={seed}", f"hydra.run.dir={together}") for seed in (1, 2)]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    assert sorted(code for code, _ in results) == [0, 2], results
    refused = next(err for code, err in results if code == 2)
    assert "is in use by another relpos process" in refused or "already holds a run" in refused
    trained_seed = OmegaConf.load(together / "config.yaml").seed
    assert f"seed={trained_seed}" in (together / ".hydra" / "overrides.yaml").read_text()


def test_a_dir_that_is_not_a_relpos_run_is_refused_and_untouched(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.yaml").write_text("my: own\n")
    (mine / "metrics.jsonl").write_text("{}\n")
    before = {p.name: p.read_bytes() for p in mine.iterdir()}
    code, _, err = relpos("train", *TINY, f"hydra.run.dir={mine}")
    assert_one_clear_line(code, err, f"{mine} is not empty and holds no relpos run", "nothing in it was touched")
    # bad settings too: the dir is refused first, so nothing, not even a failed.json, lands in it
    # (mutation checked: validating the settings before the dir check prints the steps error and fails here)
    code, _, err = relpos("train", *TINY, "train.steps=-1", f"hydra.run.dir={mine}")
    assert_one_clear_line(code, err, f"{mine} is not empty and holds no relpos run", "nothing in it was touched")
    code, _, err = relpos("inspect", "pos=alibi", "model=tiny", f"hydra.run.dir={mine}")  # a fresh scheme's pictures
    assert_one_clear_line(code, err, f"{mine} is not empty and holds no relpos run")
    code, _, err = relpos("sweep", *TINY, "pos=rope,alibi", f"hydra.sweep.dir={mine}")  # Hydra's multirun.yaml
    assert_one_clear_line(code, err, f"{mine} is not empty and holds no sweep", "nothing in it was touched")
    assert {p.name: p.read_bytes() for p in mine.iterdir()} == before  # no .hydra, relpos.log, lock or failed.json
    os.chdir(mine)
    try:
        code, _, err = relpos("train", *TINY, "hydra.run.dir=")  # an empty run dir means the working directory
    finally:
        os.chdir(tmp_path)
    assert_one_clear_line(code, err, "is not empty and holds no relpos run")
    assert {p.name: p.read_bytes() for p in mine.iterdir()} == before


SCHEMA_RANGES = {  # key -> is a value allowed? Written from the ranges docs/faults.md states, not from the schema
    "train.grad_clip": lambda v: v > 0,
    "train.min_lr_ratio": lambda v: 0 <= v <= 1,
    "train.weight_decay": lambda v: v >= 0,
    "train.warmup_steps": lambda v: isinstance(v, int) and v >= 0,  # a float is not an integer key's value
    "train.lr": lambda v: v > 0,
    "data.val_fraction": lambda v: 0 < v < 1,
    "eval.tokens": lambda v: isinstance(v, int) and v > 0,
    "eval.max_tokens_per_batch": lambda v: isinstance(v, int) and v > 0,
    "model.dropout": lambda v: 0 <= v < 1,
    "model.n_heads": lambda v: isinstance(v, int) and v > 0,
    "inspect.length": lambda v: isinstance(v, int) and v >= 2,
    "wandb.init_timeout": lambda v: v > 0,
    # task.* keys: checked by the task modules, their errors tested in tests/test_tasks.py
}
INTEGER_KEYS = {"train.warmup_steps", "eval.tokens", "eval.max_tokens_per_batch", "model.n_heads", "inspect.length"}


def test_settings_are_checked_against_their_ranges_in_one_place():
    """Random values for the optimiser, data, eval, model, inspect and W&B keys: the schema accepts
    exactly the values in range, and names the range in one line when it refuses."""
    from hypothesis import given, settings
    from hypothesis import strategies as st
    from hydra import compose, initialize_config_dir

    from relpos_cli.config import conf_dir, validate_run_config
    from relpos_cli.errors import RelposError

    with initialize_config_dir(str(conf_dir()), version_base="1.3"):
        base = compose("config")

    @settings(max_examples=150, deadline=None)
    @given(key=st.sampled_from(sorted(SCHEMA_RANGES)),
           value=st.one_of(st.integers(-3, 5), st.sampled_from([-1e-9, 0.0, 0.5, 1.0, 1.5, 2.5, 1e9])))
    def check(key, value):
        cfg = base.copy()
        OmegaConf.update(cfg, key, value)
        try:
            validate_run_config(cfg)
            accepted = True
        except RelposError as e:
            accepted = False
            assert "\n" not in str(e) and key in str(e)
            if key in INTEGER_KEYS and isinstance(value, float):
                assert f"{key} must be an integer, got {value}" in str(e)
            else:
                assert "must be" in str(e) and any(c in str(e) for c in "[(>p")  # the allowed range or "positive"
        assert accepted == SCHEMA_RANGES[key](value), (key, value)

    check()


def test_commands_on_a_trained_run_take_only_their_keys(text_run):
    for override in ("model.n_layers=3", "pos=alibi", "pos.base=500", "train.seq_len=64", "data.tokenizer=bpe", "seed=3"):
        code, _, err = relpos("eval-length", str(text_run), override)
        assert_one_clear_line(code, err, "relpos eval-length takes only eval.*, device, plots.* overrides", override)
    code, _, err = relpos("inspect", str(text_run), "eval.lengths=[32]")
    assert_one_clear_line(code, err, "relpos inspect takes only inspect.*, plots.* overrides")
    code, _, err = relpos("eval-length", str(text_run), "eval.rope_scaling.type=yarn", "eval.lengths=[32]", "eval.tokens=256")
    assert code == 0  # the run is a rope run: scaling applies
    alibi = Path(str(text_run).replace("text_run", "alibi_run"))
    code, _, err = relpos("train", *TINY, "pos=alibi", f"hydra.run.dir={alibi}")
    code, _, err = relpos("eval-length", str(alibi), "eval.rope_scaling.type=yarn", "eval.lengths=[32]", "eval.tokens=256")
    assert_one_clear_line(code, err, "eval.rope_scaling applies to schemes that rotate q and k")
    assert not list(alibi.glob("eval_length*"))


def test_data_is_fingerprinted_and_paths_stored_absolute(text_run, corpus, tmp_path):
    saved = OmegaConf.load(text_run / "config.yaml").data
    assert saved.files == [str(corpus / "a.txt")] and saved.validation_files == [str(corpus / "v.txt")]
    record = json.loads((text_run / "data.json").read_text())
    assert record["files"]["files"][0]["bytes"] == (corpus / "a.txt").stat().st_size
    assert record["tokenizer"]["name"] == "bytes" and record["tokens"]["validation"]["count"] > 0
    eval_args = ["eval.lengths=[32]", "eval.tokens=256"]
    run_cli("eval-length", str(text_run), *eval_args, cwd=tmp_path)  # from another directory

    original, stat = (corpus / "v.txt").read_text(), (corpus / "v.txt").stat()
    (corpus / "v.txt").write_text(original.replace("def ", "fed "))  # same size, other text
    try:
        code, _, err = relpos("eval-length", str(text_run), *eval_args)
        assert_one_clear_line(code, err, f"the data of {text_run} changed since it was trained: {corpus / 'v.txt'} changed",
                              "eval.allow_changed_data=true")
        unfinished = tmp_path / "unfinished"
        shutil.copytree(text_run, unfinished)
        (unfinished / "checkpoint.pt").unlink()
        code, _, err = relpos("train", f"resume={unfinished}")
        assert_one_clear_line(code, err, "changed since it was trained", "restore it to resume the run")
        code, _, err = relpos("eval-length", str(text_run), *eval_args, "eval.allow_changed_data=true")
        assert code == 0 and "changed since it was trained" in err
        rows = json.loads((text_run / "eval_length.allow_changed_data=True.json").read_text())
        assert rows[0]["eval.allow_changed_data"] is True and "v.txt changed" in rows[0]["data_changed"]
    finally:
        (corpus / "v.txt").write_text(original)
        os.utime(corpus / "v.txt", ns=(stat.st_atime_ns, stat.st_mtime_ns))  # its token cache is valid again


def test_no_nan_result(tmp_path, text_run):
    """A model that ends non-finite fails training (tests/test_resume.py); a NaN never becomes a result."""
    broken = tmp_path / "broken"  # a finished run whose weights are NaN (by hand): eval-length writes no result
    broken.mkdir()
    for name in ("config.yaml", "data.json"):
        (broken / name).write_bytes((text_run / name).read_bytes())
    state = torch.load(text_run / "checkpoint.pt", weights_only=False)
    state["model"] = {k: torch.full_like(v, float("nan")) if v.is_floating_point() else v for k, v in state["model"].items()}
    torch.save(state, broken / "checkpoint.pt")
    code, _, err = relpos("eval-length", str(broken), "eval.lengths=[32]", "eval.tokens=256")
    assert_one_clear_line(code, err, "loss at eval length 32 is nan", "nothing was written")
    assert not list(broken.glob("eval_*"))


def test_a_corrupt_final_checkpoint_falls_back_to_the_newest_intact_one(text_run, tmp_path):
    run_dir = tmp_path / "run"
    assert relpos("train", *TINY, "train.ckpt_every=2", f"hydra.run.dir={run_dir}")[0] == 0
    want = final_weights(run_dir)
    data = (run_dir / "checkpoint.pt").read_bytes()
    (run_dir / "checkpoint.pt").write_bytes(data[: len(data) // 2])  # a truncated copy, a full disk
    code, _, err = relpos("eval-length", str(run_dir), "eval.lengths=[32]", "eval.tokens=256")
    assert_one_clear_line(code, err, "corrupt checkpoint", f"relpos train resume={run_dir} retrains it")
    code, out, err = relpos("train", f"resume={run_dir}")
    assert code == 0 and "already finished" not in out
    note = " ".join(err.split())
    assert "checkpoint.pt: corrupt checkpoint" in note and "resuming from" in note and "step_00000002.pt (step 2)" in note
    got = final_weights(run_dir)
    assert all(torch.equal(want[k], got[k]) for k in want)  # retrained from step 2: bitwise the same run
    assert "already finished" in " ".join(relpos("train", f"resume={run_dir}")[1].split())


def test_environment_faults_are_one_line_naming_the_path(tmp_path, monkeypatch, text_run, corpus):
    # rich markup in paths prints as typed
    odd = tmp_path / "[draft]" / "[/x]"
    code, out, err = relpos("train", *TINY, "train.steps=2", f"hydra.run.dir='{odd}'")  # quoted: Hydra's grammar
    assert code == 0 and "[draft]/[/x]" in " ".join(out.split())
    code, _, err = relpos("eval-length", str(odd / "missing"))
    assert_one_clear_line(code, err, "[draft]/[/x]/missing")

    # a full disk (ENOSPC injected into the writes; a tmpfs needs root) and a read-only dir (EROFS)
    for number in (errno.ENOSPC, errno.EROFS):
        fail_writes(monkeypatch, number)
        code, _, err = relpos("eval-length", str(text_run), "eval.lengths=[32]", "eval.tokens=256")
        monkeypatch.undo()
        hint = "no space left on the device" if number == errno.ENOSPC else "read-only file system"
        assert_one_clear_line(code, err, str(text_run), hint)
        assert not list(text_run.glob(".*.tmp"))

    # a run dir that is a file, compare --out FILE, outputs/latest a real directory
    a_file = tmp_path / "file"
    a_file.write_text("x")
    code, _, err = relpos("train", *TINY, f"hydra.run.dir={a_file}")
    assert_one_clear_line(code, err, str(a_file))
    code, _, err = relpos("compare", str(text_run), "--out", str(a_file), "--no-evaluate")
    assert_one_clear_line(code, err, f"--out {a_file} is a file")
    os.chdir(tmp_path)
    (tmp_path / "outputs" / "latest").mkdir(parents=True)
    code, _, err = relpos("train", *TINY, f"hydra.run.dir={tmp_path / 'never'}")
    assert_one_clear_line(code, err, "outputs/latest is a directory", "mv outputs/latest")
    assert not (tmp_path / "never").exists()
    (tmp_path / "outputs" / "latest").rmdir()

    # data: a directory, a file that is not UTF-8, a vocabulary the trainer cannot reserve, a corrupt cache
    (tmp_path / "latin1.txt").write_bytes("café\n".encode("latin-1") * 100)
    for files, fragment in ((f"[{corpus}]", f"{corpus} is a directory"),
                            (f"[{corpus / 'a.txt'},{tmp_path / 'latin1.txt'}]", f"{tmp_path / 'latin1.txt'} is not UTF-8 text")):
        code, _, err = relpos("train", *TINY, "data=text_files", f"data.files={files}", f"hydra.run.dir={tmp_path / 'd'}")
        assert_one_clear_line(code, err, fragment)
    code, _, err = relpos("train", *TINY, "data.tokenizer=bpe", "data.vocab_size=2147483648", f"hydra.run.dir={tmp_path / 'v'}")
    assert_one_clear_line(code, err, "data.vocab_size=2147483648 is too large")

    from relpos_cli.data import load_token_data

    data_cfg = OmegaConf.to_container(OmegaConf.load(text_run / "config.yaml").data)
    cache = load_token_data(data_cfg).cache_dir
    with open(cache / "train.npy", "r+b") as f:
        f.truncate(200)  # a cache cut short by a full disk or a killed copy
    code, _, err = relpos("eval-length", str(text_run), "eval.lengths=[32]", "eval.tokens=256")
    assert code == 0 and f"token cache {cache} is corrupt" in " ".join(err.split()) and "rebuilding it" in err


def test_network_waits_are_bounded_and_fail_in_one_line(tmp_path):
    """W&B online without a login and with an unreachable server (a closed loopback port), the hub
    unreachable: each one line with what to do. No traffic leaves the machine."""
    loopback = {"WANDB_BASE_URL": "http://127.0.0.1:9", "HF_ENDPOINT": "http://127.0.0.1:9",
                "HOME": str(tmp_path), "WANDB_CONFIG_DIR": str(tmp_path / "wandb")}
    env = {k: v for k, v in ENV.items() if k not in ("WANDB_API_KEY", "WANDB_MODE", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    runs = {
        "no login": ({**loopback}, ["wandb.mode=online"]),
        "no server": ({**loopback, "WANDB_API_KEY": "x" * 40}, ["wandb.mode=online", "wandb.init_timeout=3"]),
        "no hub": ({**loopback}, ["data=hub", "data.path=nobody/nothing"]),
    }
    procs = {name: subprocess.Popen([sys.executable, "-m", "relpos_cli", "train", *TINY[:-1], *args,
                                     f"hydra.run.dir={tmp_path / name.replace(' ', '_')}"],
                                    env={**env, **extra}, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, (extra, args) in runs.items()}
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=180)
        fragments = ("cannot load dataset 'nobody/nothing'", "unreachable") if name == "no hub" else (
            "W&B could not start a run", "wandb.mode=offline")
        assert_one_clear_line(proc.returncode, err, *fragments)


def fail_writes(monkeypatch, number: int) -> None:
    """Every atomic write fails with OSError(number): a full disk (ENOSPC; a tmpfs needs root) or a
    read-only dir (EROFS), injected where relpos writes its files. monkeypatch.undo() ends it."""
    from relpos_cli import atomic

    real_fdopen = os.fdopen

    def failing_fdopen(fd, *args, **kwargs):
        class Failing:
            def __init__(self, f):
                self.f = f

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self.f.close()

            def write(self, data):
                raise OSError(number, os.strerror(number))

        return Failing(real_fdopen(fd, *args, **kwargs))

    monkeypatch.setattr(atomic.os, "fdopen", failing_fdopen)


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o002, 0o664)])
def test_files_follow_the_umask(tmp_path, umask, mode):
    script = ("from relpos_cli.atomic import atomic_write_text; import sys; atomic_write_text(sys.argv[1], 'x')")
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "f")], env=ENV, check=True,
                   preexec_fn=lambda: os.umask(umask))
    assert (tmp_path / "f").stat().st_mode & 0o777 == mode


def ctrl_c_after_the_first_checkpoint(proc, sweep) -> str:
    """SIGINT to a sweep once its first job saved a checkpoint; its stderr (exit 130 checked)."""
    wait_for(lambda: list(sweep.glob("0_*/checkpoints/step_*.pt")), proc, "the first job never saved a checkpoint")
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    return err


def test_ctrl_c_in_a_sweep_names_the_jobs_that_never_ran(tmp_path):
    sweep = tmp_path / "sweep"
    proc = start("train", "-m", *TINY, "train.steps=100000", "train.ckpt_every=2", "pos=rope,alibi,t5",
                 f"hydra.sweep.dir={sweep}")
    assert_one_clear_line(130, ctrl_c_after_the_first_checkpoint(proc, sweep), "SIGINT at step",
                          "resume with: relpos train resume=",
                          "the sweep stopped at job #0, these 2 never ran: #1 pos=alibi; #2 pos=t5")


@pytest.mark.parametrize("number", [errno.ENOSPC, errno.EROFS])
def test_a_checkpoint_written_on_a_full_disk_is_an_os_error_naming_it(tmp_path, monkeypatch, number):
    """checkpoint.pt is streamed to its file by torch.save, whose zip writer turns a failed write into a
    RuntimeError ("unexpected pos ..."): it must reach the CLI as the OSError it was, naming the file (the
    one line describe_os_error writes), with neither the file nor its temp left behind."""
    import io

    from relpos_cli import atomic
    from relpos_cli.checkpoint import save_checkpoint
    from relpos_cli.console import describe_os_error

    real_fdopen = os.fdopen

    class FillsUp(io.RawIOBase):  # the file, until 4 KiB have been written
        def __init__(self, f):
            self.f, self.written = f, 0

        def writable(self):
            return True

        def write(self, data):
            self.written += len(data)
            if self.written > 4096:
                raise OSError(number, os.strerror(number))
            return self.f.write(data)

        def close(self):
            self.f.close()
            super().close()

    monkeypatch.setattr(atomic.os, "fdopen", lambda fd, *a, **k: FillsUp(real_fdopen(fd, *a, **k)))
    with pytest.raises(OSError) as caught:
        save_checkpoint(tmp_path, {"step": 1, "model": {"w": torch.zeros(100_000)}})
    assert caught.value.errno == number and caught.value.filename == str(tmp_path / "checkpoint.pt")
    assert str(tmp_path / "checkpoint.pt") in describe_os_error(caught.value)
    assert list(tmp_path.iterdir()) == []
