"""RULER's synthetic tasks at the edges of their settings' ranges (a hidden try of relpos_cli/tasks/niah.py,
variable_tracking.py, common_words.py, frequent_words.py)."""

import re

import numpy as np
import pytest
from omegaconf import OmegaConf

from relpos_cli.config import conf_dir
from relpos_cli.tasks import build_task, task_settings
from relpos_cli.tasks.base import Encoder
from relpos_cli.tasks.examples import cell_examples
from relpos_cli.tokenizers import ByteTokenizer


def config(name: str, **overrides) -> dict:
    return {**OmegaConf.to_container(OmegaConf.load(conf_dir() / "task" / f"{name}.yaml")), **overrides}


@pytest.mark.parametrize("knobs", [{"keys": 64}, {"values": 64}, {"keys": 8, "values": 8, "haystack": "needle"}])
def test_niah_places_more_needles_than_rulers_forty_depths(knobs):
    """keys x values needles past RULER's 40 depths (64 keys is in task.keys' range): every needle is
    placed, the example has its exact length and the answers are the asked key's values (it raised
    numpy's ValueError 'Cannot take a larger sample than population' before)."""
    encoder = Encoder(ByteTokenizer())
    task = build_task(task_settings(config("niah", **knobs)), encoder)
    length = task.min_length() + 500
    task.check_length(length, "length")
    for ex in cell_examples(task, 0, length, 0.5, 2):
        assert len(ex.input_ids) == length
        key = re.search(r"for (\S+) mentioned in the provided text\?", ex.text).group(1)
        values = re.findall(rf"\nOne of the special magic numbers for {re.escape(key)} is: (\d+)\.", ex.text)
        assert len(values) == knobs.get("values", 1)
        assert [encoder.decode(ex.input_ids[s:e]).strip() for s, e in ex.answer_spans] == values
        real = len(re.findall(r"One of the special magic numbers for", ex.text))
        assert real >= knobs.get("keys", 1) * knobs.get("values", 1)
