"""`relpos sweep`, `eval-length` variants and `relpos compare` end to end on a tiny sweep."""

import csv
import json

import pytest
from hydra import compose, initialize_config_dir

from conftest import TINY, run_cli
from relpos_cli.config import conf_dir


def read_csv(path):
    return list(csv.DictReader(path.open()))


def test_sweep_then_variant_then_compare(tmp_path):
    sweep = tmp_path / "sweep"
    out = run_cli("sweep", "pos=rope,alibi", "seed=0,1", *TINY, f"hydra.sweep.dir={sweep}",
                  "eval.lengths=[32,64]", "eval.tokens=256").stdout
    runs = sorted(p.parent for p in sweep.glob("*/checkpoint.pt"))
    assert len(runs) == 4
    for run in runs:
        for name in ("eval_length.csv", "eval_length.json", "eval_length.png", "eval_positions.csv", "eval_positions.png"):
            assert (run / name).is_file(), name
    positions = read_csv(runs[0] / "eval_positions.csv")
    for length in (32, 64):
        assert sum(int(r["count"]) for r in positions if int(r["length"]) == length) == 256
    report = json.loads((sweep / "compare.json").read_text())
    assert sorted(g["label"] for g in report["groups"]) == ["alibi", "rope"]  # named by the key that differs
    assert all(c["n"] == 2 for g in report["groups"] for c in g["cells"].values())
    assert "compare.md" in " ".join(out.split()) and (sweep / "compare.png").is_file()

    # a second evaluation with another protocol keeps the first; stride = L equals non-overlapping exactly
    run_cli("eval-length", str(runs[0]), "eval.protocol=sliding", "eval.stride=32")
    sliding = read_csv(runs[0] / "eval_length.protocol=sliding,stride=32.csv")
    plain = read_csv(runs[0] / "eval_length.csv")
    assert [r["protocol"] for r in plain] == ["nonoverlapping"] * 2 and sliding[0]["protocol"] == "sliding"
    assert sliding[0]["length"] == plain[0]["length"] == "32" and sliding[0]["loss"] == plain[0]["loss"]
    assert sliding[1]["stride"] == "32" and sliding[1]["tokens"] == plain[1]["tokens"] == "256"

    # compare evaluates the runs that lack the requested variant, then shows both variants
    run_cli("compare", str(sweep), "eval.protocol=sliding", "eval.stride=32", "--out", str(tmp_path / "cmp"))
    rows = read_csv(tmp_path / "cmp" / "compare.csv")
    assert len(rows) == 4 and {r["variant"] for r in rows} == {"default", "protocol=sliding,stride=32"}
    assert all(r["64_n"] == "2" for r in rows)
    assert "sliding" in (tmp_path / "cmp" / "compare.md").read_text()

    # eval-length over a sweep with a broken run evaluates the others, then fails with one line
    (sweep / "broken").mkdir()
    (sweep / "broken" / "config.yaml").write_text((runs[0] / "config.yaml").read_text())
    (runs[1] / "eval_length.csv").unlink()
    proc = run_cli("eval-length", str(sweep), "eval.lengths=[32]", check=False)
    assert proc.returncode == 2 and "1 of 5 runs could not be evaluated" in proc.stderr
    assert "no checkpoint.pt" in proc.stderr and "Traceback" not in proc.stderr
    assert [r["length"] for r in read_csv(runs[1] / "eval_length.csv")] == ["32", "64"]  # 64 kept: same tokens


def test_help_for_new_commands():
    for command in ("compare", "sweep"):
        assert "Examples" in run_cli(command, "--help").stdout


def test_experiment_presets_compose():
    quick = run_cli("train", "--cfg", "job", "+experiment=quick").stdout
    assert "steps: 500" in quick and "- 2048" in quick
    paper = run_cli("train", "--cfg", "job", "+experiment=alibi_paper").stdout
    assert "n_layers: 16" in paper and "- 16384" in paper and "wikitext-103" in paper
    sweep_params = run_cli("train", "--cfg", "hydra", "+experiment=quick").stdout
    assert "pos: none,learned,sinusoidal,rope,alibi,t5" in sweep_params and "seed: 0,1" in sweep_params


@pytest.mark.parametrize("preset", sorted(p.stem for p in (conf_dir() / "experiment").glob("*.yaml")))
def test_every_experiment_sets_a_sweep(preset):
    with initialize_config_dir(str(conf_dir()), version_base="1.3"):
        cfg = compose("config", overrides=[f"+experiment={preset}"], return_hydra_config=True)
    params = cfg.hydra.sweeper.params
    assert "pos" in params and "seed" in params and "experiment" not in cfg  # global package, no stray group key
    # a fine-tuning preset (init_from) evaluates to 16x its parent's training length, not its own
    assert max(cfg.eval.lengths) >= 16 * cfg.train.seq_len or "train.seq_len" in params or cfg.init_from
