"""The suite's guard (conftest.py): every test, its module-scoped fixtures included, runs with HOME and
the caches in a temp dir, and a test that writes to $HOME or to the user's relpos cache fails."""

import os
import subprocess
import sys

import pytest

from conftest import REPO

# Tests run by an inner pytest that loads tests/conftest.py as a plugin: each writes where it must not,
# except the last, which shows the guard cleans up after a fault instead of failing every later test.
INNER = '''
import os
from pathlib import Path

import pytest

HOME = Path("~").expanduser()


@pytest.fixture(scope="module")
def cached_examples():
    """As the module-scoped fixtures that once ran before the sandbox: set up first, before any function fixture."""
    return Path(os.environ["RELPOS_CACHE"]), Path("~/.cache/relpos").expanduser()


def test_module_fixture_sees_the_sandbox(cached_examples):
    for path in cached_examples:
        assert not path.is_relative_to(os.environ["REAL_HOME"]), path


def test_writes_the_default_relpos_cache():
    (HOME / ".cache" / "relpos").mkdir(parents=True)


def test_writes_a_dotfile():
    (HOME / ".netrc").write_text("machine api.wandb.ai")


def test_writes_the_user_cache_by_its_absolute_path():
    Path(os.environ["REAL_CACHE"], "tasks").mkdir(parents=True)


def test_writes_only_its_tmp_path(tmp_path):
    (tmp_path / "f").write_text("x")
    assert not any(HOME.iterdir())
'''


# the suite runs over pytest-xdist workers (pyproject's addopts), which start inside their controller's sandbox.
# By whole files, as the suite is: spread one by one, the clean test could run while the other worker's
# test wrote the user's cache, and be blamed for it (seen on a loaded machine)
@pytest.mark.parametrize("workers", [[], ["-n", "2", "--dist", "loadfile"]], ids=["one process", "xdist workers"])
def test_a_test_writing_to_home_or_the_user_cache_fails_and_one_in_its_tmp_path_passes(tmp_path, workers):
    inner = tmp_path / "inner"
    inner.mkdir()
    (inner / "test_inner.py").write_text(INNER)
    (inner / "pytest.ini").write_text("[pytest]\n")
    real_home = tmp_path / "user_home"  # the inner run's "real" HOME; its relpos cache does not exist yet
    env = {k: v for k, v in os.environ.items() if k != "RELPOS_CACHE"}
    env.update(HOME=str(real_home), REAL_HOME=str(real_home), REAL_CACHE=str(real_home / ".cache" / "relpos"),
               COLUMNS="500",  # whole lines in the summary
               PYTHONPATH=os.pathsep.join([str(REPO / "tests"), str(REPO)]))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "-p", "conftest", *workers,
         "-c", str(inner / "pytest.ini"), "--rootdir", str(inner), "--basetemp", str(tmp_path / "basetemp"), str(inner)],
        cwd=inner, env=env, capture_output=True, text=True, timeout=300,
    )
    errors = {line.split()[1].split("::")[1]: line
              for line in proc.stdout.splitlines() if line.startswith(("ERROR", "FAILED"))}
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert sorted(errors) == ["test_writes_a_dotfile", "test_writes_the_default_relpos_cache",
                              "test_writes_the_user_cache_by_its_absolute_path"], proc.stdout
    assert f"wrote {real_home}" not in proc.stdout  # the faults name the inner sandbox's HOME, not the user's
    assert "/home/.cache under $HOME" in errors["test_writes_the_default_relpos_cache"]
    assert "/home/.netrc under $HOME" in errors["test_writes_a_dotfile"]
    assert f"changed the user's relpos cache {real_home / '.cache' / 'relpos'}" in errors[
        "test_writes_the_user_cache_by_its_absolute_path"]
    assert not (real_home / ".netrc").exists()
