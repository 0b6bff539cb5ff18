"""docs/configuration.md names only keys and group options the config has, and lists every preset.

A user copies keys from its tables onto the command line, where an unknown key is an error; the
tables drifted before (a preset missing from the group table). The config is composed by Hydra
from relpos_cli/conf, as `relpos train --cfg job` composes it.

Mutation checked: writing `train.eval_evry` in the main keys table fails test_main_keys_exist;
dropping `ruler` from the `+experiment` row fails test_group_table_lists_every_preset."""

from __future__ import annotations

import re

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from conftest import REPO
from relpos_cli.config import conf_dir

PAGE = (REPO / "docs" / "configuration.md").read_text()
SECTIONS = ("model", "train", "data", "eval", "inspect", "task", "pos", "plots", "wandb")
DOTTED_KEY = re.compile(r"`((?:%s)\.[a-z_.]+)" % "|".join(SECTIONS))


def table_rows(heading: str) -> list[list[str]]:
    """The cells of the first table after a heading line (or the page's first table for "")."""
    lines = (PAGE.split(heading, 1)[1] if heading else PAGE).splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    block = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        block.append([cell.strip() for cell in line.strip("|").split(" | ")])
    return block[2:]  # past the header and its rule


def composed_keys(*overrides: str) -> set[str]:
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = compose("config", overrides=list(overrides))
    tree = OmegaConf.to_container(cfg, resolve=False)

    def walk(node, prefix):
        for k, v in node.items():
            yield f"{prefix}{k}"
            if isinstance(v, dict):
                yield from walk(v, f"{prefix}{k}.")

    return set(walk(tree, ""))


def test_main_keys_exist():
    named = {key.rstrip(".") for row in table_rows("## The main keys") for key in DOTTED_KEY.findall(row[0])}
    assert "train.eval_every" in named and "plots.format" in named  # the table was read
    known = composed_keys() | composed_keys("task=passkey")
    assert sorted(named - known) == []


def test_group_options_exist():
    groups = {row[0].strip("`"): re.findall(r"`([a-z_0-9]+)`", row[1]) for row in table_rows("")}
    for group in ("pos", "model", "data", "task", "+experiment"):
        folder = conf_dir() / group.lstrip("+")
        missing = [o for o in groups[group] if not (folder / f"{o}.yaml").is_file()]
        assert missing == [], f"{group}: {missing}"


@pytest.mark.parametrize("group", ["+experiment", "model", "data"])
def test_group_table_lists_every_preset(group):
    row = next(row for row in table_rows("") if row[0] == f"`{group}`")
    listed = set(re.findall(r"`([a-z_0-9]+)`", row[1]))
    on_disk = {p.stem for p in (conf_dir() / group.lstrip("+")).glob("*.yaml")}
    assert sorted(on_disk - listed) == []


def test_presets_table_lists_every_preset():
    listed = {name for row in table_rows("## Experiment presets") for name in re.findall(r"`([a-z_0-9]+)`", row[0])}
    on_disk = {p.stem for p in (conf_dir() / "experiment").glob("*.yaml")}
    assert sorted(on_disk - listed) == []
