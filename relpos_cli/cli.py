"""The `relpos` command line: Typer commands that dispatch Hydra-configured jobs.

Arguments of the form key=value are Hydra overrides; `-m` runs a Hydra multirun sweep.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional

import typer
from rich.console import Console

from relpos_cli.errors import RelposError

app = typer.Typer(
    help="Train causal Transformers with any position scheme and measure perplexity across lengths.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)
err_console = Console(stderr=True)
OVERRIDES = {"allow_extra_args": True, "ignore_unknown_options": True}


@contextmanager
def clear_errors() -> Iterator[None]:
    """RelposError -> one line on stderr and exit status 2, no traceback."""
    try:
        yield
    except RelposError as e:
        err_console.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
        raise SystemExit(2) from None


def run_hydra_job(task: Callable, overrides: list[str], multirun: bool, cfg: Optional[str]) -> None:
    """Run `task(cfg)` as a Hydra app over conf/, with the shell's overrides."""
    import hydra

    from relpos_cli.config import conf_dir

    argv = [sys.argv[0], *overrides]
    if multirun:
        argv.append("--multirun")
    if cfg:
        argv += ["--cfg", cfg]
    sys.argv = argv
    with clear_errors():
        hydra.main(config_path=str(conf_dir()), config_name="config", version_base="1.3")(task)()


LATEST = Path("outputs") / "latest"


def point_latest_at(target: Path) -> None:
    """outputs/latest -> the newest run (or sweep) dir, so `relpos eval-length outputs/latest` works."""
    LATEST.parent.mkdir(parents=True, exist_ok=True)
    tmp = LATEST.with_name(".latest.tmp")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target.resolve(), target_is_directory=True)
    tmp.replace(LATEST)


def _train_job(cfg) -> float:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from relpos_cli.train import train as run_training

    hydra_cfg = HydraConfig.get()
    with clear_errors():
        run_dir = Path(hydra_cfg.runtime.output_dir)
        val_loss = run_training(cfg, run_dir)["val_loss"]
    point_latest_at(Path(hydra_cfg.sweep.dir) if hydra_cfg.mode == RunMode.MULTIRUN else run_dir)
    return val_loss


@app.command(context_settings=OVERRIDES)
def train(
    ctx: typer.Context,
    multirun: bool = typer.Option(False, "-m", "--multirun", help="Sweep: comma-separated values run one job each."),
    cfg: Optional[str] = typer.Option(None, "--cfg", help="Print the composed config (job|hydra|all) and exit."),
) -> None:
    """Train one model; key=value arguments are Hydra overrides.

    [bold]Examples[/]

      relpos train pos=alibi
      relpos train pos=t5 pos.num_buckets=64 model.n_layers=6 train.steps=2000
      relpos train -m pos=none,learned,sinusoidal,rope,alibi,t5 seed=0,1
      relpos train --cfg job pos=rope

    Main keys: pos=<scheme>, model.{d_model,n_layers,n_heads}, train.{seq_len,batch_size,steps,lr,log_every},
    seed, device=auto|cpu|cuda, data=stdlib|wikitext103|hub|text_files, wandb.mode=offline|online|disabled.
    Runs land in outputs/ (hydra.run.dir=PATH or hydra.sweep.dir=PATH to place them).
    """
    run_hydra_job(_train_job, list(ctx.args), multirun, cfg)


def split_runs_and_overrides(args: list[str]) -> tuple[list[Path], list[str]]:
    """Arguments with '=' are overrides; the others name run dirs or sweep dirs holding runs."""
    from relpos_cli.checkpoint import CONFIG_FILE

    runs: list[Path] = []
    overrides = [a for a in args if "=" in a]
    for arg in (a for a in args if "=" not in a):
        path = Path(arg)
        if not path.exists():
            raise RelposError(f"run dir not found: {path}")
        children = sorted(p.parent for p in path.glob(f"*/{CONFIG_FILE}"))
        runs.extend([path] if (path / CONFIG_FILE).exists() or not children else children)
    if not runs:
        raise RelposError("name at least one run dir (outputs/...)")
    return runs, overrides


@app.command("eval-length", context_settings=OVERRIDES)
def eval_length(ctx: typer.Context) -> None:
    """Perplexity versus length for trained runs (RUN_DIR... then key=value overrides).

    Scores the same first eval.tokens validation tokens at every length in non-overlapping windows,
    prints a table, writes eval_length.csv / eval_length.json into each run dir and logs a W&B Table.

    [bold]Examples[/]

      relpos eval-length outputs/2026-01-01/12-00-00-000000_alibi
      relpos eval-length outputs/multirun/2026-01-01/12-00-00-000000 eval.lengths=[128,256,512,1024,2048]
      relpos eval-length RUN eval.tokens=65536 eval.max_tokens_per_batch=8192 device=cpu
    """
    from omegaconf import OmegaConf

    from relpos_cli.evaluate import evaluate_run
    from relpos_cli.report import length_table, write_length_report
    from relpos_cli.tracking import log_table

    console = Console()
    with clear_errors():
        runs, overrides = split_runs_and_overrides(list(ctx.args))
        for run_dir in runs:
            cfg, rows = evaluate_run(run_dir, overrides)
            title = f"{run_dir}  pos={cfg.pos.name}  train L={cfg.train.seq_len}  protocol={cfg.eval.protocol}"
            console.print(length_table(rows, title, cfg.train.seq_len))
            paths = write_length_report(run_dir, rows)
            log_table(run_dir, OmegaConf.to_container(cfg, resolve=True), "eval", "eval_length", rows, "length", "ppl")
            console.print("wrote " + ", ".join(str(p) for p in paths))


def _report_inspect(run_dir: Path, config, record) -> None:
    from omegaconf import OmegaConf

    from relpos_cli.inspect import symmetry_table
    from relpos_cli.tracking import log_images

    console = Console()
    console.print(symmetry_table(record, f"{run_dir}  pos={record['scheme']}  asymmetry ||A - A^T||_F / ||A||_F"))
    images = {f"inspect/{p.stem}": p for p in record["files"] if p.suffix == ".png"}
    log_images(run_dir, OmegaConf.to_container(config, resolve=True), "inspect", images)
    console.print(f"wrote {len(record['files']) + 1} files into {run_dir / 'inspect'} (index: inspect.md)")


def _inspect_job(cfg) -> None:
    from hydra.core.hydra_config import HydraConfig

    from relpos_cli.inspect import inspect_fresh

    with clear_errors():
        run_dir = Path(HydraConfig.get().runtime.output_dir)
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
    run_args = [a for a in args if "=" not in a]
    if not run_args:
        run_hydra_job(_inspect_job, args, False, None)
        return
    from relpos_cli.inspect import inspect_run

    with clear_errors():
        runs, overrides = split_runs_and_overrides(args)
        for run_dir in runs:
            cfg, record = inspect_run(run_dir, overrides)
            _report_inspect(run_dir, cfg, record)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
