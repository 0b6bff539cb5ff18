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
    check_types(cfg, require_all=False)
    return cfg


def flatten_config(node: object, prefix: str = "") -> dict[str, object]:
    """Nested dicts -> {"a.b.c": leaf}; lists stay leaves."""
    if isinstance(node, dict):
        return {k: v for key, child in node.items() for k, v in flatten_config(child, f"{prefix}.{key}" if prefix else str(key)).items()}
    return {prefix: node}


def _reference_values(cfg: DictConfig) -> tuple[dict[str, object], set[str]]:
    """(key -> default value, required keys) from conf/: config.yaml's own keys, every option file of
    a group (the first that has a key gives its type; keys in all of them are required), and for pos
    the chosen scheme's file. A composed config must keep these keys and their types."""
    root = OmegaConf.to_container(OmegaConf.load(conf_dir() / "config.yaml"))
    defaults = flatten_config({k: v for k, v in root.items() if k not in ("defaults", "hydra")})
    required = set(defaults)
    pos_name = OmegaConf.select(cfg, "pos.name", default=None)
    # groups with a key of their own (not global-package ones such as experiment/, hydra/)
    for group_dir in sorted(p for p in conf_dir().iterdir() if p.is_dir() and p.name in cfg):
        files = [group_dir / f"{pos_name}.yaml"] if group_dir.name == "pos" else sorted(group_dir.glob("*.yaml"))
        options = [flatten_config(OmegaConf.to_container(OmegaConf.load(f)), group_dir.name) for f in files if f.is_file()]
        for option in options:
            for key, value in option.items():
                defaults.setdefault(key, value)
        if options:
            required |= set.intersection(*(set(o) for o in options))
    return defaults, required


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


def _fits(value: object, expected: str) -> bool:
    got = _kind(value)
    return got == expected or (expected == "a number" and got == "an integer")


def check_types(cfg: DictConfig, require_all: bool = True) -> None:
    """A deleted key (~train.lr; only if require_all: saved run configs may predate a key) or a
    value whose type differs from its default in conf/ (train.steps=abc, =null, train.betas=[a])
    -> one clear line."""
    missing = object()
    defaults, required = _reference_values(cfg)
    for key, default in defaults.items():
        value = OmegaConf.select(cfg, key, default=missing, throw_on_missing=False)
        if value is missing:
            if require_all and key in required:
                raise RelposError(f"config key {key} is missing (deleted with ~?); it is needed")
            continue
        if isinstance(value, (DictConfig, ListConfig)):
            value = OmegaConf.to_container(value)
        expected = _kind(default)
        if expected is None:
            continue
        if not _fits(value, expected):
            raise RelposError(f"{key} must be {expected}, got {value!r}")
        item_kinds = {_kind(d) for d in default} if expected == "a list" else set()
        if len(item_kinds) == 1 and None not in item_kinds:
            item_kind = item_kinds.pop()
            if not all(_fits(v, item_kind) for v in value):
                raise RelposError(f"{key} must be a list of {item_kind.split(' ', 1)[1]}s, got {value}")


def check_group_overrides(overrides: list[str]) -> None:
    """`data=null` or `train=1`: a config group takes the name of one of its options."""
    groups = {p.name for p in conf_dir().iterdir() if p.is_dir()}
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception:
        return  # Hydra reports grammar errors itself; they are rewritten with the others
    for o in parsed:
        if o.key_or_group in groups and not o.is_delete() and not o.is_sweep_override():
            if not isinstance(o.value(), str):
                options = sorted(f.stem for f in (conf_dir() / o.key_or_group).glob("*.yaml"))
                raise RelposError(f"{o.key_or_group}= takes one of: {', '.join(options)}; got {o.value()!r}")


def resolve_sweep_dir(overrides: list[str]) -> Path:
    """The hydra.sweep.dir a multirun with these overrides will use, resolved once (${now:} included).

    Composed as its first job is: the first value of every sweep override and of the preset's
    sweeper params (a task.* key needs the task its sweep chooses)."""
    from hydra import compose, initialize_config_dir

    parser = OverridesParser.create()

    def first_values(lines: list[str]) -> list[str]:
        return [f"{o.get_key_element()}={next(iter(o.sweep_string_iterator()))}" if o.is_sweep_override() else o.input_line
                for o in parser.parse_overrides(lines)]

    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
            groups = [o for o in first_values(overrides) if "." not in o.split("=", 1)[0] or o.startswith("hydra.")]
            params = compose("config", overrides=groups, return_hydra_config=True).hydra.sweeper.params or {}
            preset = first_values([f"{k}={v}" for k, v in params.items()])
            cfg = compose("config", overrides=[*preset, *first_values(overrides)], return_hydra_config=True)
    except Exception as e:
        raise RelposError(f"bad sweep overrides: {str(e).splitlines()[0]}") from None
    return Path(str(cfg.hydra.sweep.dir))
