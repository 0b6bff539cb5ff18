"""Run directories: the resolved config, the final checkpoint that eval-length loads, and the
periodic resumable checkpoints (checkpoints/step_*.pt) with everything exact resume needs."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np

import torch
from omegaconf import DictConfig, OmegaConf

from relpos_cli.atomic import atomic_write_text, atomic_writer
from relpos_cli import kernels
from relpos_cli.config import (apply_overrides, check_override_keys, saved_run_defaults, validate_run_config,
                               with_renamed_keys)
from relpos_cli.console import print_note
from relpos_cli.data import load_token_data
from relpos_cli.positions import with_added_options
from relpos_cli.errors import RelposError
from relpos_cli.extension import eval_method, resolve_longest_factor
from relpos_cli.model import Transformer, build_model
from relpos_cli.results import CHECKPOINT_DIR, CHECKPOINT_FILE, CONFIG_FILE, FAILED_FILE, METRICS_FILE, read_metrics



def save_config(run_dir: Path, cfg: DictConfig) -> None:
    atomic_write_text(run_dir / CONFIG_FILE, OmegaConf.to_yaml(cfg, resolve=True))


def load_config(run_dir: Path, whole_run: bool = False) -> DictConfig:
    """A run's saved config, with the keys added since it was saved at the values it meant.
    whole_run: for commands that rebuild the trained model (evaluate, sample, resume, init_from),
    refuse a config.yaml that is not all there (check_complete)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise RelposError(f"run dir not found: {run_dir}")
    path = run_dir / CONFIG_FILE
    if not path.is_file():
        raise RelposError(f"{run_dir} is not a relpos run (no {CONFIG_FILE})")
    cfg = read_config(path)
    if whole_run:
        check_complete(path, cfg)
    return as_current(cfg, run_dir)


def as_current(saved: Any, run_dir: Path) -> DictConfig:
    """A run config as saved (config.yaml, or the one a checkpoint holds) read as today's relpos reads it."""
    # a run saved before a key existed meant its default: resume, eval and the schema see it; one
    # saved before a key was renamed meant the new name
    cfg = OmegaConf.merge(saved_run_defaults(), with_renamed_keys(OmegaConf.create(saved)))
    if "pos" in cfg:  # likewise a scheme option: the value that reproduces how the run was trained
        cfg.pos = OmegaConf.create(with_added_options(OmegaConf.to_container(cfg.pos)))
    tokenizer_file = OmegaConf.select(cfg, "data.tokenizer_file", default=None)
    if tokenizer_file and not Path(tokenizer_file).is_absolute():
        # an imported run names its own tokenizer.json relative to itself: the run dir may move
        cfg.data.tokenizer_file = str((Path(run_dir) / tokenizer_file).resolve())
    return cfg


def read_config(path: Path) -> Any:
    """A run's config.yaml as saved; RelposError (one line) if it does not parse (cut mid-key, edited)."""
    try:
        return OmegaConf.load(path)
    except OSError:
        raise
    except Exception as e:
        raise RelposError(f"{path}: unreadable config ({str(e).splitlines()[0]})") from None


# what every saved run config holds; wandb is its last key (saved since the first version), so a
# config.yaml cut short (a full disk, an interrupted copy) lacks it even when what is left parses
SAVED_KEYS = ("pos.name", "train.seq_len", "wandb")


def check_complete(path: Path, cfg: Any) -> None:
    """A run's config.yaml holds every section a saved run has, before today's defaults fill gaps:
    a truncated file must not be read as a run with default settings."""
    missing = [k for k in SAVED_KEYS if not isinstance(cfg, DictConfig) or OmegaConf.select(cfg, k) is None]
    if missing:
        raise RelposError(f"{path} is incomplete (it lacks {', '.join(missing)}): cut short by a full disk or an "
                          f"interrupted copy? Restore it from a copy of the run")


def save_torch_file(path: Path, state: dict[str, Any]) -> None:
    """torch.save of `state` to `path`, atomically, streamed to the file: serialised into memory first,
    a checkpoint took twice its size again there (the buffer and its bytes) while the model, and in
    training the optimizer, were still held."""
    with atomic_writer(path) as f:
        try:
            torch.save(state, f)
        except RuntimeError as e:
            # torch's zip writer reports a failed write (a full disk) as a RuntimeError about positions; the
            # OSError behind it is what atomic_writer names the file for, and what the CLI says in one line
            if isinstance(e.__context__, OSError):
                raise e.__context__ from None
            raise


def save_checkpoint(run_dir: Path, state: dict[str, Any]) -> None:
    save_torch_file(Path(run_dir) / CHECKPOINT_FILE, state)


def load_checkpoint(run_dir: Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """The final checkpoint, for evaluation. No fallback to a periodic one here: that model is not
    the trained run; resume rewrites a corrupt final checkpoint from the newest intact periodic one."""
    path = Path(run_dir) / CHECKPOINT_FILE
    if not path.is_file():
        if periodic_checkpoints(run_dir):
            raise RelposError(f"{run_dir} did not finish training; continue it with: relpos train resume={run_dir}")
        raise RelposError(f"{run_dir} has no {CHECKPOINT_FILE}: was its training finished?")
    try:
        return _load(path, map_location)
    except RelposError as e:
        fix = f"; relpos train resume={run_dir} retrains it from the newest intact periodic checkpoint"
        raise RelposError(f"{e}{fix if periodic_checkpoints(run_dir) else ''}") from None


def _load(path: Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """A checkpoint, verified: it unpickles (a truncated zip does not) and holds a step and weights."""
    try:
        state = torch.load(path, map_location=map_location, weights_only=False)
    except OSError as e:
        if e.filename is not None:  # the file could not be opened: a fault of the file system, not of the file
            raise
        # torch's zip reader says EINVAL, naming no file, for some cut points of a truncated checkpoint
        raise RelposError(f"{path}: corrupt checkpoint ({e.strerror or type(e).__name__})") from None
    except Exception as e:
        first = str(e).splitlines()[0].split(". ")[0][:120] if str(e) else type(e).__name__
        raise RelposError(f"{path}: corrupt checkpoint ({first})") from None
    if not isinstance(state, dict) or not {"step", "model", "vocab_size"} <= set(state):
        raise RelposError(f"{path}: corrupt checkpoint (not a relpos training state)")
    return state


def load_trained_model(run_dir: Path, device: torch.device, cfg: DictConfig | None = None) -> tuple[DictConfig, Transformer]:
    """A finished run's model, for inference (eval-length, eval-task, inspect, sample, load_run),
    built with the evaluation method its eval settings ask for (eval.rope_scaling, eval.self_extend,
    eval.rerope, eval.window: relpos_cli/extension.py), so every command scores the same model for
    the same settings. cfg: the run's config with the command's overrides applied (default: the
    saved one); eval.rope_scaling.factor=longest, if not resolved yet, is resolved from eval.lengths."""
    cfg = load_config(run_dir, whole_run=True) if cfg is None else cfg
    train_len = int(cfg.train.seq_len)
    resolve_longest_factor(cfg.eval, max([train_len, *(int(l) for l in cfg.eval.get("lengths") or [])]), train_len)
    if cfg.model.get("attn_backend") == "fused" and not kernels.available(device.type == "cuda"):
        # a backend picks kernels, not the model: a run trained with the fused kernels on a GPU evaluates anywhere
        print_note(f"{run_dir} was trained with model.attn_backend=fused, whose Triton kernels run on CUDA; "
                   f"on {device.type} it runs with auto (the same model)")
        cfg.model.attn_backend = "auto"
    state = load_checkpoint(run_dir, map_location=device)
    model = build_model(cfg, state["vocab_size"], eval_method(cfg.eval)).to(device)
    load_weights(model, state["model"], Path(run_dir) / CHECKPOINT_FILE, Path(run_dir) / CONFIG_FILE)
    model.eval()
    return cfg, model


def load_weights(model: torch.nn.Module, weights: dict[str, Any], source: Path, config: Path) -> None:
    """model.load_state_dict(weights), a checkpoint that does not fit the model its config builds (a
    config.yaml edited or copied from another run) as one line naming the first misfit."""
    try:
        model.load_state_dict(weights)
    except RuntimeError as e:
        details = [l.strip().rstrip(".") for l in str(e).splitlines()[1:] if l.strip()]
        first = details[0] if details else str(e).splitlines()[0]
        more = f" and {len(details) - 1} more" if len(details) > 1 else ""
        raise RelposError(f"{source} does not fit the model {config} describes ({first}{more}); "
                          f"was {config.name} edited or copied from another run?") from None


def load_run(run_dir: Path | str, device: str | torch.device = "cpu", overrides: list[str] | tuple[str, ...] = ()
             ) -> tuple[Transformer, Any, DictConfig]:
    """A finished run, trained or imported (`relpos import`), for a notebook: (model, tokenizer, config).

    model(tokens) maps token ids (B, T) to logits (B, T, V), in eval mode; tokenizer.encode(text) ->
    ids and tokenizer.decode(ids) -> text are the run's own (bytes, its BPE, or a pretrained model's);
    config is the run's config (a DictConfig: model, pos, train.seq_len, data, ...). overrides:
    eval.* settings as on the command line (["eval.self_extend.group=8", "eval.self_extend.window=64"]):
    the model eval-length scores with those settings."""
    cfg = None
    if overrides:
        check_override_keys(list(overrides), ("eval.*",), "load_run")
        cfg = apply_overrides(load_config(Path(run_dir), whole_run=True), list(overrides))
        validate_run_config(cfg)
    cfg, model = load_trained_model(Path(run_dir), torch.device(device), cfg)
    tokenizer = load_token_data(OmegaConf.to_container(cfg.data, resolve=True)).tokenizer
    return model, tokenizer, cfg


# ---- resumable training state -------------------------------------------------------------------


def rng_states(generators: dict[str, torch.Generator]) -> dict[str, Any]:
    """Every random stream a training step can touch: the run's own generators (the data sampler's,
    the batch plan's) and the global ones."""
    states = {
        **{name: g.get_state() for name, g in generators.items()},
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_rng_states(states: dict[str, Any], generators: dict[str, torch.Generator]) -> None:
    """A generator a checkpoint has no state for (saved before it existed) was never drawn from."""
    for name, g in generators.items():
        if name in states:
            g.set_state(states[name])
    torch.set_rng_state(states["torch"])
    np.random.set_state(states["numpy"])
    random.setstate(states["python"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def periodic_checkpoints(run_dir: Path) -> list[Path]:
    """checkpoints/step_*.pt, oldest first."""
    return sorted((Path(run_dir) / CHECKPOINT_DIR).glob("step_*.pt"), key=lambda p: int(p.stem.split("_")[1]))


def save_periodic_checkpoint(run_dir: Path, state: dict[str, Any], keep: int) -> Path:
    """Write checkpoints/step_N.pt atomically, then drop all but the newest `keep` of them."""
    path = Path(run_dir) / CHECKPOINT_DIR / f"step_{state['step']:08d}.pt"
    save_torch_file(path, state)
    for old in periodic_checkpoints(run_dir)[: -max(1, keep)]:
        old.unlink(missing_ok=True)
    return path


def remove_partial_writes(run_dir: Path) -> None:
    """Temp files left by a process killed in the middle of an atomic write are never loaded: drop them
    (checkpoint.pt's among them, as large as the checkpoint itself)."""
    for folder in (Path(run_dir), Path(run_dir) / CHECKPOINT_DIR):
        for tmp in folder.glob(".*.tmp"):
            tmp.unlink(missing_ok=True)


def holds_training_state(run_dir: Path) -> bool:
    return (Path(run_dir) / CHECKPOINT_FILE).is_file() or bool(periodic_checkpoints(run_dir))


def latest_training_state(run_dir: Path, map_location: str | torch.device = "cpu") -> tuple[Path, dict[str, Any]] | None:
    """The newest intact resumable state: the final checkpoint if training finished, else the newest
    periodic one. A corrupt or truncated one is passed over, with a one-line note saying which state
    is used instead; if every checkpoint is corrupt, the error names them."""
    final = Path(run_dir) / CHECKPOINT_FILE
    candidates = ([final] if final.is_file() else []) + periodic_checkpoints(run_dir)[::-1]
    corrupt = []
    for path in candidates:
        try:
            state = _load(path, map_location)
        except RelposError as e:
            corrupt.append(str(e))
            continue
        if corrupt:
            print_note(f"{'; '.join(corrupt)}: resuming from {path} (step {state['step']}) instead")
        return path, state
    if corrupt:
        raise RelposError(f"{'; '.join(corrupt)}; no intact checkpoint is left: delete them to train {run_dir} again")
    return None


def truncate_metrics(run_dir: Path, step: int) -> None:
    """Keep only metrics.jsonl rows up to `step` (and no half-written line), so a resumed run appends
    exactly the steps that follow: no duplicated or missing steps."""
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return
    atomic_write_text(path, "".join(json.dumps(row) + "\n" for row in read_metrics(run_dir) if row.get("step", 0) <= step))


def mark_failed(run_dir: Path, error: BaseException, overrides: list[str]) -> None:
    """failed.json in the run dir: a job that failed (and its overrides), for `relpos compare` and people.
    Best effort: on a full disk or in a read-only dir the error itself is what the user needs to see."""
    message = str(error).splitlines()[0] if str(error) else type(error).__name__
    info = {"error": message, "type": type(error).__name__, "overrides": overrides}
    try:
        atomic_write_text(Path(run_dir) / FAILED_FILE, json.dumps(info, indent=2))
    except OSError:
        pass
