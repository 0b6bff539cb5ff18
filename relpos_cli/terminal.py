"""What long jobs show while they run: a progress bar on a terminal, plain lines elsewhere.

On a TTY the training bar stays on screen when it ends (its last status is the run's result); when
stdout is a file or a pipe (SLURM's slurm-%j.out, `| tee`) every log step is one plain line, so
the loss history is in the output. Evaluations get a transient bar on a TTY and nothing elsewhere:
their table follows.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping

from rich.console import Console
from rich.text import Text
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, ProgressColumn, Task, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)


def step_line(row: Mapping[str, Any], total: int) -> str:
    """One training log step as a plain line: step, loss, lr, validation loss, throughput."""
    width = len(str(total))
    line = f"step {row['step']:>{width}}/{total}  loss {row['loss']:.4f}  lr {row['lr']:.2e}"
    if "val_loss" in row:
        line += f"  val_loss {row['val_loss']:.4f}"
    if row.get("skipped_steps"):
        line += f"  skipped {row['skipped_steps']}"
    return line + f"  {row['tokens_per_s']:,.0f} tok/s"


class TrainingDisplay:
    """A progress bar whose status is the last log step (TTY), or one plain line per log step."""

    def __init__(self, console: Console, total: int, start: int):
        self.console, self.total = console, total
        self.bar = console.is_terminal and not console.quiet
        self.progress = Progress(
            TextColumn("[bold blue]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[status]}"),
            TimeRemainingColumn(), console=console, transient=False,
        )
        self.task = self.progress.add_task("train", total=total, completed=start, status="")

    def __enter__(self) -> "TrainingDisplay":
        if self.bar:
            self.progress.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.bar:
            self.progress.stop()

    def advance(self) -> None:
        self.progress.advance(self.task)

    def show(self, row: Mapping[str, Any]) -> None:
        if not self.bar:
            self.console.print(step_line(row, self.total), highlight=False, soft_wrap=True)  # one line, whatever the width
            return
        status = f"loss {row['loss']:.3f}  {row['tokens_per_s']:,.0f} tok/s"
        if "val_loss" in row:
            status += f"  val {row['val_loss']:.3f}"
        self.progress.update(self.task, status=status)


class RateColumn(ProgressColumn):
    """How many units a second the work has been going at (Rich's own estimate), e.g. 12.5 examples/s."""

    def __init__(self, unit: str) -> None:
        super().__init__()
        self.unit = unit

    def render(self, task: Task) -> Text:
        speed = task.finished_speed or task.speed
        return Text("" if speed is None else f"{speed:,.1f} {self.unit}/s", style="progress.data.speed")


@contextmanager
def progress_bar(console: Console, label: str, total: int, unit: str = "steps") -> Iterator[Callable[[int], None]]:
    """A transient bar on a TTY (nothing elsewhere) with the count, the rate in `unit`s a second, the
    time taken and the time left; yields advance(n). eval-length counts forward passes with it,
    eval-task examples; any loop with a known amount of work can."""
    if not console.is_terminal or console.quiet:
        yield lambda n=1: None
        return
    progress = Progress(
        TextColumn(f"[bold blue]{label}"), BarColumn(), MofNCompleteColumn(), RateColumn(unit), TimeElapsedColumn(),
        TextColumn("eta"), TimeRemainingColumn(), console=console, transient=True,
    )
    task = progress.add_task(label, total=total)
    with progress:
        yield lambda n=1: progress.advance(task, n)
