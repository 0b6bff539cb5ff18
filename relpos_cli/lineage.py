"""Fine-tuning from a parent run: `relpos train init_from=RUN_DIR ...`.

The child starts from the parent's final weights with a fresh optimizer and schedule (steps count
from 0). Its model shape and position scheme are the parent's: keys the command line leaves alone
are taken from the parent's config, and a key it sets to another value is an error, except the
options a scheme declares as only changing how positions are used (`position_use_options`, e.g.
RoPE's `scaling`) and the model keys that hold no weights (dropout, attention backend). Training
settings (train.seq_len, train.randomized_positions, data, ...) are the child's own; a parent
with a pretrained model's tokenizer (data.tokenizer=hf, relpos import) passes it on.

The scheme itself may change in one way: to pos=none from a scheme that holds no weights
(rope, alibi, xpos, sinusoidal, sandwich), dropping the position signal and recalibrating
without it as DroPE does with RoPE; no parent weight is left unused and none is new. Every
other change of scheme is refused: the weights were trained for the parent's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from relpos_cli.checkpoint import load_checkpoint, load_config
from relpos_cli.config import flatten_config, parse_overrides, quote_path_overrides
from relpos_cli.errors import RelposError
from relpos_cli.positions import REGISTRY, build_scheme
from relpos_cli.positions.base import ModelShape

NO_WEIGHT_MODEL_KEYS = ("dropout", "attn_backend")
# a pretrained parent's own tokenizer (relpos import): its child keeps it unless data.tokenizer is set
TOKENIZER_KEYS = ("tokenizer", "tokenizer_file", "eos_token", "vocab_size")


def command_line_keys(run_dir: Path) -> set[str] | None:
    """The dotted keys (and group names: `model`, `pos`) this Hydra job's command line set; None
    outside a Hydra job (a config built in code: every key counts as set)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    hydra_cfg = HydraConfig.get()
    if Path(hydra_cfg.runtime.output_dir).resolve() != Path(run_dir).resolve():
        return None
    return {o.key_or_group.lstrip("+~") for o in parse_overrides(list(hydra_cfg.overrides.task))}


def _given(key: str, given: set[str] | None) -> bool:
    """Whether the command line set `key` (pos.scaling.type) itself, a parent of it or its group."""
    if given is None:
        return True
    parts = key.split(".")
    return any(".".join(parts[:i]) in given for i in range(1, len(parts) + 1))


def _mismatch(key: str, child: Any, parent: Any, parent_dir: Path) -> RelposError:
    return RelposError(f"init_from={parent_dir}: {key}={child} but the parent has {key}={parent}; a fine-tuned run "
                       f"keeps its parent's model shape and position scheme (drop the override)")


def inherit(cfg: DictConfig, given: set[str] | None) -> DictConfig:
    """The child's config: the parent's model shape and scheme (checked against what the command
    line set), its own training settings; init_from stored as an absolute path. The parent must
    have finished training (its checkpoint.pt is what the child starts from)."""
    parent_dir = Path(cfg.init_from).expanduser().resolve()
    try:
        parent = load_config(parent_dir, whole_run=True)
        load_checkpoint(parent_dir)  # the parent finished and its final checkpoint is readable
    except RelposError as e:
        raise RelposError(f"init_from={cfg.init_from}: {e}") from None
    cfg.init_from = str(parent_dir)

    for key in [k for k in parent.model if k not in NO_WEIGHT_MODEL_KEYS]:
        child_value, parent_value = cfg.model.get(key), parent.model[key]
        if child_value != parent_value and _given(f"model.{key}", given):
            raise _mismatch(f"model.{key}", child_value, parent_value, parent_dir)
        with open_dict(cfg.model):
            cfg.model[key] = parent_value
    # data=<source> picks the child's corpus; only data.tokenizer itself replaces the parent's tokenizer
    if parent.data.get("tokenizer") == "hf" and given is not None and "data.tokenizer" not in given:
        with open_dict(cfg.data):
            for key in TOKENIZER_KEYS:
                cfg.data[key] = parent.data.get(key)

    parent_pos = OmegaConf.to_container(parent.pos, resolve=True)
    child_pos = OmegaConf.to_container(cfg.pos, resolve=True)
    if child_pos.get("name") != parent_pos["name"] and _given("pos.name", given):
        _check_scheme_change(child_pos, parent_pos, parent, parent_dir)
        cfg.pos = OmegaConf.create(child_pos)
        return cfg
    if given is not None:
        # pos=<the parent's scheme> names the scheme (checked above); its yaml's defaults are not
        # options the command line set: the parent's own pos.keep=0.5 stays, pos.keep=0.75 is refused
        given = given - {"pos"}
    scheme = REGISTRY.get(parent_pos["name"])
    free = scheme.position_use_options if scheme else ()
    parent_flat = flatten_config(parent_pos, "pos")
    merged = dict(parent_flat)
    same_scheme = child_pos.get("name") == parent_pos["name"]
    for key, value in flatten_config(child_pos, "pos").items():
        if key not in parent_flat:
            # an option added since the parent trained: the child's value; the options of another
            # scheme (the default pos, which the command line did not name) are not the parent's
            if same_scheme or _given(key, given):
                merged[key] = value
        elif _given(key, given) and value != parent_flat[key]:
            if key.split(".")[1] not in free:
                raise _mismatch(key, value, parent_flat[key], parent_dir)
            merged[key] = value
    merged = unflatten(merged)["pos"]
    if scheme is not None:
        merged = scheme.inherit_options(merged, parent_pos, int(parent.train.seq_len))
    cfg.pos = OmegaConf.create(merged)
    return cfg


def with_parent_scheme(overrides: list[str]) -> list[str]:
    """`relpos train init_from=RUN pos.keep=0.5` composed with the parent's scheme group: without
    `pos=`, Hydra composes the default scheme's yaml, which knows no pos.keep of a p_rope parent.
    The group is added only where every pos.* option given is one of the parent's (any other key
    is refused by inherit, or Hydra, as before); a parent that cannot be read is inherit's to report.

    Args:
        overrides: the command line's key=value overrides.
    Returns:
        the overrides, with `pos=<the parent's scheme>` first where it was added."""
    parsed = parse_overrides(quote_path_overrides(overrides))
    keys = [o.key_or_group.lstrip("+~") for o in parsed]
    parents = [o.value() for o in parsed if o.key_or_group.lstrip("+") == "init_from" and not o.is_sweep_override()]
    options = {k.split(".")[1] for k in keys if k.startswith("pos.")}
    if "pos" in keys or not options or len(parents) != 1 or not parents[0]:
        return overrides
    try:
        parent_pos = load_config(Path(str(parents[0])).expanduser()).pos
    except (RelposError, OSError):
        return overrides
    if not options <= set(parent_pos):
        return overrides
    return [f"pos={parent_pos.name}", *overrides]


def _check_scheme_change(child_pos: dict[str, Any], parent_pos: dict[str, Any], parent: DictConfig, parent_dir: Path) -> None:
    """A fine-tune may drop a weightless scheme for pos=none (module docstring); anything else is refused."""
    m = parent.model
    shape = ModelShape(m.d_model, m.n_heads, m.n_layers, int(parent.train.seq_len))
    weightless = not any(True for _ in build_scheme(parent_pos, shape).parameters())
    if child_pos.get("name") != "none" or not weightless:
        raise RelposError(
            f"init_from={parent_dir}: pos={child_pos.get('name')} but the parent has pos={parent_pos['name']}; a "
            f"fine-tune keeps its parent's scheme, or drops one that holds no weights for pos=none (as DroPE drops RoPE)")


def unflatten(flat: dict[str, Any]) -> dict[str, Any]:
    """{"a.b.c": leaf} -> nested dicts (flatten_config's inverse)."""
    tree: dict[str, Any] = {}
    for key, value in flat.items():
        *parents, leaf = key.split(".")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


def parent_weights(cfg: DictConfig, vocab_size: int) -> dict[str, Any]:
    """The parent's final weights for a child whose data has `vocab_size` tokens."""
    try:
        state = load_checkpoint(Path(cfg.init_from))
    except RelposError as e:  # a resumed child that had no checkpoint yet, whose parent has gone since
        raise RelposError(f"init_from={cfg.init_from}: {e}") from None
    # a pretrained model's embedding may exceed its own tokenizer's vocabulary, never another tokenizer's
    pretrained = cfg.data.get("tokenizer") == "hf" and cfg.model.get("vocab_size")
    if state["vocab_size"] != vocab_size and not (pretrained and vocab_size <= cfg.model.vocab_size):
        raise RelposError(f"init_from={cfg.init_from}: the parent's vocabulary has {state['vocab_size']} tokens, "
                          f"this run's data {vocab_size}; fine-tune with the parent's tokenizer")
    return state["model"]
