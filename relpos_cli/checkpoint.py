"""Run directories: the resolved config and the checkpoint that eval-length and inspect load."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from relpos_cli.atomic import atomic_write_bytes, atomic_write_text
from relpos_cli.errors import RelposError
from relpos_cli.model import Transformer, build_model

CONFIG_FILE = "config.yaml"
CHECKPOINT_FILE = "checkpoint.pt"


def save_config(run_dir: Path, cfg: DictConfig) -> None:
    atomic_write_text(run_dir / CONFIG_FILE, OmegaConf.to_yaml(cfg, resolve=True))


def load_config(run_dir: Path) -> DictConfig:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise RelposError(f"run dir not found: {run_dir}")
    path = run_dir / CONFIG_FILE
    if not path.is_file():
        raise RelposError(f"{run_dir} is not a relpos run (no {CONFIG_FILE})")
    try:
        return OmegaConf.load(path)
    except Exception as e:
        raise RelposError(f"{path}: unreadable config ({str(e).splitlines()[0]})") from None


def save_checkpoint(run_dir: Path, state: dict[str, Any]) -> None:
    buf = io.BytesIO()
    torch.save(state, buf)
    atomic_write_bytes(Path(run_dir) / CHECKPOINT_FILE, buf.getvalue())


def load_checkpoint(run_dir: Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    path = Path(run_dir) / CHECKPOINT_FILE
    if not path.is_file():
        raise RelposError(f"{run_dir} has no {CHECKPOINT_FILE}: was its training finished?")
    try:
        return torch.load(path, map_location=map_location, weights_only=False)
    except Exception as e:
        raise RelposError(f"{path}: corrupt checkpoint ({str(e).splitlines()[0][:120]})") from None


def load_trained_model(run_dir: Path, device: torch.device) -> tuple[DictConfig, Transformer]:
    cfg = load_config(run_dir)
    state = load_checkpoint(run_dir, map_location=device)
    model = build_model(cfg, state["vocab_size"]).to(device)
    model.load_state_dict(state["model"])
    model.eval()
    return cfg, model
