"""scripts/results_page.py: a results page is generated from a real sweep's own files.

A tiny two-scheme sweep is run through `--record` (as a measurement would be), then the page and
the README block are made from it. Mutations checked to fail these tests: copying compare.md from
its fourth line (`text.splitlines()[3:]`: the header row is lost;
test_page_copies_compare_tables_and_provenance fails); `git status` counting untracked files as
dirty (`--untracked-files=normal`: test_dirty_means_tracked_files_changed fails); writing the page
before checking the README markers (test_bad_inputs_are_one_line_and_write_nothing finds the page)."""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

SCRIPT = REPO / "scripts" / "results_page.py"
TINY_SWEEP = ["model=tiny", "train.steps=2", "train.batch_size=4", "train.seq_len=32", "train.val_batches=1",
              "train.log_every=1", "eval.lengths=[32,64]", "eval.tokens=256", "pos=alibi,rope", "seed=0"]


def load_script():
    spec = importlib.util.spec_from_file_location("results_page", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def script(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=cwd or REPO, env=env, capture_output=True,
                          text=True, timeout=600)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    """A recorded sweep: `--record DIR -- relpos sweep ...` with two tiny runs, each evaluated, compared."""
    root = tmp_path_factory.mktemp("sweep")
    sweep_dir = root / "tiny-sweep"
    cache = tmp_path_factory.mktemp("cache")
    env = {**os.environ, "PYTHONPATH": str(REPO), "RELPOS_CACHE": str(cache), "WANDB_MODE": "disabled",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "COLUMNS": "200"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--record", str(sweep_dir), "--", sys.executable, "-m",
                           "relpos_cli", "sweep", *TINY_SWEEP, f"hydra.sweep.dir={sweep_dir}"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return sweep_dir


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, check=True).stdout


def test_record_writes_provenance(sweep):
    prov = json.loads((sweep / "provenance.json").read_text())
    assert prov["commit"] == git("rev-parse", "HEAD").strip()
    assert prov["dirty"] == bool(git("status", "--porcelain", "--untracked-files=no").strip())
    assert prov["exit_code"] == 0
    assert len(prov["commands"]) == 1 and " relpos_cli sweep " in prov["commands"][0]
    assert prov["threads"] == os.environ.get("OMP_NUM_THREADS", "torch default")
    assert prov["machine"].startswith(f"{os.cpu_count()}-core CPU (")
    assert prov["started"] <= prov["finished"]
    import relpos_cli

    assert prov["relpos"] == relpos_cli.__version__


def test_page_copies_compare_tables_and_provenance(sweep, tmp_path):
    commentary = tmp_path / "notes.md"
    commentary.write_text("One seed per scheme: an observation of these runs, not a ranking.\n")
    page = tmp_path / "page.md"
    proc = script(str(sweep), "--out", str(page), "--title", "Tiny sweep", "--commentary", str(commentary))
    assert proc.returncode == 0, proc.stderr
    text = page.read_text()
    lines = text.splitlines()
    compare_rows = [l for l in (sweep / "compare.md").read_text().splitlines() if l.startswith("|")]
    assert len(compare_rows) == 4  # header, rule, alibi, rope
    i = lines.index(compare_rows[0])
    assert lines[i:i + len(compare_rows)] == compare_rows  # the table whole, in order, unchanged
    prov = json.loads((sweep / "provenance.json").read_text())
    assert lines[0] == "# Tiny sweep"
    assert f"`{prov['commit']}`" in text and prov["commands"][0] in text
    assert text.rstrip().endswith(commentary.read_text().rstrip())
    assert "## Commentary (hand-written)" in text
    runs = [l for l in lines if l.startswith("| `") and "finished" in l]
    assert len(runs) == 2 and any("pos=alibi" in l for l in runs) and any("pos=rope" in l for l in runs)


def test_commentary_only_replaces_the_commentary_and_nothing_else(sweep, tmp_path, capsys):
    """A page whose runs are gone gets its commentary from the edited file; every generated line
    stays as generated: the page is what a full regeneration with the new commentary would write."""
    first, second = tmp_path / "first.md", tmp_path / "second.md"
    first.write_text("Old notes.\n")
    second.write_text("New notes, with a [link](x.md).\n\n## Not a heading of the page\n")
    page, regenerated = tmp_path / "page.md", tmp_path / "regenerated.md"
    assert script(str(sweep), "--out", str(page), "--title", "T", "--commentary", str(first)).returncode == 0
    assert script(str(sweep), "--out", str(regenerated), "--title", "T", "--commentary", str(second)).returncode == 0
    proc = script("--commentary-only", "--out", str(page), "--commentary", str(second))
    assert proc.returncode == 0, proc.stderr
    assert page.read_text() == regenerated.read_text()
    stray = tmp_path / "stray.md"
    stray.write_text("# a page written by hand\n")
    check_refused(["--commentary-only", "--out", stray, "--commentary", second], "is not a page this script generated", capsys)
    assert stray.read_text() == "# a page written by hand\n"
    check_refused(["--commentary-only", sweep, "--out", page, "--commentary", second], "--commentary-only takes", capsys)


def test_readme_block_is_replaced_between_markers(sweep, tmp_path):
    readme = tmp_path / "README.md"
    before, after = "# x\n\nintro\n\n", "\n\nafter the table\n"
    readme.write_text(f"{before}<!-- results: tiny-sweep -->\nold table\n<!-- /results: tiny-sweep -->{after}")
    page = tmp_path / "docs" / "results" / "tiny.md"
    proc = script(str(sweep), "--out", str(page), "--readme", str(readme), "--readme-rows", "rope")
    assert proc.returncode == 0, proc.stderr
    text = readme.read_text()
    assert text.startswith(before) and text.endswith(after) and "old table" not in text
    rows = [l for l in (sweep / "compare.md").read_text().splitlines() if l.startswith("|")]
    block = text.split("<!-- results: tiny-sweep -->\n")[1].split("\n<!-- /results: tiny-sweep -->")[0]
    assert block.splitlines()[:3] == [rows[0], rows[1], next(r for r in rows if r.startswith("| rope |"))]
    assert "| alibi |" not in block
    assert "(docs/results/tiny.md)" in block  # the link, relative to the README
    prov = json.loads((sweep / "provenance.json").read_text())
    assert prov["commit"][:7] in block


def test_readme_block_of_a_dir_filled_by_several_commands_names_none_alone(sweep, tmp_path):
    """A dir filled in parts: the README line must not credit every row to the first command."""
    parts = tmp_path / "tiny-sweep"
    shutil.copytree(sweep, parts)
    prov = json.loads((parts / "provenance.json").read_text())
    first = prov["commands"][0]
    prov["commands"].append(first.replace("pos=alibi,rope", "pos=t5"))
    (parts / "provenance.json").write_text(json.dumps(prov))
    readme = tmp_path / "README.md"
    readme.write_text("<!-- results: tiny-sweep -->\n<!-- /results: tiny-sweep -->\n")
    proc = script(str(parts), "--out", str(tmp_path / "page.md"), "--readme", str(readme))
    assert proc.returncode == 0, proc.stderr
    text = readme.read_text()
    assert first not in text
    assert "2 commands into one dir (listed on the page)" in text
    assert first in (tmp_path / "page.md").read_text()  # the page itself lists each


def test_dirty_means_tracked_files_changed(tmp_path):
    """An untracked file (a run's output, a scratch note) leaves the tree clean; an edited tracked file does not."""
    repo = tmp_path / "repo"
    repo.mkdir()
    run = lambda *a: subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *a],  # noqa: E731
                                    check=True, capture_output=True)
    run("init", "-q")
    (repo / "code.py").write_text("x = 1\n")
    run("add", "code.py")
    run("commit", "-q", "-m", "one")
    module = load_script()
    (repo / "scratch.txt").write_text("untracked\n")
    host = module.host_provenance(repo)
    assert host["dirty"] is False and host["commit"] == subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    (repo / "code.py").write_text("x = 2\n")
    assert module.host_provenance(repo)["dirty"] is True


def check_refused(args: list[str], expected: str, capsys, out: Path | None = None):
    module = load_script()
    code = module.main([str(a) for a in args])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("error: ") and expected in err, err
    if out is not None:
        assert not out.exists()


def test_bad_inputs_are_one_line_and_write_nothing(sweep, tmp_path, capsys):
    out = tmp_path / "page.md"
    empty = tmp_path / "empty"
    empty.mkdir()
    check_refused([empty, "--out", out], "provenance.json not found", capsys, out)
    shutil.copy(sweep / "provenance.json", empty)
    check_refused([empty, "--out", out], "no runs under", capsys, out)
    no_compare = tmp_path / "no_compare"
    shutil.copytree(sweep, no_compare)
    (no_compare / "compare.md").unlink()
    check_refused([no_compare, "--out", out], "no compare.md or compare_accuracy.md", capsys, out)
    # a compare.md older than a run's evaluation: the table may no longer be what the runs hold
    stale = tmp_path / "stale"
    shutil.copytree(sweep, stale)
    os.utime(stale / "compare.md", (1, 1))
    check_refused([stale, "--out", out], "is older than", capsys, out)
    # provenance without a field, with a short commit, not JSON
    for broken, expected in (({"commit": None}, "'commit' must be a str"),
                             ({"commit": "b5f6efd"}, "40 hex digits"),
                             ({"commands": []}, "at least one command"),
                             ({"exit_code": True}, "'exit_code' must be a int")):
        bad = tmp_path / f"bad{len(list(tmp_path.iterdir()))}"
        shutil.copytree(sweep, bad)
        prov = json.loads((sweep / "provenance.json").read_text())
        (bad / "provenance.json").write_text(json.dumps({**prov, **broken}))
        check_refused([bad, "--out", out], expected, capsys, out)
    (bad / "provenance.json").write_text("{not json")
    check_refused([bad, "--out", out], "not readable JSON", capsys, out)
    # README: no markers, or a row the table lacks; the page is not written either
    readme = tmp_path / "README.md"
    readme.write_text("# no markers\n")
    check_refused([sweep, "--out", out, "--readme", readme], "needs one '<!-- results: tiny-sweep -->'", capsys, out)
    readme.write_text("<!-- results: tiny-sweep -->\n<!-- /results: tiny-sweep -->\n")
    check_refused([sweep, "--out", out, "--readme", readme, "--readme-rows", "xpos"], "not a row of", capsys, out)
    assert readme.read_text() == "<!-- results: tiny-sweep -->\n<!-- /results: tiny-sweep -->\n"
    check_refused([sweep, "--out", tmp_path], "is a directory", capsys)
    check_refused([sweep, "--out", out, "--commentary", tmp_path / "missing.md"], "not found", capsys, out)
    check_refused([], "give a sweep dir", capsys)
    check_refused(["--record", tmp_path / "rec", "--"], "give the command after --", capsys)
    check_refused(["--record", tmp_path / "rec", "--", "no-such-command-xyz"], "command not found", capsys)
    assert not (tmp_path / "rec" / "provenance.json").exists()


def test_record_refuses_a_dir_recorded_at_another_commit(sweep, tmp_path, capsys):
    other = tmp_path / "other"
    other.mkdir()
    prov = json.loads((sweep / "provenance.json").read_text())
    (other / "provenance.json").write_text(json.dumps({**prov, "commit": "0" * 40}))
    marker = tmp_path / "ran"
    check_refused(["--record", other, "--", sys.executable, "-c", f"open({str(marker)!r}, 'w')"],
                  "was recorded at commit 000000000000", capsys)
    assert not marker.exists()  # refused before running anything


def test_record_appends_a_later_command(sweep, tmp_path):
    target = tmp_path / "again"
    shutil.copytree(sweep, target)
    proc = script("--record", str(target), "--", sys.executable, "-c", "print('compare')")
    assert proc.returncode == 0, proc.stderr
    prov = json.loads((target / "provenance.json").read_text())
    first = json.loads((sweep / "provenance.json").read_text())
    # as a shell reads it back: the argument with a space and quotes stays one
    assert prov["commands"] == first["commands"] + [f"{sys.executable} -c 'print('\"'\"'compare'\"'\"')'"]
    assert shlex.split(prov["commands"][-1]) == [sys.executable, "-c", "print('compare')"]
    assert prov["started"] == first["started"] and prov["finished"] >= first["finished"]


def test_each_recorded_command_keeps_its_own_thread_setting(sweep, tmp_path):
    """Commands recorded into one dir under other OMP_NUM_THREADS: the page says which command ran with
    which (a single field said the last one's for all of them)."""
    target = tmp_path / "threads"
    shutil.copytree(sweep, target)
    first = json.loads((sweep / "provenance.json").read_text())["threads"]
    for threads in ("1", "2", "2"):
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": threads}
        proc = subprocess.run([sys.executable, str(SCRIPT), "--record", str(target), "--", sys.executable, "-c", "pass"],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
    prov = json.loads((target / "provenance.json").read_text())
    assert prov["threads_by_command"] == [first, "1", "2", "2"]
    expected = f"{first} (command 1), 1 (command 2), 2 (commands 3-4)" if first != "1" else "1 (commands 1-2), 2 (commands 3-4)"
    assert prov["threads"] == expected
    page = tmp_path / "page.md"
    assert script(str(target), "--out", str(page), "--title", "T").returncode == 0
    assert f"| threads | {expected} |" in page.read_text()


def test_two_records_into_one_dir_at_once_keep_both_commands(sweep, tmp_path):
    """The first command is still running when a second one, into the same dir, finishes: the first
    must not write back the provenance it read when it started (which lacked the second command)."""
    target = tmp_path / "both"
    shutil.copytree(sweep, target)
    go = tmp_path / "go"
    waiter = f"import os, time\nwhile not os.path.exists({str(go)!r}): time.sleep(0.05)"
    first = subprocess.Popen([sys.executable, str(SCRIPT), "--record", str(target), "--", sys.executable, "-c", waiter],
                             cwd=REPO, text=True, stderr=subprocess.PIPE)
    second = script("--record", str(target), "--", sys.executable, "-c", "print('second')")
    assert second.returncode == 0, second.stderr
    go.touch()
    assert first.wait(timeout=60) == 0, first.stderr.read()
    commands = json.loads((target / "provenance.json").read_text())["commands"]
    earlier = json.loads((sweep / "provenance.json").read_text())["commands"]
    assert commands == earlier + [shlex.join([sys.executable, "-c", "print('second')"]), shlex.join([sys.executable, "-c", waiter])]
