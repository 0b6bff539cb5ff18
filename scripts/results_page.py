"""A results page generated from the runs that produced it, so a published table cannot drift.

    # run a measurement and record how it ran (commit, dirty tree, versions, machine, threads, times)
    python scripts/results_page.py --record /work/runs/all-schemes -- \
        relpos sweep +experiment=quick pos=none,rope,alibi seed=0 hydra.sweep.dir=/work/runs/all-schemes

    # the page: provenance + the tables of compare.md (and compare_accuracy.md) + the runs
    python scripts/results_page.py /work/runs/all-schemes --out docs/results/all-schemes.md \
        --title "All schemes, quick preset" --commentary docs/results/all-schemes.commentary.md \
        --readme README.md --readme-rows none,learned,sinusoidal,rope,alibi,t5

    # only the commentary section of a page made earlier (its runs may be gone), from the commentary file
    python scripts/results_page.py --commentary-only --out docs/results/all-schemes.md \
        --commentary docs/results/all-schemes.commentary.md

The sweep dir must hold `provenance.json` (written by --record) and the `compare.md` and/or
`compare_accuracy.md` that `relpos compare DIR` (or `relpos sweep`) wrote. The tables are copied
from those files as they are; the page refuses a compare.md older than a run's evaluation files
(run `relpos compare DIR --no-evaluate` again). The commentary file is the only hand-written part.
With --readme, the README's block between `<!-- results: NAME -->` and `<!-- /results: NAME -->`
(NAME = the sweep dir's name) is replaced by the chosen rows of the first table and a link to the page.

Bad input (no runs, no compare.md, a provenance.json missing a field) is one line, exit 2.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from filelock import FileLock  # noqa: E402
from relpos_cli.atomic import atomic_write_text  # noqa: E402  (light: no torch)

COMPARE_FILES = ("compare.md", "compare_accuracy.md")
EVAL_FILE = re.compile(r"^eval_(length|task)(\..+)?\.json$")
PROVENANCE_FIELDS = {  # field -> (type, what it is), checked when a page is made
    "commands": (list, "the command lines run, in order"),
    "commit": (str, "git rev-parse HEAD of the code that ran"),
    "dirty": (bool, "whether tracked files differed from that commit"),
    "relpos": (str, "relpos_cli.__version__"),
    "torch": (str, "torch's version"),
    "machine": (str, "CPU count and model (and GPU)"),
    "threads": (str, "OMP_NUM_THREADS, or 'torch default'"),
    "started": (str, "UTC start time"),
    "finished": (str, "UTC end time"),
    "exit_code": (int, "the command's exit status"),
}


class PageError(Exception):
    """Bad input, reported as one line `error: ...` with exit 2."""


# ---- recording a measurement ----------------------------------------------------------------------

def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown model"


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def host_provenance(repo: Path) -> dict:
    """What a measurement needs recorded about the code and the machine, before it runs."""
    from importlib.metadata import PackageNotFoundError, version

    import relpos_cli
    from relpos_cli.logs import git_state

    try:
        torch_version = version("torch")  # without importing torch
    except PackageNotFoundError:
        torch_version = "not installed"
    state = git_state(repo)
    if state is None:
        raise PageError(f"{repo} is not a git checkout (git rev-parse HEAD, git status failed)")
    return {
        "commit": state[0],
        "dirty": state[1],
        "relpos": relpos_cli.__version__,
        "torch": torch_version,
        "machine": f"{os.cpu_count()}-core CPU ({_cpu_model()})",
        "threads": os.environ.get("OMP_NUM_THREADS", "torch default"),
    }


def record(out_dir: Path, command: list[str], repo: Path) -> int:
    """Run `command`, then write out_dir/provenance.json; returns the command's exit status.

    An existing provenance.json (an earlier command into the same dir) gains this command, if the
    code is the same commit and state; otherwise nothing runs. Two measurements may record into one
    dir at once: the file is read again and written under a lock when each command ends, so
    neither overwrites the other's entry."""
    if not command:
        raise PageError("--record DIR -- COMMAND...: give the command after --")
    if out_dir.exists() and not out_dir.is_dir():
        raise PageError(f"--record {out_dir} is a file; give a directory")
    host = host_provenance(repo)
    path = out_dir / "provenance.json"
    _check_same_code(path, host)
    started = _now()
    try:
        code = subprocess.run(command).returncode
    except FileNotFoundError:
        raise PageError(f"{command[0]}: command not found") from None
    except KeyboardInterrupt:  # the command got the Ctrl-C too; record that it was stopped
        code = 130
    # quoted as a shell reads it back: an argument with a space (`--paired-with "type=yarn, seq_len=256"`)
    # stays one argument when the page's command is pasted into a shell
    entry = {"commands": [shlex.join(command)], **host, "started": started, "finished": _now(), "exit_code": code}
    out_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(out_dir / ".provenance.lock"):  # the library relpos locks its run dirs with
        previous = _check_same_code(path, host)
        if previous:
            # each command's own thread setting: one field for the whole dir said only the last one's
            threads = previous.get("threads_by_command") or [previous["threads"]] * len(previous["commands"])
            threads = threads + [host["threads"]]
            entry.update(commands=previous["commands"] + entry["commands"],
                         started=min(previous["started"], started), finished=max(previous["finished"], entry["finished"]),
                         exit_code=previous["exit_code"] or code, threads=threads_summary(threads),
                         threads_by_command=threads)
        atomic_write_text(path, json.dumps(entry, indent=2) + "\n")
    return code


def threads_summary(threads: list[str]) -> str:
    """`1`, or where the commands differ `1 (commands 1-3), torch default (command 4)`."""
    if len(set(threads)) == 1:
        return threads[0]
    runs: list[list] = []  # [setting, first command, last command], consecutive commands alike merged
    for i, t in enumerate(threads, 1):
        if runs and runs[-1][0] == t:
            runs[-1][2] = i
        else:
            runs.append([t, i, i])
    return ", ".join(f"{t} (command {a})" if a == b else f"{t} (commands {a}-{b})" for t, a, b in runs)


def _check_same_code(path: Path, host: dict) -> dict | None:
    """The provenance already at `path` (None if none), refused if another commit or state wrote it."""
    if not path.exists():
        return None
    previous = read_provenance(path.parent)
    if (previous["commit"], previous["dirty"]) != (host["commit"], host["dirty"]):
        raise PageError(f"{path} was recorded at commit {previous['commit'][:12]} (dirty: {previous['dirty']}); "
                        f"this code is {host['commit'][:12]} (dirty: {host['dirty']}): record into another dir")
    return previous


# ---- reading a sweep dir ----------------------------------------------------------------------------

def read_provenance(sweep: Path) -> dict:
    path = sweep / "provenance.json"
    if not path.is_file():
        raise PageError(f"{path} not found: record the measurement with "
                        f"`python scripts/results_page.py --record {sweep} -- COMMAND...`")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PageError(f"{path} is not readable JSON ({e})") from None
    if not isinstance(data, dict):
        raise PageError(f"{path} holds {type(data).__name__}, not an object")
    for field, (kind, meaning) in PROVENANCE_FIELDS.items():
        value = data.get(field)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise PageError(f"{path}: {field!r} must be a {kind.__name__} ({meaning}); found {value!r}")
    if not data["commands"] or not all(isinstance(c, str) and c for c in data["commands"]):
        raise PageError(f"{path}: 'commands' must list at least one command line")
    if not re.fullmatch(r"[0-9a-f]{40}", data["commit"]):
        raise PageError(f"{path}: 'commit' must be 40 hex digits; found {data['commit']!r}")
    return data


def find_runs(sweep: Path) -> list[Path]:
    """Run dirs under the sweep dir: those holding a config.yaml or a failed.json."""
    runs = {p.parent for name in ("config.yaml", "failed.json") for p in sweep.rglob(name)
            if not {".hydra", "wandb"} & set(p.relative_to(sweep).parts[:-1])}
    return sorted(runs, key=lambda p: (len(p.parts), _natural(p.name)))


def _natural(name: str) -> tuple:
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name))


def run_summary(run: Path) -> dict:
    """One row of the runs table, from the run's own files."""
    steps = val_loss = None
    metrics = run / "metrics.jsonl"
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            steps = row.get("step", steps)
            val_loss = row.get("val_loss", val_loss)
    if (run / "failed.json").is_file():
        try:
            failure = json.loads((run / "failed.json").read_text()).get("error", "failed")
        except (OSError, json.JSONDecodeError):
            failure = "failed (failed.json unreadable)"
        status = "failed: " + " ".join(str(failure).split())[:120]
    elif (run / "checkpoint.pt").is_file():
        status = "finished"
    else:
        status = "unfinished"
    evaluations = sorted(p.name for p in run.iterdir() if EVAL_FILE.match(p.name))
    return {"run": run.name, "status": status, "steps": steps, "val_loss": val_loss, "evaluations": evaluations}


def compare_files(sweep: Path, runs: list[Path]) -> list[Path]:
    """The sweep's compare markdown files, each checked to be newer than every run's evaluation."""
    found = [sweep / name for name in COMPARE_FILES if (sweep / name).is_file()]
    if not found:
        raise PageError(f"no {' or '.join(COMPARE_FILES)} in {sweep}: run `relpos compare {sweep} --no-evaluate` first")
    for page in found:
        written = page.stat().st_mtime
        for run in runs:
            for p in run.iterdir():
                if EVAL_FILE.match(p.name) and p.stat().st_mtime > written:
                    raise PageError(f"{page} is older than {p}: run `relpos compare {sweep} --no-evaluate` "
                                    f"(add --metric accuracy for compare_accuracy.md) again")
    return found


def markdown_tables(text: str) -> list[list[str]]:
    """The markdown tables of a compare file: runs of lines starting with '|', header first."""
    tables, current = [], []
    for line in text.splitlines():
        if line.startswith("|"):
            current.append(line)
        elif current:
            tables.append(current)
            current = []
    if current:
        tables.append(current)
    return [t for t in tables if len(t) >= 2]


def first_cell(row: str) -> str:
    return row.strip("|").split("|")[0].strip().strip("*").strip()


# ---- writing --------------------------------------------------------------------------------------

def _fmt(value) -> str:
    return "" if value is None else f"{value:.4f}" if isinstance(value, float) else str(value)


def page_text(sweep: Path, title: str, commentary: Path | None) -> str:
    # one spelling of the dir, however it was given (`.`, relative, absolute): the page states it and
    # its name, and a page regenerated from another working dir must be the same bytes
    sweep = Path(os.path.abspath(sweep))
    prov = read_provenance(sweep)
    runs = find_runs(sweep)
    if not runs:
        raise PageError(f"no runs under {sweep} (no run dir with a config.yaml or failed.json)")
    sources = compare_files(sweep, runs)
    state = "a dirty tree (tracked files differed from the commit)" if prov["dirty"] else "a clean tree"
    lines = [
        f"# {title}",
        "",
        f"<!-- Generated by scripts/results_page.py from {sweep}; edit the commentary file, not this page. -->",
        "",
        "Generated from the runs themselves by `scripts/results_page.py`: the tables below are the",
        "sweep's own `compare` files, copied as written. Regenerate rather than edit.",
        "",
        "| | |",
        "|---|---|",
        *(f"| command | `{c}` |" for c in prov["commands"]),
        f"| commit | `{prov['commit']}`, {state} |",
        f"| relpos / torch | {prov['relpos']} / {prov['torch']} |",
        f"| machine | {prov['machine']} |",
        f"| threads | {prov['threads']} |",
        f"| started / finished (UTC) | {prov['started']} / {prov['finished']} |",
        f"| exit code | {prov['exit_code']}{' (some runs failed: see Runs)' if prov['exit_code'] else ''} |",
        f"| runs | {len(runs)} under `{sweep.name}/` |",
    ]
    for source in sources:
        text = source.read_text()
        heading = text.splitlines()[0].strip() if text.strip() else source.name
        lines += ["", f"## {heading}", "", f"From `{source.name}`, as written:", ""]
        lines += "\n".join(text.splitlines()[1:]).strip("\n").splitlines()  # the body, between blank lines
    lines += ["", "## Runs", "", "| run | status | steps | final val_loss | evaluation files |", "|---|---|---:|---:|---|"]
    for s in map(run_summary, runs):
        lines.append(f"| `{s['run']}` | {s['status']} | {_fmt(s['steps'])} | {_fmt(s['val_loss'])} | "
                     f"{', '.join(f'`{e}`' for e in s['evaluations'])} |")
    if commentary is not None:
        lines += ["", COMMENTARY_HEADING, "", commentary_text(commentary)]
    return "\n".join(lines) + "\n"


COMMENTARY_HEADING = "## Commentary (hand-written)"  # the page's last section: the commentary file, verbatim


def commentary_text(commentary: Path) -> str:
    if not commentary.is_file():
        raise PageError(f"--commentary {commentary} not found")
    return commentary.read_text().rstrip()


def with_commentary(page: Path, commentary: Path) -> str:
    """A generated page with its commentary section replaced by the commentary file: for a page whose
    runs are gone, the rest (tables, provenance) left exactly as they were generated."""
    text = page.read_text() if page.is_file() else ""
    if "<!-- Generated by scripts/results_page.py" not in text:
        raise PageError(f"--commentary-only: {page} is not a page this script generated")
    head, heading, _ = text.partition(f"\n{COMMENTARY_HEADING}\n")
    if not heading:
        raise PageError(f"--commentary-only: {page} has no {COMMENTARY_HEADING!r} section to replace")
    return f"{head}\n{COMMENTARY_HEADING}\n\n{commentary_text(commentary)}\n"


def readme_block(sweep: Path, rows: list[str], page: Path, readme: Path) -> str:
    """The chosen rows of the sweep's first compare table, with where they come from."""
    prov = read_provenance(sweep)
    source = compare_files(sweep, find_runs(sweep))[0]
    tables = markdown_tables(source.read_text())
    if not tables:
        raise PageError(f"{source} holds no markdown table")
    header, rule, *body = tables[0]
    by_label = {first_cell(r): r for r in body}
    missing = [r for r in rows if r not in by_label]
    if missing:
        raise PageError(f"--readme-rows {','.join(missing)}: not a row of {source}; its rows: {', '.join(by_label)}")
    link = os.path.relpath(page, readme.parent)
    dirty = ", dirty tree" if prov["dirty"] else ""
    commands = prov["commands"]
    # a dir filled by several commands: name none of them alone, or the rows of the others look like its output
    made_by = f"`{commands[0]}`" if len(commands) == 1 else f"{len(commands)} commands into one dir (listed on the page)"
    return "\n".join([
        header, rule, *(by_label[r] for r in rows or by_label), "",
        f"{made_by} at commit `{prov['commit'][:7]}`{dirty}, {prov['machine']}, threads: "
        f"{prov['threads']}, finished {prov['finished']}. Every row, the runs and what they can and cannot "
        f"show: [{link}]({link}).",
    ])


def replaced_readme(readme: Path, name: str, block: str) -> str:
    """The README's text with its NAME block replaced (nothing written yet)."""
    if not readme.is_file():
        raise PageError(f"--readme {readme} not found")
    text = readme.read_text()
    start, end = f"<!-- results: {name} -->", f"<!-- /results: {name} -->"
    if text.count(start) != 1 or text.count(end) != 1 or text.index(start) > text.index(end):
        raise PageError(f"{readme} needs one '{start}' line and one '{end}' line after it")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{start}\n{block}\n{end}{tail}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sweep", nargs="?", type=Path, help="the sweep/compare dir to make a page of")
    parser.add_argument("--out", type=Path, help="the markdown page to write")
    parser.add_argument("--title", help="the page's title (default: Results: <dir name>)")
    parser.add_argument("--commentary", type=Path, help="a hand-written markdown file included verbatim")
    parser.add_argument("--readme", type=Path, help="also refresh this README's <!-- results: NAME --> block")
    parser.add_argument("--readme-rows", default="", help="comma-separated first-column labels for --readme (default: all)")
    parser.add_argument("--record", type=Path, metavar="DIR", help="run the command after -- and write DIR/provenance.json")
    parser.add_argument("--commentary-only", action="store_true",
                        help="replace only the commentary section of the generated page --out (no sweep dir: its runs may be gone)")
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[1],
                        help="the git checkout whose commit --record states (default: this script's)")
    command: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, command = argv[:cut], argv[cut + 1:]
    args = parser.parse_args(argv)
    try:
        if args.record is not None:
            if args.sweep or args.out:
                raise PageError("--record DIR -- COMMAND... takes no sweep dir or --out; make the page afterwards")
            return record(args.record, command, args.repo)
        if command:
            raise PageError("a command after -- needs --record DIR")
        if args.commentary_only:
            if args.sweep or args.readme or args.out is None or args.commentary is None:
                raise PageError("--commentary-only takes --out PAGE.md and --commentary FILE, and no sweep dir or --readme")
            atomic_write_text(args.out, with_commentary(args.out, args.commentary))
            print(f"wrote the commentary of {args.out}")
            return 0
        if args.sweep is None or args.out is None:
            raise PageError("give a sweep dir and --out PAGE.md (or --record DIR -- COMMAND...)")
        if not args.sweep.is_dir():
            raise PageError(f"{args.sweep} is not a directory")
        if args.out.is_dir():
            raise PageError(f"--out {args.out} is a directory; give the page's file name")
        text = page_text(args.sweep, args.title or f"Results: {args.sweep.name}", args.commentary)
        name, readme_text = Path(os.path.abspath(args.sweep)).name, None
        if args.readme is not None:  # everything is checked before anything is written
            rows = [r.strip() for r in args.readme_rows.split(",") if r.strip()]
            readme_text = replaced_readme(args.readme, name, readme_block(args.sweep, rows, args.out, args.readme))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(args.out, text)
        if readme_text is not None:
            atomic_write_text(args.readme, readme_text)
        print(f"wrote {args.out}" + (f" and the {name} block of {args.readme}" if readme_text else ""))
        return 0
    except PageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {e.filename or ''}: {e.strerror}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
