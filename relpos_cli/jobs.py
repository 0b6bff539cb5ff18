"""What each `relpos` command does once its arguments are parsed (relpos_cli/cli.py declares them).

Training and inspecting a fresh scheme run as Hydra jobs (run_hydra_job); a sweep's jobs train and
then evaluate their run where they run (sweep_job), one failed job is recorded (failed.json) and the
sweep goes on, each job's problem reaches the sweep from whatever process ran it (JobProblem), Ctrl-C
names the jobs that never ran, and a job that submitit requeued resumes (requeue.py). Commands over
run dirs (eval-length, eval-task, inspect RUN) take each run in turn (each_run). Imports of torch,
Hydra and the commands' modules are inside the functions: `relpos --help` and shell completion never
pay for them.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import uuid
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Optional

from relpos_cli.console import as_relpos_error, clear_errors, err_console, plain_console, print_error
from relpos_cli.errors import Interrupted, RelposError, RunDirTaken
from relpos_cli.interrupt import stop_on_signals

if TYPE_CHECKING:
    from relpos_cli.distributed import Ranks


def hydra_error_line(e: Exception) -> str:
    """Hydra's multi-line composition errors as one line that says what to change."""
    from hydra.errors import MissingConfigException

    from relpos_cli.config import bad_override

    lines = [l.strip() for l in str(e).splitlines() if l.strip()]
    first = lines[0] if lines else type(e).__name__
    if isinstance(e, MissingConfigException) and e.options and e.missing_cfg_file:
        group, _, wanted = e.missing_cfg_file.rpartition("/")
        return f"unknown {group} {wanted!r}; choose one of: {', '.join(e.options)}"
    if first.startswith("Could not override '"):
        key = first.split("'")[1]
        return f"unknown config key {key!r} (to add a new key, prefix it with +: +{key}=...)"
    if first.startswith("Key '") and first.endswith("is not in struct"):
        return f"config key {first.split(chr(39))[1]!r} is missing (deleted with ~?); it is needed"
    if first.startswith("Could not append to config. An item is already at"):
        return f"{first.rstrip('.')} (set it without the +)"
    if "override_grammar" in str(e) or type(e).__name__ == "OverrideParseException":
        return bad_override(e)
    return " ".join(l for l in lines[:2] if "full_key" not in l and "object_type" not in l)


# The overrides of the sweep running now (in-process launchers): Ctrl-C names the jobs that never ran.
SWEEP_OVERRIDES: list[str] = []


def name_jobs_not_run(e: BaseException, job: int, sweeper_params) -> RelposError:
    """Ctrl-C in job `job` of a sweep: the job's own message (where its checkpoint is) plus the jobs
    that never ran, so they can be run again."""
    from relpos_cli.config import sweep_jobs

    message = str(e) if isinstance(e, RelposError) else "interrupted"
    try:
        jobs = sweep_jobs(SWEEP_OVERRIDES, sweeper_params)
    except Exception:  # naming them is a courtesy: the interruption is the message
        jobs = []
    after = [f"#{n} {overrides}" for n, overrides in enumerate(jobs) if n > job]
    if after:
        message += f"; the sweep stopped at job #{job}, these {len(after)} never ran: {'; '.join(after)}"
    return Interrupted(message, getattr(e, "exit_code", 130) - 128)


REFUSED, FAILED, NOT_EVALUATED = "refused", "failed", "not evaluated"


@dataclass(frozen=True)
class JobProblem:
    """A sweep job that did not finish its work: refused its run dir (RunDirTaken: the dir is left as
    it was, no failed.json), failed (failed.json, where it could be written), or trained but not
    evaluated. The job writes it into the sweep dir (JOB_PROBLEMS), the one place that the processes
    of every launcher (this one, joblib's workers, SLURM nodes) share; the sweep reads it back."""

    run_dir: str
    kind: str
    error: str


JOB_PROBLEMS = ".relpos-job-problems."  # + a name of the sweep's own: two sweeps may share a sweep dir


def run_hydra_job(task: Callable, overrides: list[str], multirun: bool, cfg: Optional[str],
                  sweep_dir: Optional[Path] = None) -> list[JobProblem]:
    """Run `task(cfg)` as a Hydra app over conf/, with the shell's overrides. In a sweep (into
    sweep_dir, the caller's resolve_sweep_dir; by default resolved here), task returns its JobProblem
    or None; the problems of this sweep's own jobs are returned, in job order."""
    import hydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from relpos_cli.config import check_group_overrides, conf_dir, resolve_sweep_dir
    from relpos_cli.sweep_signals import workers_stop_with_the_sweep

    SWEEP_OVERRIDES[:] = overrides
    with clear_errors():
        if multirun and cfg:
            raise RelposError("--cfg prints one composed config: drop -m (and give single values)")
        check_group_overrides(overrides)
        problems_dir = None
        if multirun:  # the sweep dir resolved once (${now:}), for the jobs and for this process alike
            sweep_dir = sweep_dir or resolve_sweep_dir(overrides)
            quote = '"' if "'" in str(sweep_dir) else "'"  # a comma in a path would be a sweep over it
            overrides = [*overrides, f"hydra.sweep.dir={quote}{sweep_dir}{quote}"]
            problems_dir = sweep_dir.absolute() / f"{JOB_PROBLEMS}{uuid.uuid4().hex}"  # a worker's cwd may differ
            task = functools.partial(recording_problems, task, problems_dir)
        sys.argv = [sys.argv[0], *overrides, *(["--multirun"] if multirun else []), *(["--cfg", cfg] if cfg else [])]
        os.environ.setdefault("HYDRA_FULL_ERROR", "1")  # Hydra raises instead of printing a multi-line report
        try:
            with workers_stop_with_the_sweep() if multirun else nullcontext():
                hydra.main(config_path=str(conf_dir()), config_name="config", version_base="1.3")(task)()
        except (HydraException, OmegaConfBaseException) as e:
            raise RelposError(hydra_error_line(e)) from None
        finally:
            problems = read_problems(problems_dir) if problems_dir else []
    return problems


def recording_problems(task: Callable, problems_dir: Path, cfg) -> None:
    """A sweep's job: task(cfg), its problem (if any) written for the sweep to read (read_problems)."""
    from hydra.core.hydra_config import HydraConfig

    from relpos_cli.atomic import atomic_write_text

    problem = task(cfg)
    if problem is not None:
        problems_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(problems_dir / f"{HydraConfig.get().job.num}.json", json.dumps(asdict(problem)))


def read_problems(problems_dir: Path) -> list[JobProblem]:
    """The problems the sweep's jobs wrote, in job order; the folder is then removed."""
    import shutil

    files = sorted(problems_dir.glob("*.json"), key=lambda f: int(f.stem)) if problems_dir.is_dir() else []
    problems = [JobProblem(**json.loads(f.read_text())) for f in files]
    shutil.rmtree(problems_dir, ignore_errors=True)
    return problems


def exit_if_failed(problems: list[JobProblem]) -> None:
    """What went wrong in this sweep's own jobs, one kind at a time, each job's run dir on a line of
    its own; exit 1 if anything did."""
    from relpos_cli.results import FAILED_FILE

    def listed(header: str, lines: list[str]) -> None:
        if lines:
            print_error("\n  ".join([f"{len(lines)} sweep job(s) {header}:", *lines]))

    failed = [p for p in problems if p.kind == FAILED]
    recorded = [p.run_dir for p in failed if (Path(p.run_dir) / FAILED_FILE).is_file()]
    # RunDirTaken's line names the dir
    listed("refused, their run dirs left as they were", [p.error for p in problems if p.kind == REFUSED])
    listed(f"failed (see {FAILED_FILE} in each)", recorded)
    listed("failed", [f"{p.run_dir}: {p.error}" for p in failed if p.run_dir not in recorded])  # no failed.json written
    listed("trained, but their evaluation failed (relpos eval-length or eval-task RUN evaluates them again)",
           [f"{p.run_dir}: {p.error}" for p in problems if p.kind == NOT_EVALUATED])
    if problems:
        raise SystemExit(1)


def train_job(cfg, evaluate: bool = False) -> Optional[JobProblem]:
    """One Hydra job: train (then, for `relpos sweep`, evaluate on the same allocation). Outside a
    sweep a failure is raised; in a sweep it is printed and returned, and the next job runs.

    In a sweep the job's W&B group is the sweep dir; a job that submitit requeued before its time
    limit (requeue.py) resumes its run dir, or goes on to the evaluation if training had finished."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf.errors import OmegaConfBaseException

    from relpos_cli.checkpoint import holds_training_state, mark_failed
    from relpos_cli.requeue import requeue_on_preemption, was_requeued
    from relpos_cli.results import CHECKPOINT_FILE
    from relpos_cli.rundir import point_latest_at
    from relpos_cli.sweep_signals import in_worker_process, interrupted_worker_exits
    from relpos_cli.train import train as run_training

    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    sweeping = hydra_cfg.mode == RunMode.MULTIRUN
    if sweeping and cfg.wandb.group is None:
        cfg.wandb.group = str(hydra_cfg.sweep.dir)
    problem = None
    with clear_errors(), interrupted_worker_exits(), requeue_on_preemption(run_dir):
        try:
            requeued = was_requeued(run_dir)
            if requeued and (run_dir / CHECKPOINT_FILE).is_file():
                plain_console().print(f"{run_dir}: trained before the job was requeued", soft_wrap=True)
            else:
                # outputs/latest: the sweep, or this run from its first step (rank 0 under torchrun)
                latest = Path(hydra_cfg.sweep.dir) if sweeping else run_dir
                # requeued before its first checkpoint (while loading data): nothing to resume, so the
                # job starts the run as it first did (init_from's inheritance, the data's record)
                run_training(cfg, run_dir, resume=requeued and holds_training_state(run_dir), latest=latest)
        except (Interrupted, KeyboardInterrupt) as e:  # Ctrl-C stops the whole sweep (SystemExit passes Hydra)
            if sweeping and not in_worker_process():  # jobs one after another: name those not run
                raise name_jobs_not_run(e, hydra_cfg.job.num, hydra_cfg.sweeper.params) from None
            raise
        except Exception as e:
            if isinstance(e, OmegaConfBaseException):  # a key the run needs was deleted or mistyped
                e = RelposError(hydra_error_line(e))
            e = as_relpos_error(e)
            if not isinstance(e, RunDirTaken):  # a dir refused (in use, another run, not relpos's) is left as it was
                mark_failed(run_dir, e, list(hydra_cfg.overrides.task))
            if not sweeping:
                raise e from None
            # one failed job must not stop the sweep: it is recorded, the next one runs
            if not isinstance(e, RelposError):  # a bug: keep its traceback in the job's relpos.log
                from relpos_cli.logs import run_log

                with run_log(run_dir) as log:
                    log.error("job failed", exc_info=e)
            line = str(e).splitlines()[0] if str(e) else type(e).__name__
            refused = isinstance(e, RunDirTaken)  # its line names the dir
            problem = JobProblem(str(run_dir), REFUSED if refused else FAILED, line)
            print_error(line if refused else f"{run_dir}: {line}")
            evaluate = False
        if evaluate:
            try:
                evaluate_in_job(run_dir)
            except RelposError as e:  # the trained run stays valid (no failed.json): eval-length can redo this
                problem = JobProblem(str(run_dir), NOT_EVALUATED, str(e).splitlines()[0])
                print_error(f"{run_dir}: evaluation: {e}")
    if sweeping:  # also after a failed job, or one requeued after it trained (a run points it as it trains)
        point_latest_at(Path(hydra_cfg.sweep.dir))
    return problem


def sweep_job(cfg) -> Optional[JobProblem]:
    """A job of `relpos sweep`: it trains and evaluates on its own allocation (a SLURM node's GPU);
    only the comparison runs on the submitting host."""
    return train_job(cfg, evaluate=True)


def evaluate_in_job(run_dir: Path) -> None:
    """Right after training, with the run's own settings: eval-length for a run that models language,
    eval-task for a run trained on a task (a run mixing both gets both)."""
    from relpos_cli.checkpoint import load_config
    from relpos_cli.eval_task import evaluate_task_and_report
    from relpos_cli.report import evaluate_and_report
    from relpos_cli.tasks import models_language, trains_on_task

    task = load_config(run_dir).get("task") or {}  # saved before tasks existed: language modelling
    if models_language(task):
        evaluate_and_report(run_dir, [], plain_console())
    if trains_on_task(task):
        evaluate_task_and_report(run_dir, [], plain_console())


def launched_by_torchrun() -> bool:
    """torchrun's environment, read without importing torch: most commands never need it."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


@contextmanager
def under_torchrun() -> Iterator[Optional[Ranks]]:
    """The process group of a torchrun launch (None for a plain process), left cleanly at the end."""
    if not launched_by_torchrun():
        yield None
        return
    from relpos_cli import distributed

    with clear_errors():
        ranks = distributed.setup()
    err_console.quiet = not ranks.is_main  # every rank meets the same errors: one says so
    finished = False
    try:
        yield ranks
        finished = True
    finally:
        with clear_errors():  # a rank that finds another gone at the end: one line, not gloo's traceback
            distributed.teardown(finished)


def each_run(runs: list[Path], work: Callable[[Path], object]) -> None:
    """work(run) for every run; one broken run of a sweep does not stop the others (one line each,
    then one error counting them)."""
    failed = []
    for run_dir in runs:
        try:
            work(run_dir)
        except (RelposError, OSError, UnicodeDecodeError) as e:
            if len(runs) == 1 or isinstance(e, Interrupted):  # Ctrl-C or kill stops them all
                raise
            print_error(f"{run_dir}: {as_relpos_error(e)}")
            failed.append(run_dir)
    if failed:
        raise RelposError(f"{len(failed)} of {len(runs)} runs could not be evaluated (see above)")


def use_huge_pages() -> None:
    """Large CPU tensors in 2 MiB pages for relpos's own commands (a library import leaves the host's
    allocator alone): torch's switch, read at its first allocation, so set here, before anything
    imports torch; sweep workers inherit it. Long evaluation builds a (block x L) bias per query block;
    faulting 16 MiB in 4 KiB pages took 14 ms against 4 ms in 2 MiB ones, and FIRE's evaluation at
    L = 16384 took 18.8 s without and 17.4 s with (README, Speed). A value set by the user wins."""
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


def train_command(overrides: list[str], multirun: bool, cfg: Optional[str]) -> None:
    """`relpos train`: resume=RUN_DIR, or one run (under torchrun: every rank in rank 0's run dir),
    or a -m sweep of runs."""
    from relpos_cli.config import quote_path_overrides, resolve_sweep_dir
    from relpos_cli.rundir import check_latest_is_a_link, check_sweep_dir, torchrun_overrides

    resumes = [a for a in overrides if a.startswith("resume=")]
    with under_torchrun() as ranks:
        if resumes and not cfg:
            with clear_errors():
                from relpos_cli.train import resume

                if multirun or len(overrides) != 1:
                    raise RelposError("resume=RUN_DIR takes no other overrides and no -m: the run keeps its saved config")
                if ranks is None or ranks.is_main:
                    check_latest_is_a_link()  # the resumed run points outputs/latest as it trains
                resume(Path(resumes[0].split("=", 1)[1]))
            return
        with clear_errors():
            if ranks is not None:
                from relpos_cli.distributed import broadcast_from_main

                overrides = torchrun_overrides(overrides, multirun, ranks.is_main, broadcast_from_main)
            from relpos_cli.lineage import with_parent_scheme

            overrides = with_parent_scheme(overrides)  # init_from=RUN pos.keep=0.5: the parent's scheme's keys
            sweep_dir = None
            if not cfg and (ranks is None or ranks.is_main):
                check_latest_is_a_link()
                if multirun:
                    sweep_dir = resolve_sweep_dir(overrides)
                    check_sweep_dir(sweep_dir)
        exit_if_failed(run_hydra_job(train_job, quote_path_overrides(overrides), multirun, cfg, sweep_dir))


def sweep_command(overrides: list[str], evaluate: bool) -> None:
    """`relpos sweep`: train (and evaluate) every job, then compare the sweep; exit 1 if a job failed."""
    from relpos_cli.compare import compare_sweep
    from relpos_cli.config import resolve_sweep_dir
    from relpos_cli.rundir import check_latest_is_a_link, check_sweep_dir, point_latest_at

    with clear_errors():
        check_latest_is_a_link()
        sweep_dir = resolve_sweep_dir(overrides)
        check_sweep_dir(sweep_dir)
    job = sweep_job if evaluate else train_job
    problems = run_hydra_job(job, overrides, True, None, sweep_dir)
    point_latest_at(sweep_dir)
    if evaluate:
        with clear_errors():
            # every job evaluated its run where it trained: here the results are only gathered (and
            # the runs of earlier sweeps into this dir compared too; only this sweep's jobs can fail it)
            compare_sweep(sweep_dir, plain_console())
    exit_if_failed(problems)


def evaluate_command(args: list[str], command: str, replace: bool) -> None:
    """`relpos eval-length` and `relpos eval-task` (command): each run dir named (or found under a
    sweep dir) evaluated with the overrides."""
    from relpos_cli.runs import split_runs_and_overrides

    if command == "eval-task":
        from relpos_cli.eval_task import evaluate_task_and_report as evaluate_and_report
    else:
        from relpos_cli.report import evaluate_and_report

    console = plain_console()
    with clear_errors(), stop_on_signals():  # kill / a closed terminal mid-write: one line, no temp file left
        runs, overrides = split_runs_and_overrides(args)
        each_run(runs, lambda run_dir: evaluate_and_report(run_dir, overrides, console, replace))


def compare_command(args: list[str], out: Optional[Path], evaluate: bool, metric: str, paired_with: Optional[str] = None) -> None:
    from relpos_cli.compare import run_compare
    from relpos_cli.runs import split_runs_and_overrides

    with clear_errors(), stop_on_signals():
        _, overrides = split_runs_and_overrides(args)
        paths = [Path(a) for a in args if a not in overrides]
        run_compare(paths, overrides, out or paths[0], evaluate, metric, plain_console(), paired_with)


def schemes_command(model: str) -> None:
    from relpos_cli.tables import schemes_table

    with clear_errors():
        plain_console().print(schemes_table(model))


def inspect_command(args: list[str]) -> None:
    """`relpos inspect key=value...` (a fresh scheme, as a Hydra job) or `relpos inspect RUN_DIR...`."""
    if all("=" in a and not Path(a).exists() for a in args):  # no run dir named: a fresh scheme
        from relpos_cli.inspect import inspect_job

        with stop_on_signals():  # a signal mid-write: one line, no temp file (as for a run dir below)
            run_hydra_job(inspect_job, args, False, None)
        return
    from relpos_cli.inspect import inspect_runs
    from relpos_cli.runs import split_runs_and_overrides

    with clear_errors(), stop_on_signals():
        inspect_runs(*split_runs_and_overrides(args))


def sample_command(run_dir: Path, prompt: str, max_new_tokens: int, temperature: float, top_k: int, seed: int,
                   context: Optional[int], device: str, overrides: list[str]) -> None:
    """`relpos sample`: the prompt, then the new text as it comes."""
    from relpos_cli.sample import sample_run

    with clear_errors(), stop_on_signals():
        pieces = sample_run(run_dir, prompt, max_new_tokens, temperature, top_k, seed, context, device, overrides)
        out = plain_console(soft_wrap=True)
        first = next(pieces, "")  # errors (bad run dir or options) come before the prompt is printed
        out.print(prompt, style="dim", end="")
        out.print(first, end="")
        for piece in pieces:
            out.print(piece, end="")
        out.print()


def import_command(args: list[str]) -> None:
    """`relpos import SOURCE OUT_DIR [key=value ...]`."""
    from relpos_cli.importing import import_checkpoint

    console = plain_console()
    with clear_errors():
        if len(args) < 2 or any("=" in a and not Path(a).exists() for a in args[:2]):
            raise RelposError("usage: relpos import SOURCE OUT_DIR [key=value ...]")
        run_dir = import_checkpoint(args[0], Path(args[1]), args[2:], announce=lambda text: console.print(text, style="dim"))
        console.print(f"run dir: {run_dir}")
