"""Where the config tree lives and how overrides are applied outside a Hydra job."""

from __future__ import annotations

from pathlib import Path

from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

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
    check_types(cfg)
    return cfg


def _reference_values(cfg: DictConfig) -> dict[str, object]:
    """key -> default value from conf/: config.yaml's own keys, every option file of a group (the
    first that has a key wins), and for pos the chosen scheme's file; keys must keep these types."""
    root = OmegaConf.load(conf_dir() / "config.yaml")
    reference = {k: v for k, v in OmegaConf.to_container(root).items() if k not in ("defaults", "hydra")}
    flat: dict[str, object] = {}

    def walk(prefix: str, node: object) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            flat.setdefault(prefix, node)

    walk("", reference)
    pos_file = conf_dir() / "pos" / f"{cfg.get('pos', {}).get('name')}.yaml"
    for group_dir in sorted(p for p in conf_dir().iterdir() if p.is_dir()):
        files = [pos_file] if group_dir.name == "pos" else sorted(group_dir.glob("*.yaml"))
        for f in (f for f in files if f.is_file()):
            walk(group_dir.name, OmegaConf.to_container(OmegaConf.load(f)))
    return flat


def _kind(value: object) -> str | None:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, list):
        return "a list"
    return None  # strings and nulls: their own checks say what is allowed


def check_types(cfg: DictConfig) -> None:
    """A value whose type differs from its default in conf/ (train.steps=abc) -> one clear line."""
    for key, default in _reference_values(cfg).items():
        expected = _kind(default)
        value = OmegaConf.select(cfg, key, default=None, throw_on_missing=False)
        if isinstance(value, (DictConfig, ListConfig)):
            value = OmegaConf.to_container(value)
        if expected is None or value is None:
            continue
        got = _kind(value)
        if got == expected or (expected == "a number" and got == "an integer"):
            if expected == "a list" and default and all(_kind(d) == "an integer" for d in default):
                bad = [v for v in value if _kind(v) != "an integer"]
                if bad:
                    raise RelposError(f"{key} must be a list of integers, got {value}")
            continue
        raise RelposError(f"{key} must be {expected}, got {value!r}")
