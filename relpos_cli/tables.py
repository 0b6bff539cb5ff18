"""Tables that read at 80 columns: configurations named by what tells them apart, values written short.

Also the table of registered position schemes (`relpos schemes`).

A sweep's resolved configs differ in keys a user chose (pos.name, train.seq_len), in keys that
follow from them (pos.base exists only for rope), and in keys that change together (the `extend`
children differ from their parent in seq_len, batch size, steps, lr and warm-up at once).
`configuration_labels` names each configuration by a run's own `name` where it has one, otherwise by
the fewest keys that tell all configurations apart, chosen shortest first (`rope`, `alibi,
seq_len=256`, `seq_len=256, type=yarn`); `shared_settings` says once what every row has in common.
Compare tables, legends and any other per-configuration table (accuracy per length) call them.
"""

from __future__ import annotations

import json
import math
from typing import Any, Mapping, Sequence

from omegaconf import OmegaConf
from rich.table import Table
from rich.text import Text

from relpos_cli.config import conf_dir, default_group
from relpos_cli.errors import RelposError
from relpos_cli.positions import REGISTRY, build_scheme, scheme_names
from relpos_cli.positions.base import ModelShape
from relpos_cli.results import DEFAULT_VARIANT

MAX_VALUE_CHARS = 24


def short_value(value: Any) -> str:
    """A config value as few characters as say it: 10000.0 -> 10000, paths -> their file name."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(short_value(v) for v in value) + "]"
    if isinstance(value, dict):  # a fine-tuned run's parent, as it differs from the run (runs.parent_differences)
        text = "(" + ", ".join(f"{k.rsplit('.', 1)[-1]}={short_value(v)}" for k, v in value.items()) + ")"
        return text if len(text) <= MAX_VALUE_CHARS else text[:MAX_VALUE_CHARS - 2] + "…)"
    text = str(value)
    if "/" in text.rstrip("/"):
        text = text.rstrip("/").rsplit("/", 1)[1]
    if len(text) > MAX_VALUE_CHARS:
        half = (MAX_VALUE_CHARS - 1) // 2
        text = f"{text[:half]}…{text[-half:]}"
    return text


def _text(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def label_keys(flat_configs: Sequence[Mapping[str, Any]], differing: Sequence[str]) -> list[str]:
    """The differing keys a label needs: a key under a group whose `name` also differs (pos.base,
    pos.scaling.type beside pos.name) is left out unless it differs between configs of the same name."""
    kept = []
    for key in differing:
        parts = key.split(".")
        groups = [".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)]  # pos.scaling, then pos
        name_key = next((f"{g}.name" for g in groups if f"{g}.name" in differing and f"{g}.name" != key), None)
        if name_key:
            values_by_name: dict[str, set[str]] = {}
            for flat in flat_configs:
                values_by_name.setdefault(_text(flat.get(name_key)), set()).add(_text(flat.get(key, "<unset>")))
            if all(len(values) == 1 for values in values_by_name.values()):
                continue
        kept.append(key)
    return kept


def _key_names(keys: Sequence[str]) -> dict[str, str]:
    """Each key's shortest unambiguous name: its last part (seq_len) unless another key shares it."""
    leaves = [k.rsplit(".", 1)[-1] for k in keys]
    return {k: (leaf if leaves.count(leaf) == 1 else k) for k, leaf in zip(keys, leaves)}


NAME_KEY = "name"  # a run's own short name (relpos train name=..., relpos import ... name=...)
# keys a reader looks for first: preferred when several keys tell the same rows apart
HEADLINE_KEYS = ("train.seq_len", "task.name", "data.source", "data.name", "model.d_model", "model.n_layers", "init_from")
# what every row of a comparison shares, said once under the table when all rows agree on it (the task is
# said by the accuracy table's own caption, and a language model's task=none says nothing)
SHARED_KEYS = ("pos.name", "data.source", "data.path", "data.name", "data.files", "model.d_model", "model.n_layers",
               "model.n_heads", "train.seq_len", "train.steps")
# the corpus is said as its overrides say it (data=hub data.path=... data.name=...): a bare `name=` or
# `source=` under a table would not say that it is the data's
CAPTION_NAMES = {"pos.name": "pos", "data.source": "data", "data.path": "data.path", "data.name": "data.name",
                 "data.files": "data.files"}


def _part(flat: Mapping[str, Any], key: str, names: Mapping[str, str]) -> str:
    value = short_value(flat[key])
    return value if key.endswith(".name") else f"{names[key]}={value}"


def distinguishing_keys(flat_configs: Sequence[Mapping[str, Any]], keys: Sequence[str]) -> list[str]:
    """The fewest of `keys` that still tell every distinct configuration apart: every `*.name` key
    that differs (the scheme says what a run is), then, greedily, the key that separates the most
    configurations (HEADLINE_KEYS first, then the shortest label text), in the order a label shows
    them: names first, then shortest first.
    Keys left out change together with a chosen one (the `extend` children's batch size and steps
    with their seq_len); the CSV and JSON files keep every differing key's value."""
    configs = {tuple(_text(flat.get(k, "<unset>")) for k in keys) for flat in flat_configs}
    names = _key_names(keys)
    cost = {k: sum(len(_part(flat, k, names)) for flat in flat_configs if k in flat) for k in keys}
    tier = {k: 0 if k.endswith(".name") else 1 if k in HEADLINE_KEYS else 2 for k in keys}

    def told_apart(chosen: list[str]) -> int:
        return len({tuple(c[keys.index(k)] for k in chosen) for c in configs})

    chosen = [k for k in keys if tier[k] == 0]  # the scheme (and any other *.name that differs) says what a run is
    while told_apart(chosen) < len(configs):
        chosen.append(max((k for k in keys if k not in chosen),
                          key=lambda k: (told_apart([*chosen, k]), -tier[k], -cost[k])))
    for key in sorted((k for k in chosen if tier[k]), key=lambda k: (-tier[k], -cost[k])):  # a later key may make an earlier one redundant
        rest = [k for k in chosen if k != key]
        if told_apart(rest) == len(configs):
            chosen = rest
    return sorted(chosen, key=lambda k: (tier[k] > 0, cost[k]))


def configuration_labels(flat_configs: Sequence[Mapping[str, Any]], differing: Sequence[str],
                         full_names: bool = False, every_key: bool = False) -> tuple[list[str], list[str]]:
    """(keys named, one label per config): a config's own `name` when no other configuration shares
    it; otherwise the distinguishing keys (`*.name` keys by their value alone, `rope`; others as short
    `key=value`, `seq_len=256`, or the whole key with full_names), after the name if it has one; a
    key a config lacks is left out, and so is a key that is null (a setting switched off:
    `position_skip=null`) where the label says something else, unless that makes two labels alike.
    every_key: every differing key (`*.type` first), not the fewest that tell the configs apart."""
    keys = label_keys(flat_configs, [k for k in differing if k != NAME_KEY])
    keys = (sorted(keys, key=lambda k: (not k.endswith(".type"), k)) if every_key
            else distinguishing_keys(flat_configs, keys))
    names = {k: k for k in keys} if full_names else _key_names(keys)
    configurations_named: dict[Any, set[str]] = {}
    for flat in flat_configs:
        configurations_named.setdefault(flat.get(NAME_KEY), set()).add(_text([flat.get(k) for k in keys]))

    def labels_for(drop_null: bool) -> list[str]:
        labels = []
        for flat in flat_configs:
            own = flat.get(NAME_KEY)
            shown = [k for k in keys if k in flat]
            if drop_null and (own is not None or any(flat[k] is not None for k in shown)):
                shown = [k for k in shown if flat[k] is not None]
            parts = [_part(flat, k, names) for k in shown]
            if own is not None and len(configurations_named[own]) == 1:
                parts = [str(own)]  # a name YAML reads as a number (name=12) is still a name
            elif own is not None:
                parts.insert(0, str(own))
            labels.append(", ".join(parts) or "(all the same)")
        return labels

    full, short = labels_for(drop_null=False), labels_for(drop_null=True)
    named = any(flat.get(NAME_KEY) is not None for flat in flat_configs)
    return ([NAME_KEY] if named else []) + keys, short if len(set(short)) == len(set(full)) else full


def shared_settings(flat_configs: Sequence[Mapping[str, Any]]) -> str:
    """What every configuration has in common among SHARED_KEYS, said once: `pos=rope, data=stdlib,
    seq_len=64` (a setting that is null everywhere, `data.name=null`, says nothing)."""
    names = {**_key_names(SHARED_KEYS), **CAPTION_NAMES}
    parts = []
    for key in SHARED_KEYS:
        values = {_text(flat.get(key, "<unset>")) for flat in flat_configs}
        if len(values) == 1 and flat_configs[0].get(key) is not None:
            value = flat_configs[0][key]
            # a hub id is owner/name: its name alone (wikitext) would not say whose
            text = "/".join(str(value).rstrip("/").split("/")[-2:]) if key == "data.path" else short_value(value)
            parts.append(f"{names[key]}={text}")
    return ", ".join(parts)


def variant_items(variant: str) -> dict[str, str]:
    """An eval variant's settings: `protocol=sliding,stride=64` -> {protocol: sliding, stride: "64"}
    (results.variant_tag wrote it; its values hold no comma or `=`)."""
    return {} if variant == DEFAULT_VARIANT else dict(item.split("=", 1) for item in variant.split(","))


def variant_labels(variants: Sequence[str]) -> tuple[dict[str, str], str]:
    """({variant: what tells it apart from the others}, what they all share): eval variants named like
    configurations, by every item that differs between them (`type=linear, factor=4`: the factor
    alone would not tell PI from YaRN, nor a group of 8 which window; `–` for a variant with none of
    them), the items every variant has said once (`protocol=sliding, stride=64`). When the variants
    are of several methods (rope_scaling, self_extend, rerope, sinks) each item keeps its method:
    `self_extend.group=8, self_extend.window=64`."""
    distinct = sorted(set(variants))
    items = [variant_items(v) for v in distinct]
    keys = sorted({k for it in items for k in it})
    differing = [k for k in keys if len({it.get(k) for it in items}) > 1]
    shared = ", ".join(f"{k}={items[0][k]}" for k in keys if k not in differing)
    # variants of several methods keep each key's method (rerope.window=4096, not window=4096)
    several_methods = len({k.split(".")[0] for k in differing}) > 1
    labels = configuration_labels(items, differing, several_methods, every_key=True)[1] if differing else ["–"] * len(items)
    return {v: "–" if label == "(all the same)" else label for v, label in zip(distinct, labels)}, shared


def decimals(value: float, digits: int = 4) -> int:
    """The decimal places that show `value` with about `digits` significant digits, no exponent:
    3.812, 14.38, 123.5, 1234."""
    if not math.isfinite(value) or value == 0:
        return digits - 1
    return max(0, digits - 1 - math.floor(math.log10(abs(value))))


def column_blocks(fixed: Sequence[int], repeated: Sequence[int], width: int) -> list[list[int]]:
    """Split the repeated columns (one per eval length) into blocks of indices that fit `width`
    beside the fixed columns (repeated in each block); widths are of the text, borders added here."""
    room = width - 1 - sum(w + 3 for w in fixed)
    blocks: list[list[int]] = [[]]
    used = 0
    for i, w in enumerate(repeated):
        if blocks[-1] and used + w + 3 > room:
            blocks.append([])
            used = 0
        blocks[-1].append(i)
        used += w + 3
    return blocks


def schemes_table(model: str) -> Table:
    """`relpos schemes`: every registered scheme built with its conf/pos/<name>.yaml defaults at
    train.seq_len from conf/train, its hooks, what its bias depends on, parameters at `model`, and
    whether it is shift invariant."""
    models = sorted(p.stem for p in (conf_dir() / "model").glob("*.yaml"))
    if model not in models:  # a name, not a path: ../config is a yaml too, and no model
        raise RelposError(f"no model config {model!r}; choose one of: {', '.join(models)}")
    m = default_group("model", model)
    shape = ModelShape(m.d_model, m.n_heads, m.n_layers, default_group("train").seq_len)
    table = Table(title=f"position schemes (parameters at model={model}: d_model={shape.d_model}, "
                  f"{shape.n_heads} heads, {shape.n_layers} layers)", title_justify="left",
                  caption="bias on: what the additive logit bias depends on; shift inv.: relative, the "
                          "position term depends on i - j only", caption_justify="left")
    table.add_column("scheme (paper)", overflow="fold", ratio=1)
    table.add_column("hooks")
    table.add_column("bias on")
    table.add_column("params", justify="right")
    table.add_column("shift inv.")
    for name in scheme_names():
        pos_yaml = conf_dir() / "pos" / f"{name}.yaml"
        pos_cfg = OmegaConf.to_container(OmegaConf.load(pos_yaml)) if pos_yaml.is_file() else {"name": name}
        scheme, cls = build_scheme(pos_cfg, shape), REGISTRY[name]
        count = sum(p.numel() for p in scheme.parameters())
        groups = sorted({n.split(".")[0] for n, _ in scheme.named_parameters()})
        table.add_row(Text.assemble((name, "bold"), "\n", (cls.paper, "dim")), "\n".join(cls.hooks()) or "-",
                      cls.bias_input.value, f"{count:,}\n({', '.join(groups)})" if count else "0",
                      "yes" if scheme.relative else "no")
    return table


# a column beside the lengths: its header, its add_column options, and one cell per row
Column = tuple[str, Mapping[str, Any], Sequence[Any]]
LABEL_HEADER = "configuration"


def length_tables(labels: Sequence[str], before: Sequence[Column], headers: Sequence[str], cells: Sequence[Sequence[Any]],
                  after: Sequence[Column], width: int) -> list[Table]:
    """Rows = configurations (labels), then the `before` columns, one column per length (headers,
    cells[row][length]), then the `after` columns; the lengths split over as many tables as it takes
    for each to fit `width` (column_blocks), every table repeating the label and the other columns.
    Every column is counted at its widest text, header included: a width counted short made Rich fold
    a label or header to fit (`configurati` over `on`)."""
    text_width = lambda text: max(map(len, str(text).splitlines()), default=0)  # noqa: E731
    widths = [max(text_width(h), *(text_width(row[i]) for row in cells)) for i, h in enumerate(headers)]
    fixed = [max(text_width(name), *map(text_width, values)) for name, _, values in (*before, *after)]
    label_width = max(map(text_width, [LABEL_HEADER, *labels]))
    tables = []
    for block in column_blocks([label_width, *fixed], widths, width):
        table = Table()
        table.add_column(LABEL_HEADER, overflow="fold")
        for name, options, _ in before:
            table.add_column(name, **options)
        for i in block:
            table.add_column(headers[i], justify="right", no_wrap=True)
        for name, options, _ in after:
            table.add_column(name, **options)
        for row, label in enumerate(labels):
            table.add_row(Text(label), *(values[row] for _, _, values in before), *(cells[row][i] for i in block),
                          *(values[row] for _, _, values in after))
        tables.append(table)
    return tables
