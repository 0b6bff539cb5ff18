"""What a relpos command line accepts, read from conf/: config groups with their options (pos=alibi)
and keys with their defaults (train.steps=600). Shell completion and `relpos train --help` show it.
"""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf

from relpos_cli.config import conf_dir, flatten_config


def config_groups() -> dict[str, list[str]]:
    """Each group as it is typed -> its options: `pos`, `hydra/launcher`, and `+experiment` for a
    group that is not in config.yaml's defaults (adding it takes a +)."""
    root = conf_dir()
    in_defaults = {next(iter(d)) for d in OmegaConf.to_container(OmegaConf.load(root / "config.yaml"))["defaults"]
                   if isinstance(d, dict) and not next(iter(d)).startswith("override ")}
    groups = {}
    for folder in sorted(p for p in root.rglob("*") if p.is_dir() and any(p.glob("*.yaml"))):
        name = folder.relative_to(root).as_posix()
        typed = name if name in in_defaults or "/" in name else f"+{name}"
        groups[typed] = sorted(f.stem for f in folder.glob("*.yaml"))
    return groups


def _short(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return str(value).lower() if value is not None else "null"
    if isinstance(value, list):
        return "[" + ",".join(_short(v) for v in value) + "]"
    return str(value)


def config_keys() -> dict[str, str]:
    """Every key of the default composition -> its default, as an override writes it."""
    root = conf_dir()
    top = OmegaConf.to_container(OmegaConf.load(root / "config.yaml"))
    keys = flatten_config({k: v for k, v in top.items() if k not in ("defaults", "hydra")})
    for entry in top["defaults"]:
        if isinstance(entry, dict) and not next(iter(entry)).startswith("override "):
            (group, option), = entry.items()
            keys.update(flatten_config(OmegaConf.to_container(OmegaConf.load(root / group / f"{option}.yaml")), group))
    return {k: _short(v) for k, v in sorted(keys.items())}


def complete_override(args: list[str], incomplete: str) -> list[str]:
    """Completions of one override word, given the words before it. zsh hands over `pos=al` whole.
    bash splits words at `=` (COMP_WORDBREAKS) and replaces only the text after it: `pos=<TAB>`
    arrives as the word `pos` (click drops a lone `=`), `pos=al<TAB>` as `pos` `=` `al`; there the
    values are returned alone."""
    groups, keys = config_groups(), config_keys()

    def values(key: str) -> list[str]:
        return groups.get(key) or ([keys[key]] if key in keys else [])

    if len(args) >= 2 and args[-1] == "=":
        return [v for v in values(args[-2]) if v.startswith(incomplete)]
    if args and not incomplete and values(args[-1]):  # a bare group or key word is no override: its `=` came next
        return values(args[-1])
    if "=" in incomplete:
        key, typed = incomplete.split("=", 1)
        return [f"{key}={v}" for v in values(key) if v.startswith(typed)]
    choices = [f"{g}={o}" for g, options in groups.items() for o in options] + [f"{k}={v}" for k, v in keys.items()]
    return [c for c in choices if c.startswith(incomplete)]


def groups_help() -> str:
    """`relpos train --help`'s list of config groups and their options."""
    lines = ["[bold]Config groups[/] (conf/; choose one option each, e.g. pos=alibi model=tiny):"]
    lines += [f"  {group}: {', '.join(options)}" for group, options in config_groups().items()]
    return "\n".join(lines)
