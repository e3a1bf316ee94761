"""The only place that formats output for people: progress on stderr, tables on stdout."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from distrib.trainer import EpochRecord, Events, TrainResult

stderr = Console(stderr=True, highlight=False, soft_wrap=True)
stdout = Console(highlight=False, soft_wrap=True)


class TrainProgress(Events):
    """A progress bar per epoch on a terminal; one line per epoch otherwise (logs, CI)."""

    def __init__(self, quiet: bool = False) -> None:
        self.quiet = quiet
        self.live = stderr.is_terminal and not quiet
        self.progress: Progress | None = None
        self.task = None

    def info(self, message: str) -> None:
        if not self.quiet:
            stderr.print(message)

    def epoch_start(self, epoch: int, epochs: int, steps: int, done: int) -> None:
        if not self.live:
            return
        self.progress = Progress(
            TextColumn(f"epoch {epoch}/{epochs}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TimeElapsedColumn(),
            console=stderr,
            transient=True,
        )
        self.progress.start()
        self.task = self.progress.add_task("train", total=steps, completed=done, loss="-")

    def step(self, epoch: int, step: int, loss: float) -> None:
        if self.progress is not None:
            self.progress.update(self.task, completed=step, loss=f"{loss:.4f}")

    def epoch_end(self, record: EpochRecord) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
        if not self.quiet:
            stderr.print(
                f"epoch {record.epoch:>3}  loss {record.train_loss:.4f}  "
                f"train {record.train_accuracy:6.2%}  test {record.test_accuracy:6.2%}  "
                f"{record.seconds:.1f}s"
            )

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


def train_summary(result: TrainResult, out: Path) -> None:
    table = Table(title="compress train", title_justify="left")
    for col in ("epoch", "train loss", "train acc", "test loss", "test acc", "seconds"):
        table.add_column(col, justify="right")
    for r in result.history:
        table.add_row(
            str(r.epoch),
            f"{r.train_loss:.4f}",
            f"{r.train_accuracy:.2%}",
            f"{r.test_loss:.4f}",
            f"{r.test_accuracy:.2%}",
            f"{r.seconds:.2f}",
        )
    stdout.print(table)
    stdout.print(
        f"test accuracy {result.test_accuracy:.2%} after {result.epochs} epochs, "
        f"{result.seconds:.1f}s training; checkpoint: {out}"
    )
