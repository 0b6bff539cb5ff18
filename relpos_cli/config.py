"""Where the config tree lives and how overrides are applied outside a Hydra job."""

from __future__ import annotations

from pathlib import Path

from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf, open_dict

from relpos_cli.errors import RelposError


def conf_dir() -> Path:
    """conf/ beside the package in a checkout or editable install; relpos_cli/conf in a wheel."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "conf", here.parent / "conf"):
        if (candidate / "config.yaml").is_file():
            return candidate
    raise RelposError(f"config tree not found next to {here}; reinstall relpos")


def default_group(group: str, option: str = "default") -> DictConfig:
    return OmegaConf.load(conf_dir() / group / f"{option}.yaml")


def apply_overrides(cfg: DictConfig, overrides: list[str]) -> DictConfig:
    """Apply `key=value` overrides (Hydra's grammar) to a saved run config."""
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception as e:
        raise RelposError(f"bad override: {str(e).splitlines()[0]}") from None
    missing = object()
    for o in parsed:
        key = o.key_or_group
        if o.is_delete():
            raise RelposError(f"cannot delete {key} from a saved run config")
        if OmegaConf.select(cfg, key, default=missing) is missing and not (o.is_add() or o.is_force_add()):
            raise RelposError(f"unknown config key {key!r} (prefix it with + to add a new key)")
        try:
            with open_dict(cfg):
                OmegaConf.update(cfg, key, o.value(), merge=True)
        except Exception as e:
            raise RelposError(f"cannot set {key}: {str(e).splitlines()[0]}") from None
    return cfg


def resolve_sweep_dir(overrides: list[str]) -> Path:
    """The hydra.sweep.dir a multirun with these overrides will use, resolved once (${now:} included)."""
    from hydra import compose, initialize_config_dir

    try:
        # one value per key is enough to resolve the path: sweep overrides (a,b or range) are left out
        single = [o.input_line for o in OverridesParser.create().parse_overrides(overrides) if not o.is_sweep_override()]
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
            cfg = compose("config", overrides=single, return_hydra_config=True)
    except Exception as e:
        raise RelposError(f"bad sweep overrides: {str(e).splitlines()[0]}") from None
    return Path(str(cfg.hydra.sweep.dir))
