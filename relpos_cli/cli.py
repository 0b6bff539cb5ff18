"""The `relpos` command line: the commands, their options and help; each hands its arguments to one
function of relpos_cli/jobs.py.

Arguments of the form key=value are Hydra overrides; `-m` runs a Hydra multirun sweep.
"""

from __future__ import annotations

import inspect
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import typer
from typer.core import TyperCommand, TyperGroup

try:  # Typer's own copy of click (typer >= 0.2x), whose errors its commands raise
    from typer._click.exceptions import NoArgsIsHelpError, UsageError
except ImportError:  # an older Typer on click itself (click < 8.2 shows plain `relpos`'s help without an error)
    from click.exceptions import UsageError

    NoArgsIsHelpError = getattr(sys.modules["click.exceptions"], "NoArgsIsHelpError", ())

from relpos_cli import __version__
from relpos_cli.compile_cache import use_relpos_compile_cache
from relpos_cli.console import print_error
from relpos_cli.renamed import renamed_overrides
from relpos_cli.jobs import (
    compare_command, evaluate_command, import_command, inspect_command, launched_by_torchrun, sample_command,
    schemes_command, sweep_command, train_command, use_huge_pages,
)


@contextmanager
def _usage_errors_in_one_line() -> Iterator[None]:
    """Click's usage errors (an unknown command or option, a missing argument) as one line and exit 2,
    as every other bad input is: Click drew the usage, a hint and a boxed error, five lines."""
    try:
        yield
    except NoArgsIsHelpError:  # plain `relpos`: the help is the answer
        raise
    except UsageError as e:
        hint = f" (see {e.ctx.command_path} --help)" if e.ctx is not None else ""
        print_error(f"{e.format_message()}{hint}")
        raise SystemExit(e.exit_code) from None


COMPLETE_VAR = "_RELPOS_COMPLETE"  # what the completion scripts set when they ask relpos for completions
COMPLETION_SHELLS = ("bash", "zsh", "fish", "powershell", "pwsh")


class RelposGroup(TyperGroup):
    """The command group: it hands the command line as typed to relpos.log's provenance line
    (logs.start_command; Hydra's jobs see a sys.argv rewritten for Hydra), prints usage errors in
    one line, and `--show-completion SHELL` prints that shell's script."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        from relpos_cli.logs import start_command

        args = sys.argv[1:] if args is None else list(args)
        if len(args) == 2 and args[0] == "--show-completion" and args[1] not in COMPLETION_SHELLS:
            print_error(f"--show-completion {args[1]}: choose one of {', '.join(COMPLETION_SHELLS)} "
                        f"(or none: the shell it runs in)")
            raise SystemExit(2)
        if len(args) == 2 and args[0] == "--show-completion":
            # Typer (with shellingham, a dependency of typer) takes no shell there and prints the script of
            # the shell it runs in, ignoring the word: `relpos --show-completion zsh` run from bash printed
            # bash's. Click's own request for a script names its shell.
            os.environ[COMPLETE_VAR] = f"source_{args[1]}"
            try:
                return super().main([], "relpos", COMPLETE_VAR, standalone_mode, **extra)
            finally:
                os.environ.pop(COMPLETE_VAR, None)
        start_command(args)
        return super().main(args, prog_name, complete_var, standalone_mode, **extra)

    def make_context(self, *args, **kwargs):
        with _usage_errors_in_one_line():
            return super().make_context(*args, **kwargs)

    def invoke(self, ctx):
        with _usage_errors_in_one_line():
            return super().invoke(ctx)


app = typer.Typer(
    cls=RelposGroup,
    help="Train causal Transformers with any position scheme and measure perplexity across lengths.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)
OVERRIDES = {"allow_extra_args": True, "ignore_unknown_options": True}


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
    task=<name> (the task group below: train on a task's answers; task.mix=0.25 mixes it into
    language modelling).
    Runs land in outputs/ (hydra.run.dir=PATH or hydra.sweep.dir=PATH to place them).
    A killed or interrupted run continues exactly where its last checkpoint left it:

      relpos train resume=outputs/2026-01-01/12-00-00-000000_rope
    """
    train_command(renamed_overrides([*(overrides or []), *ctx.args]), multirun, cfg)


REPLACE = typer.Option(False, "--replace", help="Overwrite the stored result of the same variant, even a more thorough one.")


@app.command("eval-length", context_settings=OVERRIDES, options_metavar="[OPTIONS] RUN_OR_SWEEP... [KEY=VALUE]...")
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
      relpos eval-length SWEEP eval.lengths=[128,256,512,1024,2048]
      relpos eval-length RUN1 RUN2 eval.protocol=sliding eval.stride=64
      relpos eval-length RUN eval.tokens=65536 eval.max_tokens_per_batch=8192
      # Self-Extend at evaluation (docs/extension.md)
      relpos eval-length RUN eval.self_extend.group=8 eval.self_extend.window=64
    """
    evaluate_command(renamed_overrides(ctx.args), "eval-length", replace)


@app.command("eval-task", context_settings=OVERRIDES, options_metavar="[OPTIONS] RUN_OR_SWEEP... [KEY=VALUE]...")
def eval_task(ctx: typer.Context, replace: bool = REPLACE) -> None:
    """Exact-match accuracy versus length on a task (RUN_DIR... then task key=value overrides).

    Scores task.samples examples per eval length (task.eval_lengths, default 1x..16x the training
    length) and, for passkey, per needle depth (task.depths), the same examples for every run (drawn
    from task.seed). One forward pass per example: teacher-forced argmax over the whole answer equals
    greedy decoding. Reports the effective length, the longest length up to which accuracy stays
    >= task.threshold. Writes into each run dir eval_task.csv/.json/.png (and for passkey
    eval_task_heatmap.png, depth x length) and logs them to W&B. The run's own task by default;
    task=<name> scores another (a language-model run zero-shot). Takes only task=..., task.*,
    device, eval.max_tokens_per_batch, eval.allow_changed_data, eval.precision, plots.* and the
    eval-time position methods (eval.rope_scaling.*, eval.self_extend.*, eval.rerope.*, eval.sinks.*:
    docs/extension.md), which form a variant.
    The result is merged into the stored one of the same variant: stored lengths (cells) it does
    not score, or scores with fewer examples, are kept (--replace overwrites them).

    [bold]Examples[/]

      relpos eval-task outputs/2026-01-01/12-00-00-000000_alibi
      relpos eval-task SWEEP task.samples=50
      relpos eval-task RUN task.eval_lengths=[256,1024] task.depths=[0,0.5,1]
      relpos eval-task LM_RUN task=passkey task.threshold=0.5
      relpos eval-task RUN eval.sinks.count=4 eval.sinks.window=128
    """
    evaluate_command(renamed_overrides(ctx.args), "eval-task", replace)


@app.command(context_settings=OVERRIDES, options_metavar="[OPTIONS] PATH... [KEY=VALUE]...")
def compare(
    ctx: typer.Context,
    out: Optional[Path] = typer.Option(None, "--out", help="Folder for compare.* (default: the first PATH)."),
    evaluate: bool = typer.Option(True, "--evaluate/--no-evaluate", help="Evaluate runs lacking the variant first, or only report them."),
    metric: str = typer.Option("ppl", "--metric", help="ppl | loss | ppl_ratio | bpb | accuracy (task runs)"),
    paired_with: Optional[str] = typer.Option(
        None, "--paired-with", metavar="ROW",
        help="Also give every other row minus ROW (its label as the table shows it), run by run of one seed, with a 95% interval."),
) -> None:
    """One table over runs and sweeps (PATH... then eval key=value overrides): rows = configurations,
    columns = eval lengths, cells = mean ± std over seeds (n), best per length in bold.

    Runs are grouped by the resolved-config keys that differ between them (seed, paths, hydra, wandb
    excluded) and by eval variant. Runs lacking the variant named by the overrides are evaluated
    first (--no-evaluate: listed instead); failed runs are listed, not fatal. Writes compare.csv,
    compare.md, compare.json, compare.png (compare_<metric>.* for another --metric) into --out or the
    first PATH, and a W&B Table + plot.

    [bold]Examples[/]

      relpos compare outputs/multirun/2026-01-01/12-00-00-000000
      relpos compare SWEEP_A SWEEP_B RUN_C --out results/ --metric ppl_ratio
      relpos compare BYTES_RUN BPE_RUN --metric bpb  # across tokenizers
      relpos compare SWEEP eval.protocol=sliding eval.stride=64
      relpos compare SWEEP --paired-with rope  # each row minus rope, per seed
      # task runs: accuracy, effective length
      relpos compare TASK_SWEEP --metric accuracy task.threshold=0.8
      # language models scored zero-shot
      relpos compare LM_SWEEP --metric accuracy task=passkey

    With --metric accuracy the overrides are eval-task's (task=<name>, task.*): cells are exact-match
    accuracy mean ± std over seeds with (k/n) seeds >= task.threshold, plus the effective length of
    the mean curve and of each seed; perplexities of runs that have them join compare_accuracy.md and .csv.
    It writes compare_accuracy.csv/.md/.json/.png.
    """
    compare_command(renamed_overrides(ctx.args), out, evaluate, metric, paired_with)


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
    and the command exits 1 after comparing the runs that finished, naming its jobs that failed or
    were refused their run dir (into an earlier sweep's dir, a job whose dir holds a run).

    [bold]Examples[/]

      # 6 schemes x 2 seeds on CPU, < 1 h on 2 cores; then in parallel processes
      relpos sweep +experiment=quick
      relpos sweep +experiment=quick hydra/launcher=joblib
      # the ALiBi paper's setting (GPU)
      relpos sweep +experiment=alibi_paper device=cuda
      # 6 schemes x 2 seeds on passkey and assoc_recall
      relpos sweep +experiment=tasks
      # any sweep, without a preset
      relpos sweep pos=rope,alibi seed=0,1 train.steps=200
    """
    sweep_command(renamed_overrides([*(overrides or []), *ctx.args]), evaluate)


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
    schemes_command(model)


@app.command("inspect", context_settings=OVERRIDES, options_metavar="[OPTIONS] [RUN_DIR] [KEY=VALUE]...")
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
      relpos inspect RUN inspect.layers=[0] inspect.heads=[0,1]
    """
    inspect_command(renamed_overrides(ctx.args))


@app.command(context_settings=OVERRIDES)
def sample(
    ctx: typer.Context,
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
    it comes. eval.* overrides after RUN_DIR (eval.rope_scaling.*, eval.self_extend.*, eval.rerope.*,
    eval.sinks.*) sample from the model eval-length scores with those settings.

    [bold]Examples[/]

      relpos sample outputs/latest --prompt "def main(" --max-new-tokens 200
      relpos sample RUN -p "import " -n 100 --temperature 0.8 --top-k 40 --seed 1
      # past the training length, plain and with YaRN
      relpos sample RUN -p "class " --context 1024
      relpos sample RUN -p "class " --context 1024 eval.rope_scaling.type=yarn
    """
    sample_command(run_dir, prompt, max_new_tokens, temperature, top_k, seed, context, device, renamed_overrides(ctx.args))


@app.command("import", context_settings=OVERRIDES, options_metavar="[OPTIONS] SOURCE OUT_DIR [KEY=VALUE]...")
def import_cmd(ctx: typer.Context) -> None:
    """Make a pretrained model a relpos run (SOURCE OUT_DIR then key=value overrides).

    SOURCE: hf:ORG/NAME\\[@REVISION] (the hub, or its local cache offline), a local Hugging Face model
    dir, or a .gguf file. OUT_DIR gets what a finished training run holds (config, weights, the
    model's tokenizer, data.json) and import.json (source, revision or sha256 of the weight files);
    eval-length, eval-task, inspect, sample, compare and `train init_from=OUT_DIR` then work on it.
    The evaluation corpus is the stdlib corpus, tokenized with the model's tokenizer, unless data=...
    says otherwise. Needs `pip install 'relpos\\[pretrained]'`. See docs/pretrained.md.

    [bold]Examples[/]

      relpos import SmolLM2-135M-Instruct.Q4_1.gguf outputs/smollm2
      relpos import hf:EleutherAI/pythia-70m@main outputs/pythia-70m
      relpos import ./my-llama outputs/llama data=text_files data.files=\\[a.txt]
    """
    import_command(list(ctx.args))


def one_line_paragraphs(doc: str) -> str:
    """A docstring as --help should show it: Typer's rich mode keeps each source line break and then
    wraps again at the terminal's width, breaking sentences mid-line; a paragraph's lines are joined
    here, and a paragraph holding indented lines (the examples) is kept as written."""
    paragraphs = inspect.cleandoc(doc).split("\n\n")
    return "\n\n".join(p if any(line.startswith(" ") for line in p.splitlines()) else " ".join(p.splitlines())
                       for p in paragraphs)


for command in app.registered_commands:
    command.help = one_line_paragraphs(command.help or inspect.getdoc(command.callback) or "")


def main() -> None:
    command = next((a for a in sys.argv[1:] if not a.startswith("-")), None)
    if launched_by_torchrun() and command not in (None, "train"):
        # every rank would run the whole command on its own, each writing the same files; rank 0 says so once
        if os.environ.get("RANK", "0") == "0":
            print_error(f"relpos {command} runs in one process; under torchrun only `relpos train` runs")
        raise SystemExit(2)
    use_huge_pages()
    # before anything imports torch.optim: that fixes Inductor's cache dir (in the environment) for the process
    use_relpos_compile_cache()
    app(prog_name="relpos")  # also under `python -m relpos_cli`: completion reads _RELPOS_COMPLETE


if __name__ == "__main__":
    main()
