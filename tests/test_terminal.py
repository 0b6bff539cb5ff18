"""The terminal: tables that read at 80 columns, --version, shell completion of commands and
overrides, config groups in --help, progress bars that count the evaluation's work."""

import io
import time
import os
import shutil
import subprocess
import sys
from contextlib import contextmanager

import numpy as np
import pytest
from rich.console import Console

from conftest import REPO, run_in_process
from relpos_cli import __version__
from relpos_cli.compare import group_runs, run_compare
from relpos_cli.runs import find_runs, read_run
from relpos_cli.completion import complete_override
from relpos_cli.config import conf_dir
from relpos_cli.positions import scheme_names
from relpos_cli.tables import configuration_labels, short_value
from test_compare import make_run

pytestmark = pytest.mark.usefixtures("in_temp_cwd")
LENGTHS = (128, 256, 512)


def assert_fits(text: str, width: int = 80) -> None:
    lines = text.splitlines()
    assert lines and max(len(l) for l in lines) <= width, max(lines, key=len)
    assert "…" not in text  # nothing cut short


def printed_cells(text: str) -> tuple[list[str], list[list[str]]]:
    """The tables in `text` as Rich drew them: (every header, the lines of a header that takes several
    joined by newlines; every body line split into its cells)."""
    headers, rows, header_lines = [], [], []
    for line in [*text.splitlines(), ""]:
        if line.startswith("┃"):
            header_lines.append([c.strip() for c in line.split("┃")[1:-1]])
            continue
        headers += ["\n".join(part for part in column if part) for column in zip(*header_lines)]
        header_lines = []
        if line.startswith("│"):
            rows.append([c.strip() for c in line.split("│")[1:-1]])
    return headers, rows


def assert_whole(text: str, headers, rows) -> None:
    """Fits 80 columns with every header and every row's leading cells (its label) whole: a label Rich
    folds to fit (`kerple_powe` over `r`, `configurati` over `on`) fails, which a width check alone passes.

    Args:
        headers: every header the tables must show, two-line ones ("position\nlogits") as written.
        rows: tuples of leading cells (label, eval variant) each printed on one line of some row.
    """
    assert_fits(text)
    printed_headers, printed_rows = printed_cells(text)
    assert not set(headers) - set(printed_headers), (set(headers) - set(printed_headers), text)
    leading = {tuple(row[:n]) for row in printed_rows for n in range(1, len(row) + 1)}
    assert not {tuple(r) for r in rows} - leading, ({tuple(r) for r in rows} - leading, text)


def test_configurations_are_named_by_the_keys_that_differ():
    configs = [{"pos.name": "rope", "pos.base": 10000.0, "train.seq_len": 128},
               {"pos.name": "rope", "pos.base": 10000.0, "train.seq_len": 256},
               {"pos.name": "alibi", "train.seq_len": 128},
               {"pos.name": "t5", "pos.num_buckets": 32, "train.seq_len": 128},
               {"pos.name": "t5", "pos.num_buckets": 64, "train.seq_len": 128}]
    keys, labels = configuration_labels(configs, ["pos.name", "pos.base", "pos.num_buckets", "train.seq_len"])
    # pos.base only follows from pos.name; num_buckets differs between two t5 runs, so it names them
    assert keys == ["pos.name", "pos.num_buckets", "train.seq_len"]
    assert labels == ["rope, seq_len=128", "rope, seq_len=256", "alibi, seq_len=128",
                      "t5, num_buckets=32, seq_len=128", "t5, num_buckets=64, seq_len=128"]
    assert [short_value(v) for v in (10000.0, 3e-4, True, None, [1, 2.5], "/data/corpora/wiki.txt")] == \
        ["10000", "0.0003", "true", "null", "[1,2.5]", "wiki.txt"]


def test_compare_reads_at_80_columns(tmp_path):
    rng = np.random.default_rng(0)
    schemes = ["rope", "alibi", "t5", "kerple_power", "sinusoidal", "none"]
    for i, pos in enumerate(schemes):
        for seed in range(2):
            make_run(tmp_path / "sweep" / f"{i}{seed}", pos, seed, 128, list(rng.uniform(3, 300, len(LENGTHS))))
    make_run(tmp_path / "sweep" / "00", "rope", 0, 128, [1.0, 2.0, 3.0], variant="protocol=sliding,stride=64",
             protocol="sliding", stride=64)
    out = io.StringIO()
    run_compare([tmp_path / "sweep"], [], tmp_path / "out", False, "ppl", Console(file=out, width=80))
    text = out.getvalue()
    assert_whole(text, ["configuration", "eval", "n", "128*", "256", "512"],
                 [(pos, "–") for pos in schemes] + [("rope", "protocol=sliding, stride=64")])
    # a row's label and eval variant on one line: a second line holds only the cells' ± std
    _, rows = printed_cells(text)
    assert all(all(c.startswith("±") for c in row if c) for row in rows if not row[0])
    assert "rows: pos.name, then the eval variant" in " ".join(text.split())

    many = group_runs([read_run(p) for p in find_runs(tmp_path / "sweep")])
    for g in many:  # eight lengths do not fit side by side: the table folds into blocks of lengths
        g["cells"] = {l: {"mean": 1234.5678, "std": 12.3, "n": 2} for l in (2 ** k for k in range(7, 15))}
    from relpos_cli.compare import compare_table

    out = io.StringIO()
    Console(file=out, width=80).print(compare_table(many, "title"))
    assert_whole(out.getvalue(), ["configuration", "eval", "n", "128*", *(str(2 ** k) for k in range(8, 15))],
                 [(pos, "–") for pos in schemes] + [("rope", "protocol=sliding, stride=64")])


def test_compare_caption_says_the_protocol_that_eval_variants_share(tmp_path):
    """Eval variants of one protocol (the plain result, Self-Extend) scored over other token counts:
    the tokens became a column and the caption said no protocol at all (neither did the variants)."""
    from relpos_cli.compare import compare_table

    make_run(tmp_path / "sweep" / "r", "rope", 0, 128, [1.0, 2.0, 3.0])
    make_run(tmp_path / "sweep" / "r", "rope", 0, 128, [1.0, 2.0, 3.0], variant="self_extend.group=8,self_extend.window=64")
    groups = group_runs([read_run(p) for p in find_runs(tmp_path / "sweep")])
    groups[0]["tokens"] = [32768]
    out = io.StringIO()
    Console(file=out, width=200).print(compare_table(groups, "title"))
    caption = " ".join(out.getvalue().split()).split("rows: ", 1)[1]
    assert groups[0]["protocol"] == groups[1]["protocol"] and groups[0]["protocol"] in caption
    out = io.StringIO()
    run_compare([tmp_path / "sweep"], [], tmp_path / "out", False, "ppl", Console(file=out, width=200))
    assert "ppl vs eval length, 1 run\n" in out.getvalue()  # not "1 runs"


@pytest.mark.parametrize("schemes, seq_lens, labels", [
    # labels shorter than the `configuration` header, which folded to `configurati` over `on`
    (["t5", "none"], [128], ["t5", "none"]),
    # labels longer than 24 characters, which folded to `stickbreaking,` over `seq_len=128`
    (["stickbreaking", "kerple_power"], [128, 256], ["stickbreaking, seq_len=128", "stickbreaking, seq_len=256",
                                                    "kerple_power, seq_len=128", "kerple_power, seq_len=256"]),
])
def test_compare_labels_and_headers_print_whole_at_80_columns(tmp_path, schemes, seq_lens, labels):
    """compare's perplexity and accuracy tables at 1 to 11 lengths, with and without an eval column, with an n column."""
    from relpos_cli.compare import compare_table
    from test_eval_task import fake_task_run

    for pos in schemes:
        for seq_len in seq_lens:
            make_run(tmp_path / "sweep" / f"{pos}{seq_len}", pos, 0, seq_len, [1.0, 2.0, 3.0])
            make_run(tmp_path / "sweep" / f"{pos}{seq_len}", pos, 0, seq_len, [1.0, 2.0, 3.0],
                     variant="protocol=sliding,stride=64", protocol="sliding", stride=64)
    make_run(tmp_path / "sweep" / "seed1", schemes[0], 1, seq_lens[0], [1.0, 2.0, 3.0])  # rows of 1 and 2 runs: an n column
    groups = group_runs([read_run(p) for p in find_runs(tmp_path / "sweep")])
    for count in range(1, 12):
        lengths = [2 ** k for k in range(7, 7 + count)]
        for g in groups:
            g["cells"] = {l: {"mean": 1234.5678, "std": 12.3, "n": 1} for l in lengths}
        for shown, eval_column in [(groups, ["eval"]), ([g for g in groups if g["variant"] == "default"], [])]:
            out = io.StringIO()
            Console(file=out, width=80).print(compare_table(shown, "title"))
            assert_whole(out.getvalue(), ["configuration", *eval_column, "n", *(str(l) for l in lengths[1:])],
                         [(label,) for label in labels])

    lengths = tuple(2 ** k for k in range(7, 14))
    for pos in schemes:  # compare --metric accuracy: seven lengths and the effective length
        for seq_len in seq_lens:
            fake_task_run(tmp_path / "tasks" / f"{pos}{seq_len}", pos, 0, [1.0, 0.5, 0.25, 0.1, 0.0, 0.0, 0.0],
                          lengths=tuple(l for l in lengths if l >= seq_len))
    out = io.StringIO()
    run_compare([tmp_path / "tasks"], [], tmp_path / "out", False, "accuracy", Console(file=out, width=80))
    assert_whole(out.getvalue().split("wrote ")[0], ["configuration", "eff. L", *(str(l) for l in lengths[2:])],
                 [(label,) for label in labels])


def test_schemes_and_eval_and_inspect_tables_read_at_80_columns(tmp_path, monkeypatch, tiny_run):
    """schemes, inspect, and the evaluation tables: eval-length's at eight lengths, eval-task's
    passkey grid at eight lengths (five depths and the overall accuracy), and compare --metric
    accuracy over six schemes and six lengths. Mutation checked: eval-task's table with a
    correct/answers column added overflows 80 columns and fails here."""
    monkeypatch.setenv("COLUMNS", "80")
    code, out, _ = run_in_process("schemes")
    assert code == 0
    assert_whole(out, ["scheme (paper)", "hooks", "bias on", "params", "shift inv."], [(name,) for name in scheme_names()])
    code, out, _ = run_in_process("inspect", "pos=alibi", "model=tiny", "inspect.length=8", "wandb.mode=disabled",
                                  f"hydra.run.dir={tmp_path / 'inspect'}")
    assert code == 0
    assert_whole(out.split("wrote ")[0], ["layer", "head", "position\nlogits", "position\nsoftmax", "position\ncausal"],
                 [(layer, head) for layer in "01" for head in "01"])  # model=tiny: 2 layers of 2 heads

    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)  # eval files of its own: the shared run stays as other tests expect it
    lengths = [32 * 2 ** k for k in range(8)]  # 32 .. 4096
    code, out, err = run_in_process("eval-length", str(run), f"eval.lengths=[{','.join(map(str, lengths))}]",
                                    "eval.tokens=4096")
    assert code == 0, err
    assert_whole(out.split("wrote ")[0], ["length", "loss (nats)", "ppl", "bpb", "ppl ÷ ppl@32"],
                 [("32 (train)",), *((str(l),) for l in lengths[1:])])

    from relpos_cli.eval_task import accuracy_table, with_intervals  # eval-task's table: passkey at 1x..128x, five depths
    from test_eval_task import fake_task_run

    depths, task_lengths = (0.0, 0.25, 0.5, 0.75, 1.0), [128 * 2 ** k for k in range(8)]
    common = {"task": "passkey", "threshold": 0.9, "train_len": 128, "effective_length": 512, "samples": 100,
              "answers": 100}
    cells = [{"length": l, "depth": d, "accuracy": 0.123, "correct": 12, **common, "samples": 20, "answers": 20}
             for l in task_lengths for d in depths]
    per_length = [{"length": l, "depth": "all", "accuracy": 0.123, "correct": 12, **common} for l in task_lengths]
    with_intervals(per_length, cells, 0.9, 128, True)
    out = io.StringIO()
    Console(file=out, width=80).print(accuracy_table(per_length, cells, "12-00-00-000000_cope  task=passkey  train L=128"))
    assert_whole(out.getvalue(), ["length", *(f"depth {d:g}" for d in depths), "all"],
                 [("128*",), *((str(l),) for l in task_lengths[1:])])

    schemes = ["rope", "alibi", "t5", "kerple_power", "cope", "none"]
    for i, pos in enumerate(schemes):  # compare --metric accuracy
        for seed in range(2):
            fake_task_run(tmp_path / "tasks" / f"{i}{seed}", pos, seed, [1.0, 0.75, 0.5, 0.25, 0.125, 0.0],
                          lengths=(128, 256, 512, 1024, 2048, 4096), ppls=[3.0, 4.0, 5.0, 6.0, 7.0, 8.0])
    out = io.StringIO()
    run_compare([tmp_path / "tasks"], [], tmp_path / "out", False, "accuracy", Console(file=out, width=80))
    assert_whole(out.getvalue().split("wrote ")[0], ["configuration", "128*", "256", "512", "1024", "2048", "4096", "eff. L"],
                 [(pos,) for pos in schemes])


def test_version():
    code, out, _ = run_in_process("--version")
    assert code == 0 and out.strip() == f"relpos {__version__}"


def test_train_help_lists_config_groups_and_their_options():
    code, out, _ = run_in_process("train", "--help")
    text = " ".join(out.split())
    assert code == 0 and "Config groups" in text
    assert "pos: " + ", ".join(sorted(scheme_names())) in text
    presets = ", ".join(sorted(p.stem for p in (conf_dir() / "experiment").glob("*.yaml")))
    assert "model: small, tiny" in text and f"+experiment: {presets}" in text and "hydra/launcher: local, slurm" in text


@pytest.mark.parametrize("command, usage, sentence", [
    ("eval-length", "relpos eval-length [OPTIONS] RUN_OR_SWEEP... [KEY=VALUE]...",
     "(each exactly once), loading each model once."),
    ("eval-task", "relpos eval-task [OPTIONS] RUN_OR_SWEEP... [KEY=VALUE]...", "eval.allow_changed_data, eval.precision, plots.*"),
    ("compare", "relpos compare [OPTIONS] PATH... [KEY=VALUE]...", "(seed, paths, hydra, wandb excluded)"),
    ("import", "relpos import [OPTIONS] SOURCE OUT_DIR [KEY=VALUE]...", "a local Hugging Face model dir, or a .gguf file"),
])
def test_help_shows_the_arguments_and_wraps_sentences_at_the_terminal_only(monkeypatch, command, usage, sentence):
    """Typer's rich help kept each docstring line break, then wrapped at the terminal too: at 80 columns
    sentences broke mid-line (`loading` / `each model once`); the usage line named no argument."""
    monkeypatch.setenv("COLUMNS", "300")  # a line of the help then holds a whole paragraph
    code, out, _ = run_in_process(command, "--help")
    assert code == 0 and usage.removeprefix("relpos ") in out  # in process the program is named otherwise
    assert any(sentence in line for line in out.splitlines()), out


@pytest.mark.parametrize("command", ["train", "sweep", "eval-length", "eval-task", "compare", "import", "sample",
                                     "inspect", "schemes"])
def test_help_examples_fit_80_columns(monkeypatch, command):
    """An example past the width broke onto a line of its own (`# 6 schemes x 2 seeds` / `on CPU, < 1 h
    on 2 cores`; `relpos sample ... eval.self_extend.group=4` / `eval.self_extend.window=64`): a
    command a reader copies must stay whole."""
    monkeypatch.setenv("COLUMNS", "80")
    code, out, _ = run_in_process(command, "--help")
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "Examples")
    rest = lines[start + 1:]
    block = []
    for i, line in enumerate(rest):
        following = next((l for l in rest[i + 1:] if l.strip()), "")
        if line.startswith("╭") or (not line.strip() and block and not following.startswith("   ")):
            break  # the options box, or the paragraph after the examples
        block.append(line)
    examples = [line.strip() for line in block if line.strip()]
    assert code == 0 and examples
    assert all(line.startswith(("relpos ", "# ")) for line in examples), examples


@pytest.fixture(scope="module")
def relpos_on_path(tmp_path_factory):
    """A `relpos` executable running this checkout, as an installed one would."""
    bin_dir = tmp_path_factory.mktemp("bin")
    exe = bin_dir / "relpos"
    exe.write_text(f"#!/bin/sh\nPYTHONPATH={REPO} exec {sys.executable} -m relpos_cli \"$@\"\n")
    exe.chmod(0o755)
    return bin_dir


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_bash_completion_of_commands_groups_and_keys(relpos_on_path):
    """The script --show-completion prints, sourced in bash, as <TAB> runs it (bash splits words at '=')."""
    def complete(*words: str) -> list[str]:
        script = (f'source <(relpos --show-completion bash)\nCOMP_WORDS=({" ".join(repr(w) for w in words)})\n'
                  f'COMP_CWORD={len(words) - 1}\n_relpos_completion relpos\nprintf "%s\\n" "${{COMPREPLY[@]}}"\n')
        env = {**os.environ, "PATH": f"{relpos_on_path}:{os.environ['PATH']}"}
        proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, timeout=120)
        return [l for l in proc.stdout.splitlines() if l]

    assert complete("relpos", "ev") == ["eval-length", "eval-task"]
    assert complete("relpos", "train", "pos", "=", "al") == ["alibi"]  # pos=al<TAB>
    assert complete("relpos", "sweep", "train.ste") == ["train.steps=600"]
    # the other ways bash hands the words over, without a shell each
    assert "kerple_log" in complete_override(["pos"], "")  # pos=<TAB>: click drops the lone '='
    assert complete_override(["-m", "hydra/launcher", "="], "") == ["local", "slurm"]


def test_zsh_completion_of_an_override(relpos_on_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "_RELPOS_COMPLETE": "complete_zsh", "_TYPER_COMPLETE_ARGS": "relpos train model="}
    out = subprocess.run([sys.executable, "-m", "relpos_cli"], capture_output=True, text=True, env=env).stdout
    assert '"model=small"' in out and '"model=tiny"' in out


@contextmanager
def counting(counts: dict):
    def advance(n=1):
        counts["done"] += n
    yield advance


def test_evaluation_progress_counts_every_forward_pass(tiny_run):
    from relpos_cli.evaluate import evaluate_run
    from relpos_cli.terminal import progress_bar

    counts = {"done": 0}

    def progress(total):
        counts["total"] = total
        return counting(counts)

    # 1024 tokens, 128 a pass: 32 windows of 32 four a pass, 16 of 64 two a pass, 4 of 256 one a pass
    evaluate_run(tiny_run, ["eval.lengths=[32,64,256]", "eval.tokens=1024", "eval.max_tokens_per_batch=128"], progress)
    assert counts == {"total": 8 + 8 + 4, "done": 8 + 8 + 4}

    out = io.StringIO()  # on a terminal the bar shows its label, count, rate and time left while it runs
    with progress_bar(Console(file=out, force_terminal=True, width=120), "eval run", 3, "examples") as advance:
        advance(1)
        time.sleep(0.05)
        advance(2)
    text = out.getvalue()
    assert "eval run" in text and "3/3" in text and "examples/s" in text and "eta" in text
