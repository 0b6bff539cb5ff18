"""Where the config tree lives and how overrides are applied outside a Hydra job."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

from relpos_cli.atomic import atomic_write_text
from relpos_cli.errors import RelposError
from relpos_cli.renamed import RENAMED_KEYS, renamed_overrides
from relpos_cli.rope_options import check_rope_scaling, check_scaling_takes_effect
from relpos_cli.settings import ADDED_KEYS, model_option_defaults, validate


def conf_dir() -> Path:
    """The config tree, relpos_cli/conf: package data, the same in a checkout and a wheel."""
    root = Path(__file__).resolve().parent / "conf"
    if not (root / "config.yaml").is_file():
        raise RelposError(f"config tree not found at {root}; reinstall relpos")
    return root


def default_group(group: str, option: str = "default") -> DictConfig:
    return OmegaConf.load(conf_dir() / group / f"{option}.yaml")


def with_renamed_keys(cfg: DictConfig) -> DictConfig:
    """A saved config with its renamed keys (RENAMED_KEYS) under their new names, in place; a
    section left empty by the move is dropped."""
    missing = object()
    with open_dict(cfg):
        for old, new in RENAMED_KEYS.items():
            value = OmegaConf.select(cfg, old, default=missing)
            if value is missing:
                continue
            OmegaConf.update(cfg, new, value, force_add=True)
            section, _, leaf = old.rpartition(".")
            parent = OmegaConf.select(cfg, section)
            parent.pop(leaf)
            if not parent:
                grand, _, name = section.rpartition(".")
                (OmegaConf.select(cfg, grand) if grand else cfg).pop(name)
    return cfg


def apply_overrides(cfg: DictConfig, overrides: list[str]) -> DictConfig:
    """Apply `key=value` overrides (Hydra's grammar) to a saved run config; the caller validates the result."""
    missing = object()
    for o in parse_overrides(renamed_overrides(overrides, note=False)):
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


def bad_override(error: Exception) -> str:
    """Hydra's override parser's error as one line that says what an override looks like."""
    lines = str(error).splitlines() or [type(error).__name__]
    first = lines[0].replace("LexerNoViableAltException: ", "cannot parse ")
    return f"bad override: {first} (overrides look like key=value, key=[1,2], -m key=a,b)"


def parse_overrides(overrides: list[str]) -> list:
    try:
        return OverridesParser.create().parse_overrides(overrides)
    except Exception as e:
        raise RelposError(bad_override(e)) from None


def override_keys(overrides: list[str]) -> set[str]:
    """The keys the overrides set (`+key=`, `~key` as key): which settings the command line names."""
    return {o.key_or_group.lstrip("+~") for o in parse_overrides(overrides)}


def check_override_keys(overrides: list[str], allowed: tuple[str, ...], command: str) -> None:
    """A command that reads a trained run takes only the keys it uses (`eval.*`, `device`, ...): any
    other key would be ignored, or would label results with settings the run was never trained with.
    `allowed` holds keys and `section.*` patterns."""
    for o in parse_overrides(overrides):
        key = o.key_or_group.lstrip("+~")
        if not any(key == a or (a.endswith(".*") and key.startswith(a[:-1])) for a in allowed):
            raise RelposError(
                f"relpos {command} takes only {', '.join(allowed)} overrides, not {o.input_line!r}: the run keeps "
                f"the settings it was trained with (train a new run to change them)"
            )


# keys whose values are paths: a sweep's run dirs are named `0_pos=rope,seed=0`, which Hydra's
# override grammar would read as more overrides, so such a value is quoted before Hydra parses it
PATH_KEYS = ("init_from",)


def quote_path_overrides(overrides: list[str]) -> list[str]:
    """`init_from=outputs/x/0_pos=rope,seed=0` as `init_from='outputs/x/0_pos=rope,seed=0'`."""
    quoted = []
    for o in overrides:
        key, _, value = o.partition("=")
        if key.lstrip("+~") in PATH_KEYS and value and value[0] not in "'\"" and "'" not in value:
            o = f"{key}='{value}'"
        quoted.append(o)
    return quoted


def saved_run_defaults() -> DictConfig:
    """What a run config saved before a key existed meant: config.yaml's own keys (seed, wandb.*),
    the train, eval and inspect defaults, and the data keys added since (settings.ADDED_KEYS). Merged
    under every saved config, so old runs resume, evaluate and validate."""
    root = OmegaConf.load(conf_dir() / "config.yaml")
    defaults = {k: v for k, v in root.items() if k not in ("defaults", "hydra")}
    for group in ("train", "eval", "inspect"):
        defaults[group] = default_group(group)
    defaults["data"] = dict(ADDED_KEYS)
    defaults["model"] = model_option_defaults()
    return OmegaConf.create(defaults)


def flatten_config(node: object, prefix: str = "") -> dict[str, object]:
    """Nested dicts -> {"a.b.c": leaf}; lists stay leaves."""
    if isinstance(node, dict):
        return {k: v for key, child in node.items() for k, v in flatten_config(child, f"{prefix}.{key}" if prefix else str(key)).items()}
    return {prefix: node}


def canonical_numbers(flat: dict[str, object]) -> dict[str, object]:
    """A flat config with every float of integral value written as the int (2.0 -> 2): a setting
    given as 2 or 2.0 is one setting, with one variant name, one compare row and one label. Only for
    telling settings apart, never for writing a config back (a float option stays a float there)."""
    def canonical(value: object) -> object:
        if isinstance(value, list):
            return [canonical(v) for v in value]
        return int(value) if isinstance(value, float) and value.is_integer() else value

    return {k: canonical(v) for k, v in flat.items()}


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


def check_scheme_types(cfg: DictConfig) -> None:
    """pos.* against the types of the chosen scheme's conf/pos/<name>.yaml (pos.num_buckets=abc), and
    DAPE's pos.base_options.* against its base's (pos.base_options.shared_layers=no): the scheme's
    constructor checks the values, relpos_cli.settings every other section."""
    _check_option_types(cfg, OmegaConf.select(cfg, "pos.name", default=None), "pos")
    if OmegaConf.select(cfg, "pos.base_options", default=None) is not None:
        _check_option_types(cfg, OmegaConf.select(cfg, "pos.base", default=None), "pos.base_options")


def _check_option_types(cfg: DictConfig, name: Any, prefix: str) -> None:
    """The keys under `prefix` against the types of scheme `name`'s yaml."""
    path = conf_dir() / "pos" / f"{name}.yaml"
    if not isinstance(name, str) or not path.is_file():
        return  # build_scheme names the registered schemes
    defaults = flatten_config(OmegaConf.to_container(OmegaConf.load(path)), prefix)
    missing = object()
    for key, default in defaults.items():
        value = OmegaConf.select(cfg, key, default=missing, throw_on_missing=False)
        if value is missing:
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


def check_pos_scaling_takes_effect(cfg: DictConfig) -> None:
    """pos.scaling options that its type never reads (pos.scaling.factor=4 without a type, a YaRN beta
    under linear) refused in one line, as eval.rope_scaling's are: config.yaml and compare's labels
    would name a scaling the run never trained with. For a fresh run; an init_from child carries its
    parent's options (relpos_cli/lineage.py)."""
    scaling = OmegaConf.select(cfg, "pos.scaling", default=None)
    path = conf_dir() / "pos" / f"{cfg.pos.name}.yaml"
    defaults = OmegaConf.select(OmegaConf.load(path), "scaling") if path.is_file() else None
    if scaling is None or defaults is None:
        return  # build_scheme names the registered schemes, and refuses pos.scaling on one without it
    options = OmegaConf.to_container(scaling, resolve=True)
    check_rope_scaling(options, "pos.scaling")  # an impossible value is said as such first
    if options.get("type", "none") != "none":
        options.pop("original_length", None)  # every type but none scales from it
    check_scaling_takes_effect(options, defaults, "pos.scaling")


def validate_run_config(cfg: DictConfig) -> None:
    """Every section of a run config: the schema (relpos_cli.settings) and the scheme's value types."""
    validate(cfg)
    check_scheme_types(cfg)


def check_group_overrides(overrides: list[str]) -> None:
    """`data=null` or `train=1`: a config group takes the name of one of its options."""
    groups = {p.name for p in conf_dir().iterdir() if p.is_dir()}
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception:
        return  # Hydra reports grammar errors itself; they are rewritten with the others
    for o in parsed:
        if not o.key_or_group:  # `+=`: Hydra's own assertion would end in a traceback
            raise RelposError(f"bad override {o.input_line!r}: no key before '='")
        if o.key_or_group in groups and not o.is_delete() and not o.is_sweep_override():
            if not isinstance(o.value(), str):
                options = sorted(f.stem for f in (conf_dir() / o.key_or_group).glob("*.yaml"))
                raise RelposError(f"{o.key_or_group}= takes one of: {', '.join(options)}; got {o.value()!r}")


def sweep_jobs(overrides: list[str], params: dict | None) -> list[str]:
    """The jobs of a multirun with these command-line overrides and sweeper params (a preset's
    hydra.sweeper.params), in the order Hydra's basic sweeper runs them (job number = index), each as
    its swept values ("pos=rope,seed=1")."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    params = dict(params or {})
    swept = {o.key_or_group for o in parse_overrides(overrides) if o.is_sweep_override()} | set(params)
    arguments = [f"{k}={v}" for k, v in params.items()] + list(overrides)
    batches = BasicSweeper.split_arguments(parse_overrides(arguments), None)
    return [",".join(o for o in job if o.split("=")[0].lstrip("+~") in swept) for batch in batches for job in batch]


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


HYDRA_RECORD_DIR = ".hydra"


def save_hydra_record(run_dir: Path, cfg: DictConfig) -> None:
    """Hydra's record of a job (.hydra/config.yaml, hydra.yaml, overrides.yaml), written once the job
    holds its run dir rather than by Hydra before the job starts (hydra.output_subdir is null in
    conf/config.yaml): a job refused a dir must not rewrite the record of the run already there.
    Nothing outside a Hydra job, or where hydra.output_subdir was set back."""
    from hydra.core.hydra_config import HydraConfig


    if not HydraConfig.initialized():
        return
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.output_subdir is not None or Path(hydra_cfg.runtime.output_dir).resolve() != Path(run_dir).resolve():
        return  # Hydra wrote it itself, or this is not the job Hydra last ran (resume= in the same process)
    record = Path(run_dir) / HYDRA_RECORD_DIR
    files = {
        "config.yaml": cfg,
        "hydra.yaml": OmegaConf.create({"hydra": hydra_cfg}),
        "overrides.yaml": OmegaConf.create(list(hydra_cfg.overrides.task)),
    }
    for name, node in files.items():
        atomic_write_text(record / name, OmegaConf.to_yaml(node))
