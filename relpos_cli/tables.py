"""Tables that read at 80 columns: configurations named by what differs, values written short.

A sweep's resolved configs differ in keys a user chose (pos.name, train.seq_len) and in keys that
follow from them (pos.base exists only for rope): `configuration_labels` names each configuration
by the first kind only (`rope`, `alibi, seq_len=256`). Compare tables, legends and any other
per-configuration table (accuracy per length) call it.
"""

from __future__ import annotations

import json
import math
from typing import Any, Mapping, Sequence

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


def configuration_labels(flat_configs: Sequence[Mapping[str, Any]], differing: Sequence[str]) -> tuple[list[str], list[str]]:
    """(keys named, one label per config): `*.name` keys by their value alone (`rope`), others as
    short `key=value` (`seq_len=256`); a key a config does not have is left out of its label."""
    keys = label_keys(flat_configs, differing)
    names = _key_names(keys)
    labels = []
    for flat in flat_configs:
        parts = [short_value(flat[k]) if k.endswith(".name") else f"{names[k]}={short_value(flat[k])}" for k in keys if k in flat]
        labels.append(", ".join(parts) or "(all the same)")
    return keys, labels


def short_number(value: float, digits: int = 4) -> str:
    """About `digits` significant digits without exponents: 3.812, 14.38, 123.5, 1234."""
    return f"{value:.{decimals(value, digits)}f}"


def decimals(value: float, digits: int = 4) -> int:
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
