"""Metrics go to metrics.jsonl in the run dir and to a W&B run (offline by default)."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any, Mapping

WANDB_ID_FILE = "wandb_id.txt"
WANDB_MODES = ("offline", "online", "disabled")
DEFAULT_INIT_TIMEOUT = 60.0  # seconds; conf/config.yaml's wandb.init_timeout (run configs saved before it lack it)


class Tracker:
    def __init__(self, run_dir: Path, config: Mapping[str, Any], job_type: str):
        self.run_dir = Path(run_dir)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.wandb = _init_wandb(self.run_dir, config, job_type)

    def log(self, row: Mapping[str, Any]) -> None:
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(dict(row)) + "\n")
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in row.items() if k != "step"}, step=row.get("step"))

    def finish(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()


class NullTracker:
    """What ranks other than 0 of a DDP run log to: nothing, so the run dir has one writer."""

    def log(self, row: Mapping[str, Any]) -> None:
        pass

    def finish(self) -> None:
        pass


def _init_wandb(run_dir: Path, config: Mapping[str, Any], job_type: str):
    """One W&B run per relpos run: later jobs (eval-length) resume it by the id kept in the run dir."""
    settings = config["wandb"]
    mode = settings["mode"]
    if mode not in WANDB_MODES:
        from relpos_cli.errors import RelposError

        raise RelposError(f"wandb.mode={mode!r}; choose one of: {', '.join(WANDB_MODES)}")
    if mode == "disabled":
        return None
    import wandb

    from relpos_cli.atomic import atomic_write_text
    from relpos_cli.errors import RelposError

    id_file = run_dir / WANDB_ID_FILE
    run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:8]
    atomic_write_text(id_file, run_id)
    os.environ.setdefault("WANDB_SILENT", "true")
    timeout = float(settings.get("init_timeout") or DEFAULT_INIT_TIMEOUT)
    try:
        return wandb.init(
            project=settings["project"],
            entity=settings.get("entity"),
            group=settings.get("group"),
            tags=list(settings.get("tags") or []),
            name=run_dir.name,
            id=run_id,
            resume="allow",
            dir=str(run_dir),
            mode=mode,
            job_type=job_type,
            config=dict(config),
            # bounded: without a network W&B would retry for minutes before it gives up
            settings=wandb.Settings(init_timeout=timeout),
        )
    except Exception as e:  # W&B's own errors, its settings' validation, timeouts: the W&B side of the boundary
        reason = str(e).strip().splitlines()[0].rstrip(".") if str(e).strip() else type(e).__name__
        hint = "log in (wandb login) and check the network, " if mode == "online" else ""
        raise RelposError(
            f"W&B could not start a run (wandb.mode={mode}, wandb.init_timeout={timeout:g} s): {reason}; {hint}or use "
            f"wandb.mode=offline (sync later with `wandb sync`) or wandb.mode=disabled"
        ) from None


def log_table(
    run_dir: Path, config: Mapping[str, Any], job_type: str, key: str, rows: list[Mapping[str, Any]], x: str, y: str,
    stroke: str | None = None, images: Mapping[str, Path] | None = None,
) -> None:
    """Log rows as a W&B Table plus a line plot of y against x (one line per `stroke` value) and
    PNG files as W&B Images, into the run's W&B run (or run_dir's own, for `relpos compare`)."""
    run = _init_wandb(Path(run_dir), config, job_type)
    if run is None:
        return
    import wandb

    columns = list(rows[0])
    table = wandb.Table(columns=columns, data=[[r.get(c) for c in columns] for r in rows])
    logged = {key: table, f"{key}_plot": wandb.plot.line(table, x, y, stroke=stroke, title=f"{y} vs {x}")}
    logged.update({name: wandb.Image(str(path)) for name, path in (images or {}).items()})
    run.log(logged)
    run.finish()


def log_images(run_dir: Path, config: Mapping[str, Any], job_type: str, images: Mapping[str, Path]) -> None:
    """Log PNG files as W&B images (key -> path) into the run's W&B run."""
    run = _init_wandb(Path(run_dir), config, job_type)
    if run is None:
        return
    import wandb

    run.log({key: wandb.Image(str(path)) for key, path in images.items()})
    run.finish()
