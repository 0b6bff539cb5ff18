"""The `relpos` command line: Typer commands that dispatch Hydra-configured jobs.

Arguments of the form key=value are Hydra overrides; `-m` runs a Hydra multirun sweep.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Optional

import typer
from typer.core import TyperCommand

from relpos_cli import __version__
from relpos_cli.compile_cache import use_relpos_compile_cache
from relpos_cli.console import describe_decode_error, describe_os_error, err_console, plain_console, print_error
from relpos_cli.errors import Interrupted, RelposError

if TYPE_CHECKING:
    from relpos_cli.distributed import Ranks

app = typer.Typer(
    help="Train causal Transformers with any position scheme and measure perplexity across lengths.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)
OVERRIDES = {"allow_extra_args": True, "ignore_unknown_options": True}


def as_relpos_error(e: BaseException) -> BaseException:
    """Faults of the environment (a full disk, a read-only dir, a file that is not UTF-8) as the one
    line that names the path and what to do; other exceptions as they are."""
    if isinstance(e, OSError):
        return RelposError(describe_os_error(e))
    if isinstance(e, UnicodeDecodeError):
        return RelposError(describe_decode_error(e))
    return e


def _print_version(value: bool) -> None:
    if value:
        print(f"relpos {__version__}")
        raise typer.Exit()


@app.callback()
def _options(
    version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True, help="Print the version and exit."),
) -> None:
    """Train causal Transformers with any position scheme and measure perplexity across lengths."""


def _complete_override(ctx: typer.Context, incomplete: str) -> list[str]:
    from relpos_cli.completion import complete_override

    return complete_override([*(ctx.params.get("overrides") or []), *ctx.args], incomplete)


# key=value words of train and sweep: Hydra overrides, completed from conf/ (pos=<TAB>)
OVERRIDE_ARGS = typer.Argument(None, metavar="[KEY=VALUE]...", show_default=False, autocompletion=_complete_override,
                               help="Hydra overrides: a config group's option (pos=alibi) or a key (train.steps=200).")


class WithConfigGroups(TyperCommand):
    """--help ends with the config groups and their options, read from conf/ when asked for."""

    def format_help(self, ctx, formatter) -> None:
        from relpos_cli.completion import groups_help

        self.epilog = groups_help()
        super().format_help(ctx, formatter)



@contextmanager
def clear_errors() -> Iterator[None]:
    """RelposError, OSError, UnicodeDecodeError -> one line on stderr and exit 2, no traceback;
    Ctrl-C -> exit 130."""
    from relpos_cli.interrupt import leave

    try:
        yield
    except RelposError as e:
        print_error(str(e))
        leave(e.exit_code)
    except (OSError, UnicodeDecodeError) as e:
        print_error(str(as_relpos_error(e)))
        leave(2)
    except KeyboardInterrupt:
        print_error("interrupted")
        leave(130)


def hydra_error_line(e: Exception) -> str:
    """Hydra's multi-line composition errors as one line that says what to change."""
    from hydra.errors import MissingConfigException

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
        first = first.replace("LexerNoViableAltException: ", "cannot parse ")
        return f"bad override: {first} (overrides look like key=value, key=[1,2], -m key=a,b)"
    return " ".join(l for l in lines[:2] if "full_key" not in l and "object_type" not in l)


# Jobs of a sweep that failed (in-process launchers): the sweep finishes the others, then exits 1.
FAILED_JOBS: list[str] = []
# The overrides of the sweep running now (in-process launchers): Ctrl-C names the jobs that never ran.
SWEEP_OVERRIDES: list[str] = []


def name_jobs_not_run(e: BaseException, job: int, sweeper_params) -> RelposError:
    """Ctrl-C in job `job` of a sweep: the job's own message (where its checkpoint is) plus the jobs
    that never ran, so they can be run again."""
    from relpos_cli.config import sweep_jobs
    from relpos_cli.errors import Interrupted

    message = str(e) if isinstance(e, RelposError) else "interrupted"
    try:
        jobs = sweep_jobs(SWEEP_OVERRIDES, sweeper_params)
    except Exception:  # naming them is a courtesy: the interruption is the message
        jobs = []
    after = [f"#{n} {overrides}" for n, overrides in enumerate(jobs) if n > job]
    if after:
        message += f"; the sweep stopped at job #{job}, these {len(after)} never ran: {'; '.join(after)}"
    return Interrupted(message, getattr(e, "exit_code", 130) - 128)


def run_hydra_job(task: Callable, overrides: list[str], multirun: bool, cfg: Optional[str]) -> list[str]:
    """Run `task(cfg)` as a Hydra app over conf/, with the shell's overrides."""
    import hydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from relpos_cli.config import check_group_overrides, conf_dir
    from relpos_cli.sweep_signals import workers_stop_with_the_sweep

    argv = [sys.argv[0], *overrides]
    if multirun:
        argv.append("--multirun")
    if cfg:
        argv += ["--cfg", cfg]
    sys.argv = argv
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")  # Hydra raises instead of printing a multi-line report
    FAILED_JOBS.clear()
    SWEEP_OVERRIDES[:] = overrides
    with clear_errors():
        if multirun and cfg:
            raise RelposError("--cfg prints one composed config: drop -m (and give single values)")
        check_group_overrides(overrides)
        try:
            with workers_stop_with_the_sweep() if multirun else nullcontext():
                hydra.main(config_path=str(conf_dir()), config_name="config", version_base="1.3")(task)()
        except (HydraException, OmegaConfBaseException) as e:
            raise RelposError(hydra_error_line(e)) from None
    return list(FAILED_JOBS)


def exit_if_failed(failed: list[str]) -> None:
    if failed:
        print_error(f"{len(failed)} sweep job(s) failed (see failed.json in each): {', '.join(failed)}")
        raise SystemExit(1)


LATEST = Path("outputs") / "latest"


def check_latest_is_a_link() -> None:
    """Before training: outputs/latest must be relpos's link (or absent), or the run could not be
    pointed at after hours of training."""
    if LATEST.exists() and not LATEST.is_symlink():
        kind = "directory" if LATEST.is_dir() else "file"
        raise RelposError(f"{LATEST} is a {kind}, where relpos keeps a link to the newest run: move it away "
                          f"(mv {LATEST} {LATEST}.mine) and run again")


def point_latest_at(target: Path) -> None:
    """outputs/latest -> the newest run (or sweep) dir, so `relpos eval-length outputs/latest` works.
    A failure here (outputs/ read-only, full) is a note: the run itself is done."""
    from relpos_cli.console import print_note

    # a temp name of this process's own: parallel jobs (joblib, several shells) finish at once
    tmp = LATEST.with_name(f".latest.{os.getpid()}.tmp")
    try:
        LATEST.parent.mkdir(parents=True, exist_ok=True)
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(target.resolve(), target_is_directory=True)
        tmp.replace(LATEST)
    except OSError as e:
        print_note(f"outputs/latest not updated: {describe_os_error(e)}")


def _train_job(cfg, evaluate: bool = False) -> float:
    """One Hydra job: train (then, for `relpos sweep`, evaluate on the same allocation).

    In a sweep the job's W&B group is the sweep dir; a job that submitit requeued before its time
    limit (requeue.py) resumes its run dir, or goes on to the evaluation if training had finished."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf.errors import OmegaConfBaseException

    from relpos_cli.checkpoint import CHECKPOINT_FILE, mark_failed
    from relpos_cli.errors import Interrupted, RunDirTaken
    from relpos_cli.requeue import requeue_on_preemption, was_requeued
    from relpos_cli.sweep_signals import in_worker_process, interrupted_worker_exits
    from relpos_cli.train import train as run_training

    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    sweeping = hydra_cfg.mode == RunMode.MULTIRUN
    if sweeping and cfg.wandb.group is None:
        cfg.wandb.group = str(hydra_cfg.sweep.dir)
    val_loss = float("nan")
    with clear_errors(), interrupted_worker_exits(), requeue_on_preemption(run_dir):
        try:
            requeued = was_requeued(run_dir)
            if requeued and (run_dir / CHECKPOINT_FILE).is_file():
                plain_console().print(f"{run_dir}: trained before the job was requeued", soft_wrap=True)
            else:
                val_loss = run_training(cfg, run_dir, resume=requeued)["val_loss"]
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
            FAILED_JOBS.append(str(run_dir))
            print_error(f"{run_dir}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
            evaluate = False
        if evaluate:
            try:
                _evaluate_in_job(run_dir)
            except RelposError as e:  # the trained run stays valid (no failed.json): eval-length can redo this
                FAILED_JOBS.append(str(run_dir))
                print_error(f"{run_dir}: evaluation: {e}")
    if os.environ.get("RANK", "0") == "0":  # under torchrun, one rank points outputs/latest
        point_latest_at(Path(hydra_cfg.sweep.dir) if sweeping else run_dir)
    return val_loss


def _sweep_job(cfg) -> float:
    """A job of `relpos sweep`: it trains and evaluates on its own allocation (a SLURM node's GPU);
    only the comparison runs on the submitting host."""
    return _train_job(cfg, evaluate=True)


def _evaluate_in_job(run_dir: Path) -> None:
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


@app.command(context_settings=OVERRIDES, cls=WithConfigGroups)
def train(
    ctx: typer.Context,
    overrides: Optional[list[str]] = OVERRIDE_ARGS,
    multirun: bool = typer.Option(False, "-m", "--multirun", help="Sweep: comma-separated values run one job each."),
    cfg: Optional[str] = typer.Option(None, "--cfg", help="Print the composed config (job|hydra|all) and exit."),
) -> None:
    """Train one model; key=value arguments are Hydra overrides.

    [bold]Examples[/]

      relpos train pos=alibi
      relpos train pos=t5 pos.num_buckets=64 model.n_layers=6 train.steps=2000
      relpos train -m pos=none,learned,sinusoidal,rope,alibi,t5 seed=0,1
      relpos train --cfg job pos=rope
      relpos train task=passkey pos=alibi train.seq_len=128

    Main keys: pos=<scheme>, model.{d_model,n_layers,n_heads}, train.{seq_len,batch_size,steps,lr,log_every},
    seed, device=auto|cpu|cuda, data=stdlib|wikitext103|hub|text_files, wandb.mode=offline|online|disabled,
    task=none|passkey|assoc_recall|copy|flip_flop (train on a task's answers; task.mix=0.25 mixes it into
    language modelling).
    Runs land in outputs/ (hydra.run.dir=PATH or hydra.sweep.dir=PATH to place them).
    A killed or interrupted run continues exactly where its last checkpoint left it:

      relpos train resume=outputs/2026-01-01/12-00-00-000000_rope
    """
    from relpos_cli.config import quote_path_overrides

    overrides = [*(overrides or []), *ctx.args]
    resumes = [a for a in overrides if a.startswith("resume=")]
    with under_torchrun() as ranks:
        if resumes and not cfg:
            with clear_errors():
                from relpos_cli.train import resume

                if multirun or len(overrides) != 1:
                    raise RelposError("resume=RUN_DIR takes no other overrides and no -m: the run keeps its saved config")
                resume(Path(resumes[0].split("=", 1)[1]))
            return
        with clear_errors():
            if ranks is not None:
                overrides = torchrun_overrides(overrides, multirun, ranks.is_main)
            if not cfg and (ranks is None or ranks.is_main):
                check_latest_is_a_link()
                if multirun:
                    from relpos_cli.config import resolve_sweep_dir
                    from relpos_cli.rundir import check_sweep_dir

                    check_sweep_dir(resolve_sweep_dir(overrides))
        exit_if_failed(run_hydra_job(_train_job, quote_path_overrides(overrides), multirun, cfg))


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
        distributed.teardown(finished)


def torchrun_overrides(overrides: list[str], multirun: bool, is_main: bool) -> list[str]:
    """Every torchrun rank composes its own config: all of them get rank 0's run dir (its name holds
    rank 0's clock), and rank 0 alone writes Hydra's files and log there."""
    import datetime
    import re

    from omegaconf import OmegaConf

    from relpos_cli.config import conf_dir
    from relpos_cli.distributed import broadcast_from_main

    if multirun:
        raise RelposError("-m sweeps do not run under torchrun: start one torchrun per run, or sweep with a launcher")
    extra = []
    if not any(o.startswith("hydra.run.dir=") for o in overrides):
        pattern = OmegaConf.to_container(OmegaConf.load(conf_dir() / "config.yaml").hydra.run)["dir"]  # unresolved
        now = datetime.datetime.now()
        run_dir = re.sub(r"\$\{now:([^}]*)\}", lambda m: now.strftime(m[1]), pattern)  # ${pos.name} stays for Hydra
        extra.append(f"hydra.run.dir={broadcast_from_main(run_dir)}")
    if not is_main:
        extra += ["hydra.output_subdir=null", "hydra/job_logging=disabled"]
    return [*overrides, *extra]


def split_runs_and_overrides(args: list[str]) -> tuple[list[Path], list[str]]:
    """Existing paths or arguments without '=' name run dirs or sweep dirs; the others are overrides.

    (Hydra names sweep runs `0_pos=rope,seed=0`, so a path may hold '='.)"""
    from relpos_cli.compare import find_runs

    runs: list[Path] = []
    paths = [a for a in args if "=" not in a or Path(a).exists()]
    overrides = [a for a in args if a not in paths]
    for arg in paths:
        runs.extend(find_runs(Path(arg)) or [Path(arg)])
    if not runs:
        raise RelposError("name at least one run dir (outputs/...)")
    return runs, overrides


REPLACE = typer.Option(False, "--replace", help="Overwrite the stored result of the same variant, even a more thorough one.")


@app.command("eval-length", context_settings=OVERRIDES)
def eval_length(ctx: typer.Context, replace: bool = REPLACE) -> None:
    """Perplexity versus length for trained runs (RUN_DIR... then key=value overrides).

    Scores the same first eval.tokens validation tokens at every length (each exactly once), loading
    each model once. Prints a table and writes into each run dir eval_length.csv/.json/.png and
    eval_positions.csv/.png (mean loss per position inside the window); logs them to W&B.
    Protocols: eval.protocol=nonoverlapping (default) or eval.protocol=sliding eval.stride=S (only
    the last S tokens of each window are scored). Settings other than lengths/tokens/batch size that
    differ from conf/eval/default.yaml form a variant, written to eval_length.<variant>.csv etc.
    A stored result of the variant over more eval.tokens is not replaced (--replace overwrites it);
    one over as many keeps its lengths this evaluation does not score.

    [bold]Examples[/]

      relpos eval-length outputs/2026-01-01/12-00-00-000000_alibi
      relpos eval-length outputs/multirun/2026-01-01/12-00-00-000000 eval.lengths=[128,256,512,1024,2048]
      relpos eval-length RUN1 RUN2 eval.protocol=sliding eval.stride=64
      relpos eval-length RUN eval.tokens=65536 eval.max_tokens_per_batch=8192 device=cpu
      relpos eval-length RUN eval.self_extend.group=8 eval.self_extend.window=64   (docs/extension.md)
    """
    from relpos_cli.report import evaluate_and_report

    console = plain_console()
    with clear_errors():
        runs, overrides = split_runs_and_overrides(list(ctx.args))
        each_run(runs, lambda run_dir: evaluate_and_report(run_dir, overrides, console, replace))


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


@app.command("eval-task", context_settings=OVERRIDES)
def eval_task(ctx: typer.Context, replace: bool = REPLACE) -> None:
    """Exact-match accuracy versus length on a task (RUN_DIR... then task key=value overrides).

    Scores task.samples examples per eval length (task.eval_lengths, default 1x..16x the training
    length) and, for passkey, per needle depth (task.depths), the same examples for every run (drawn
    from task.seed). One forward pass per example: teacher-forced argmax over the whole answer equals
    greedy decoding. Reports the effective length, the longest length up to which accuracy stays
    >= task.threshold. Writes into each run dir eval_task.csv/.json/.png (and for passkey
    eval_task_heatmap.png, depth x length) and logs them to W&B. The run's own task by default;
    task=<name> scores another (a language-model run zero-shot). Takes only task=..., task.*,
    device, eval.max_tokens_per_batch and the eval-time position methods (eval.rope_scaling.*,
    eval.self_extend.*, eval.rerope.*, eval.window.*: docs/extension.md), which form a variant.
    The result is merged into the stored one of the same variant: stored lengths (cells) it does
    not score, or scores with fewer examples, are kept (--replace overwrites them).

    [bold]Examples[/]

      relpos eval-task outputs/2026-01-01/12-00-00-000000_alibi
      relpos eval-task outputs/multirun/2026-01-01/12-00-00-000000 task.samples=50
      relpos eval-task RUN task.eval_lengths=[256,1024,4096] task.depths=[0,0.1,0.5,0.9,1]
      relpos eval-task LM_RUN task=passkey task.threshold=0.5
      relpos eval-task RUN eval.window.sinks=4 eval.window.size=128
    """
    from relpos_cli.eval_task import evaluate_task_and_report

    console = plain_console()
    with clear_errors():
        runs, overrides = split_runs_and_overrides(list(ctx.args))
        each_run(runs, lambda run_dir: evaluate_task_and_report(run_dir, overrides, console, replace))


@app.command(context_settings=OVERRIDES)
def compare(
    ctx: typer.Context,
    out: Optional[Path] = typer.Option(None, "--out", help="Folder for compare.* (default: the first PATH)."),
    evaluate: bool = typer.Option(True, "--evaluate/--no-evaluate", help="Evaluate runs lacking the variant first, or only report them."),
    metric: str = typer.Option("ppl", "--metric", help="ppl | loss | ppl_ratio | bpb | accuracy (task runs)"),
) -> None:
    """One table over runs and sweeps (PATH... then eval key=value overrides): rows = configurations,
    columns = eval lengths, cells = mean ± std over seeds (n), best per length in bold.

    Runs are grouped by the resolved-config keys that differ between them (seed, paths, hydra, wandb
    excluded) and by eval variant. Runs lacking the variant named by the overrides are evaluated
    first (--no-evaluate: listed instead); failed runs are listed, not fatal. Writes compare.csv,
    compare.md, compare.json, compare.png into --out or the first PATH, and a W&B Table + plot.

    [bold]Examples[/]

      relpos compare outputs/multirun/2026-01-01/12-00-00-000000
      relpos compare SWEEP_A SWEEP_B RUN_C --out results/ --metric ppl_ratio
      relpos compare BYTES_RUN BPE_RUN --metric bpb      # across tokenizers: bits per byte
      relpos compare SWEEP eval.protocol=sliding eval.stride=64
      relpos compare TASK_SWEEP --metric accuracy task.threshold=0.8   # task runs: accuracy, effective length
      relpos compare LM_SWEEP --metric accuracy task=passkey          # language models scored zero-shot

    With --metric accuracy the overrides are eval-task's (task=<name>, task.*): cells are exact-match
    accuracy mean ± std over seeds with (k/n) seeds >= task.threshold, plus the effective length of
    the mean curve and of each seed; perplexities of runs that have them join the same table.
    It writes compare_accuracy.csv/.md/.json/.png.
    """
    from relpos_cli.compare import run_compare

    with clear_errors():
        _, overrides = split_runs_and_overrides(list(ctx.args))
        paths = [Path(a) for a in ctx.args if a not in overrides]
        run_compare(paths, overrides, out or paths[0], evaluate, metric, plain_console())


@app.command(context_settings=OVERRIDES, cls=WithConfigGroups)
def sweep(
    ctx: typer.Context,
    overrides: Optional[list[str]] = OVERRIDE_ARGS,
    evaluate: bool = typer.Option(True, "--evaluate/--no-evaluate", help="Evaluate and compare after training."),
) -> None:
    """Train a whole experiment (Hydra multirun), each job evaluating its run, then compare them.

    key=value arguments are Hydra overrides; an experiment preset (conf/experiment/) sets the sweep.
    Each job trains and then evaluates its run where it runs (on a SLURM node with
    hydra/launcher=slurm): eval-length for language-model runs, eval-task for task runs, both for
    runs with task.mix < 1; this process then only compares the results (compare.* by perplexity,
    compare_accuracy.* by task accuracy).
    A failed run is recorded in its dir (failed.json) and listed by compare; the others go on,
    and the command exits 1 after comparing the runs that finished.

    [bold]Examples[/]

      relpos sweep +experiment=quick                        # 6 schemes x 2 seeds on CPU, < 1 h on 2 cores
      relpos sweep +experiment=quick hydra/launcher=joblib  # jobs in parallel processes
      relpos sweep +experiment=alibi_paper device=cuda      # the ALiBi paper's setting (GPU)
      relpos sweep +experiment=tasks                        # 6 schemes x 2 seeds on passkey and assoc_recall
      relpos sweep pos=rope,alibi seed=0,1 train.steps=200  # any sweep, without a preset
    """
    from relpos_cli.compare import compare_sweep, find_runs, load_run
    from relpos_cli.config import resolve_sweep_dir
    from relpos_cli.rundir import check_sweep_dir

    overrides = [*(overrides or []), *ctx.args]
    with clear_errors():
        check_latest_is_a_link()
        sweep_dir = resolve_sweep_dir(overrides)
        check_sweep_dir(sweep_dir)
    job = _sweep_job if evaluate else _train_job
    failed = run_hydra_job(job, [*overrides, f"hydra.sweep.dir={sweep_dir}"], True, None)
    point_latest_at(sweep_dir)
    if evaluate:
        with clear_errors():
            # every job evaluated its run where it trained: here the results are only gathered
            compare_sweep(sweep_dir, plain_console())
        # jobs of other launchers (joblib, SLURM) fail in their own processes: their run dirs say so
        known = {Path(f).resolve() for f in failed}
        failed += [str(r.path) for r in map(load_run, find_runs(sweep_dir))
                   if (r.failure or not (r.results or r.task_results)) and r.path.resolve() not in known]
    exit_if_failed(failed)


@app.command()
def schemes(
    model: str = typer.Option("small", "--model", help="Model size (conf/model/NAME.yaml) the parameters are counted for."),
) -> None:
    """The registered position schemes: hooks, what the bias depends on, learnable parameters, shift invariance, paper.

    Each scheme is built with its conf/pos/<name>.yaml defaults at train.seq_len from conf/train.

    [bold]Examples[/]

      relpos schemes
      relpos schemes --model tiny
    """
    from omegaconf import OmegaConf
    from rich.table import Table
    from rich.text import Text

    from relpos_cli.config import conf_dir, default_group
    from relpos_cli.positions import REGISTRY, build_scheme, scheme_names
    from relpos_cli.positions.base import ModelShape

    with clear_errors():
        if not (conf_dir() / "model" / f"{model}.yaml").is_file():
            raise RelposError(f"no model config conf/model/{model}.yaml")
        m = default_group("model", model)
        shape = ModelShape(m.d_model, m.n_heads, m.n_layers, default_group("train").seq_len)
        table = Table(title=f"position schemes (parameters at model={model}: d_model={shape.d_model}, "
                      f"{shape.n_heads} heads, {shape.n_layers} layers)", title_justify="left",
                      caption="bias on: what the additive logit bias depends on; shift inv.: relative, the "
                              "position term depends on i - j only", caption_justify="left")
        table.add_column("scheme (paper)", overflow="fold", ratio=1)
        table.add_column("hooks")
        table.add_column("bias on")
        table.add_column("params", justify="right")
        table.add_column("shift inv.")
        for name in scheme_names():
            pos_yaml = conf_dir() / "pos" / f"{name}.yaml"
            pos_cfg = OmegaConf.to_container(OmegaConf.load(pos_yaml)) if pos_yaml.is_file() else {"name": name}
            scheme, cls = build_scheme(pos_cfg, shape), REGISTRY[name]
            count = sum(p.numel() for p in scheme.parameters())
            groups = sorted({n.split(".")[0] for n, _ in scheme.named_parameters()})
            table.add_row(Text.assemble((name, "bold"), "\n", (cls.paper, "dim")), "\n".join(cls.hooks()) or "-",
                          cls.bias_input.value, f"{count:,}\n({', '.join(groups)})" if count else "0",
                          "yes" if scheme.relative else "no")
        plain_console().print(table)


def _report_inspect(run_dir: Path, config, record) -> None:
    from omegaconf import OmegaConf

    from relpos_cli.inspect import symmetry_table
    from relpos_cli.logs import run_log
    from relpos_cli.plots import run_title
    from relpos_cli.tracking import log_inspect, publish

    console = plain_console()
    console.print(symmetry_table(record, f"{run_title(run_dir, record['scheme'])}: asymmetry ||A - A^T||_F / ||A||_F"))
    with run_log(run_dir) as log:
        log.info(f"inspect: wrote {len(record['files'])} files into {run_dir / 'inspect'}")
    publish(run_dir, log_inspect, OmegaConf.to_container(config, resolve=True))
    console.print(f"wrote {len(record['files']) + 1} files into {run_dir / 'inspect'} (index: inspect.md)")


def _inspect_job(cfg) -> None:
    from hydra.core.hydra_config import HydraConfig

    from relpos_cli.config import save_hydra_record
    from relpos_cli.inspect import inspect_fresh
    from relpos_cli.checkpoint import CONFIG_FILE
    from relpos_cli.rundir import check_fresh_run_dir, refuse_if_trained, run_dir_lock

    with clear_errors():
        run_dir = Path(HydraConfig.get().runtime.output_dir)
        check_fresh_run_dir(run_dir)  # never into a folder of the user's own files
        with run_dir_lock(run_dir, "inspect"):
            # a trained run's inspect/ pictures are of its weights: `relpos inspect RUN_DIR` redoes them
            refuse_if_trained(run_dir, (run_dir / CONFIG_FILE).exists())
            save_hydra_record(run_dir, cfg)
            _report_inspect(run_dir, cfg, inspect_fresh(cfg, run_dir))


@app.command("inspect", context_settings=OVERRIDES)
def inspect_cmd(ctx: typer.Context) -> None:
    """Pictures and symmetry numbers of a scheme: fresh (key=value overrides) or trained (RUN_DIR).

    Writes into RUN_DIR/inspect (or hydra.run.dir/inspect): position-only logits per head on an
    L x L grid (L = inspect.length), their curves against i - j, for a trained run the attention
    maps of a validation sample with and without the causal mask, symmetry.json with
    ||A - A^T||_F / ||A||_F per layer and head, and inspect.md naming every picture.

    [bold]Examples[/]

      relpos inspect pos=alibi
      relpos inspect pos=t5 pos.bidirectional=true inspect.length=128
      relpos inspect pos=rope model=tiny hydra.run.dir=outputs/inspect_rope
      relpos inspect outputs/2026-01-01/12-00-00-000000_alibi inspect.layers=[0] inspect.heads=[0,1]
    """
    args = list(ctx.args)
    if all("=" in a and not Path(a).exists() for a in args):  # no run dir named: a fresh scheme
        run_hydra_job(_inspect_job, args, False, None)
        return
    from relpos_cli.inspect import inspect_run
    from relpos_cli.rundir import run_dir_lock

    with clear_errors():
        runs, overrides = split_runs_and_overrides(args)
        for run_dir in runs:
            with run_dir_lock(run_dir, "inspect"):
                cfg, record = inspect_run(run_dir, overrides)
                _report_inspect(run_dir, cfg, record)


@app.command()
def sample(
    run_dir: Path = typer.Argument(..., metavar="RUN_DIR", help="A trained run (outputs/...)."),
    prompt: str = typer.Option("", "--prompt", "-p", help="Text to continue (empty: the start of a document)."),
    max_new_tokens: int = typer.Option(200, "--max-new-tokens", "-n", help="Tokens to generate at most."),
    temperature: float = typer.Option(0.0, "--temperature", "-t", help="0 = greedy; > 0 samples from softmax(logits / t)."),
    top_k: int = typer.Option(0, "--top-k", "-k", help="Sample only from the k most likely tokens (0 = all)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the sampling: the same seed gives the same text."),
    context: Optional[int] = typer.Option(None, "--context", help="Tokens the model sees per step (default: train.seq_len)."),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda"),
) -> None:
    """Generate text from a trained run with its own tokenizer: greedy, temperature or top-k.

    The prompt follows an end-of-document token, as documents start in training; generation stops
    after --max-new-tokens or at the end-of-document token. Prints the prompt, then the new text as
    it comes.

    [bold]Examples[/]

      relpos sample outputs/latest --prompt "def main(" --max-new-tokens 200
      relpos sample RUN -p "import " -n 100 --temperature 0.8 --top-k 40 --seed 1
      relpos sample RUN -p "class " --context 1024     # past the training length
    """
    from relpos_cli.interrupt import stop_on_signals
    from relpos_cli.sample import sample_run

    with clear_errors(), stop_on_signals():
        pieces = sample_run(run_dir, prompt, max_new_tokens, temperature, top_k, seed, context, device)
        out = plain_console(soft_wrap=True)
        first = next(pieces, "")  # errors (bad run dir or options) come before the prompt is printed
        out.print(prompt, style="dim", end="")
        out.print(first, end="")
        for piece in pieces:
            out.print(piece, end="")
        out.print()


def use_huge_pages() -> None:
    """Large CPU tensors in 2 MiB pages for relpos's own commands (a library import leaves the host's
    allocator alone): torch's switch, read at its first allocation, so set here, before anything
    imports torch; sweep workers inherit it. Long evaluation builds a (block x L) bias per query block;
    faulting 16 MiB in 4 KiB pages took 14 ms against 4 ms in 2 MiB ones, and FIRE's evaluation at
    L = 16384 took 18.8 s without and 17.4 s with (README, Speed). A value set by the user wins."""
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


@app.command("import", context_settings=OVERRIDES)
def import_cmd(ctx: typer.Context) -> None:
    """Make a pretrained model a relpos run (SOURCE OUT_DIR then key=value overrides).

    SOURCE: hf:ORG/NAME[@REVISION] (the hub, or its local cache offline), a local Hugging Face model
    dir, or a .gguf file. OUT_DIR gets what a finished training run holds (config, weights, the
    model's tokenizer, data.json) and import.json (source, revision or sha256 of the weight files);
    eval-length, eval-task, inspect, sample, compare and `train init_from=OUT_DIR` then work on it.
    The evaluation corpus is the stdlib corpus, tokenized with the model's tokenizer, unless data=...
    says otherwise. Needs `pip install 'relpos[pretrained]'`. See docs/pretrained.md.

    [bold]Examples[/]

      relpos import SmolLM2-135M-Instruct.Q4_1.gguf outputs/smollm2
      relpos import hf:EleutherAI/pythia-70m@main outputs/pythia-70m
      relpos import ./my-llama outputs/my-llama data=text_files data.files=[corpus.txt]
    """
    from relpos_cli.importing import import_checkpoint

    console = plain_console()
    with clear_errors():
        args = list(ctx.args)
        if len(args) < 2 or any("=" in a and not Path(a).exists() for a in args[:2]):
            raise RelposError("usage: relpos import SOURCE OUT_DIR [key=value ...]")
        run_dir = import_checkpoint(args[0], Path(args[1]), args[2:], announce=lambda text: console.print(text, style="dim"))
        console.print(f"run dir: {run_dir}")


def main() -> None:
    command = next((a for a in sys.argv[1:] if not a.startswith("-")), None)
    if launched_by_torchrun() and command not in (None, "train"):
        # every rank would run the whole command on its own, each writing the same files
        print_error(f"relpos {command} runs in one process; under torchrun only `relpos train` runs")
        raise SystemExit(2)
    use_huge_pages()
    # before anything imports torch.optim: that fixes Inductor's cache dir (in the environment) for the process
    use_relpos_compile_cache()
    app(prog_name="relpos")  # also under `python -m relpos_cli`: completion reads _RELPOS_COMPLETE


if __name__ == "__main__":
    main()
