"""relpos compare on hand-made run dirs: grouping by config (not folder names), mean/std, failures."""

import io
import json
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf
from rich.console import Console

from relpos_cli.checkpoint import mark_failed
from relpos_cli.compare import group_runs, run_compare
from relpos_cli.runs import find_runs, read_run
from relpos_cli.config import conf_dir
from relpos_cli.errors import RelposError

LENGTHS = (128, 256, 512)


def composed():
    """A whole run config as training saves it (compare validates the runs it evaluates); pos holds
    only its name, so that the groups are labelled by the keys the test sets."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(str(conf_dir()), version_base="1.3"):
        return OmegaConf.to_container(compose("config", overrides=["pos=none"]), resolve=True)


def make_run(path, pos, seed, seq_len, ppls, variant="default", protocol="nonoverlapping", stride=None, bpb=False):
    path.mkdir(parents=True, exist_ok=True)
    cfg = {"pos": {"name": pos}, "seed": seed, "train": {"seq_len": seq_len}, "data": {"cache_dir": str(path)},
           "wandb": {"mode": "disabled", "group": str(seed)}, "eval": {"tokens": 1024}}
    OmegaConf.save(OmegaConf.merge(composed(), cfg), path / "config.yaml")
    (path / "checkpoint.pt").write_bytes(b"not loaded by compare")
    rows = [{"length": l, "tokens": 1024, "loss": float(np.log(p)), "ppl": p, "ppl_ratio": p / ppls[0],
             "protocol": protocol, "stride": stride or l, "variant": variant} for l, p in zip(LENGTHS, ppls)]
    if bpb:  # runs evaluated before bpb existed have none
        rows = [{**r, "bpb": r["loss"] / np.log(2)} for r in rows]
    suffix = "" if variant == "default" else f".{variant}"
    (path / f"eval_length{suffix}.json").write_text(json.dumps(rows))


@pytest.fixture
def sweep(tmp_path):
    """pos x train.seq_len x 3 seeds; folder names deliberately lie about the scheme."""
    values = {}
    rng = np.random.default_rng(0)
    for i, (pos, seq_len) in enumerate([("rope", 128), ("alibi", 128), ("alibi", 256)]):
        for seed in range(3):
            ppls = list(rng.uniform(5, 50, size=len(LENGTHS)))
            values.setdefault((pos, seq_len), []).append(ppls)
            make_run(tmp_path / "sweep" / f"{i}{seed}_misleading_pos=t5", pos, seed, seq_len, ppls)
    return tmp_path / "sweep", values


def test_grouping_mean_and_std(sweep):
    path, values = sweep
    groups = group_runs([read_run(p) for p in find_runs(path)])
    assert [g["label"] for g in groups] == ["alibi, seq_len=128", "alibi, seq_len=256", "rope, seq_len=128"]
    assert all(g["label_keys"] == ["pos.name", "train.seq_len"] for g in groups)
    for g in groups:
        ppls = np.array(values[(g["config"]["pos.name"], g["config"]["train.seq_len"])])  # (seeds, lengths)
        for j, l in enumerate(LENGTHS):
            assert g["cells"][l]["n"] == 3
            assert g["cells"][l]["mean"] == pytest.approx(ppls[:, j].mean())
            assert g["cells"][l]["std"] == pytest.approx(ppls[:, j].std(ddof=1))


def test_variants_are_their_own_rows(sweep):
    path, _ = sweep
    run = find_runs(path)[0]
    make_run(run, "rope", 0, 128, [1.0, 2.0, 3.0], variant="protocol=sliding,stride=64", protocol="sliding", stride=64)
    groups = group_runs([read_run(p) for p in find_runs(path)])
    sliding = [g for g in groups if g["variant"] != "default"]
    assert len(groups) == 4 and len(sliding) == 1
    assert sliding[0]["protocol"] == "sliding stride=64, fp32" and sliding[0]["cells"][256] == {"mean": 2.0, "std": None, "n": 1,
                                                                                               "mean_interval": None}


def test_compare_survives_failed_and_unevaluated_runs(sweep, tmp_path):
    path, _ = sweep
    (path / "crashed" / ".hydra").mkdir(parents=True)  # Hydra made the job dir, training never saved a config
    make_run(path / "errored", "rope", 5, 128, [1, 1, 1])
    mark_failed(path / "errored", RuntimeError("loss is nan"), [])
    make_run(path / "unfinished", "rope", 6, 128, [1, 1, 1])
    (path / "unfinished" / "checkpoint.pt").unlink()
    make_run(path / "unevaluated", "rope", 7, 128, [1, 1, 1])
    (path / "unevaluated" / "eval_length.json").unlink()

    out = io.StringIO()
    written = run_compare([path], [], tmp_path / "out", False, "ppl", Console(file=out, width=250))
    assert [p.name for p in written] == ["compare.csv", "compare.md", "compare.json", "compare.png"]
    report = json.loads((tmp_path / "out" / "compare.json").read_text())
    reasons = {r["run"].rsplit("/", 1)[1]: r["reason"] for r in report["failed"]}
    assert set(reasons) == {"crashed", "errored", "unfinished", "unevaluated"}
    assert reasons["errored"] == "RuntimeError: loss is nan" and "not evaluated" in reasons["unevaluated"]
    assert all(c["n"] == 3 for g in report["groups"] for c in g["cells"].values())
    md = (tmp_path / "out" / "compare.md").read_text()
    # each row's three seeds are drawn over [5, 50]: the rows' intervals of the mean overlap, nothing is bold
    assert "**" not in md
    assert "skipped" in out.getvalue()


def test_nothing_to_compare_is_one_clear_error(tmp_path):
    (tmp_path / "run" / ".hydra").mkdir(parents=True)
    with pytest.raises(RelposError, match="no evaluated runs"):
        run_compare([tmp_path], [], tmp_path, False, "ppl", Console(file=io.StringIO()))
    with pytest.raises(RelposError, match="--metric"):
        run_compare([tmp_path], [], tmp_path, False, "bleu", Console(file=io.StringIO()))


def test_a_bad_eval_override_is_one_error_not_a_failure_per_run(sweep, tmp_path):
    path, _ = sweep
    with pytest.raises(RelposError, match="needs a positive eval.stride"):
        run_compare([path], ["eval.protocol=sliding"], tmp_path, False, "ppl", Console(file=io.StringIO()))


def test_bpb_compares_the_runs_that_have_it_and_lists_the_older_ones(sweep, tmp_path):
    path, _ = sweep
    make_run(path / "new", "rope", 9, 128, [2.0, 4.0, 8.0], bpb=True)
    out = io.StringIO()
    run_compare([path], [], tmp_path / "out", False, "ppl", Console(file=io.StringIO(), width=250))
    ppl_files = {f.name: f.read_bytes() for f in (tmp_path / "out").glob("compare.*")}
    run_compare([path], [], tmp_path / "out", False, "bpb", Console(file=out, width=250))
    # files of its own: the perplexity comparison beside it stays as it was (it was overwritten by bpb)
    assert {f.name: f.read_bytes() for f in (tmp_path / "out").glob("compare.*")} == ppl_files
    report = json.loads((tmp_path / "out" / "compare_bpb.json").read_text())
    assert [g["runs"] for g in report["groups"]] == [[str(path / "new")]]
    assert [report["groups"][0]["cells"][str(l)]["mean"] for l in LENGTHS] == pytest.approx([1.0, 2.0, 3.0])
    assert len(report["failed"]) == 9 and all("predate bpb" in r["reason"] for r in report["failed"])
    assert "relpos eval-length" in out.getvalue()
    with pytest.raises(RelposError, match="no evaluated runs.*predate bpb"):
        run_compare([path / "00_misleading_pos=t5"], [], tmp_path, False, "bpb", Console(file=io.StringIO()))


def test_bold_is_a_best_whose_interval_over_seeds_clears_every_other_row_of_its_protocol(tmp_path):
    """Per length and protocol, the lowest mean is bold only where its 95% interval of the mean over
    seeds (mean -/+ t std / sqrt(n), t = 12.706 at two seeds) lies below every other row's. Here rope
    (10.0, 10.2) is [8.83, 11.37] and alibi (12.0, 12.2) [10.83, 13.37] at the first length: they overlap,
    no bold; at the second, rope [19.88, 20.14] against alibi [14.88, 15.14]: alibi is bold; at the
    third a t5 row of one seed has no interval, so nothing is. A sliding window's lower perplexity is no
    rival of the non-overlapping rows, and alone in its protocol it is bold nowhere.
    Mutations seen failing: bolding the lowest mean (as before), comparing across protocols."""
    for seed, (rope, alibi) in enumerate([([10.0, 20.0, 30.0], [12.0, 15.0, 18.0]), ([10.2, 20.02, 30.2], [12.2, 15.02, 18.2])]):
        make_run(tmp_path / "runs" / f"rope{seed}", "rope", seed, 128, rope)
        make_run(tmp_path / "runs" / f"alibi{seed}", "alibi", seed, 128, alibi)
        make_run(tmp_path / "runs" / f"rope{seed}", "rope", seed, 128, [5.0, 5.0, 5.0 + seed],
                 variant="protocol=sliding,stride=64", protocol="sliding", stride=64)
    make_run(tmp_path / "runs" / "t5", "t5", 0, 128, [40.0, 40.0, 40.0])  # scored at the third length alone:
    t5_rows = json.loads((tmp_path / "runs" / "t5" / "eval_length.json").read_text())
    (tmp_path / "runs" / "t5" / "eval_length.json").write_text(json.dumps(t5_rows[-1:]))
    run_compare([tmp_path / "runs"], [], tmp_path / "out", False, "ppl", Console(file=io.StringIO(), width=250))
    rows = {tuple(cell.strip() for cell in line.split("|")[1:3]): line
            for line in (tmp_path / "out" / "compare.md").read_text().splitlines() if line.startswith("| ") and "@" not in line}
    assert rows[("rope", "–")].count("**") == 0 and rows[("t5", "–")].count("**") == 0
    assert rows[("alibi", "–")].count("**") == 2 and "**15.010 ± 0.014 (n=2)**" in rows[("alibi", "–")]
    assert rows[("rope", "protocol=sliding, stride=64")].count("**") == 0
    cells = {g["label"] + g["variant"]: g["cells"] for g in json.loads((tmp_path / "out" / "compare.json").read_text())["groups"]}
    assert cells["alibidefault"]["256"]["mean_interval"] == pytest.approx([15.01 - 12.7062 * 0.01, 15.01 + 12.7062 * 0.01])


def test_compare_json_names_runs_by_absolute_path(tmp_path, monkeypatch):
    """Named relative to the cwd, compare.json's runs meant nothing beside --out elsewhere."""
    make_run(tmp_path / "runs" / "rope", "rope", 0, 128, [10.0, 20.0, 30.0])
    monkeypatch.chdir(tmp_path)
    run_compare([Path("runs")], [], tmp_path / "elsewhere", False, "ppl", Console(file=io.StringIO(), width=250))
    report = json.loads((tmp_path / "elsewhere" / "compare.json").read_text())
    assert report["groups"][0]["runs"] == [str((tmp_path / "runs" / "rope").resolve())]


def test_paired_with_gives_each_row_minus_the_baseline_seed_by_seed(tmp_path):
    """--paired-with ROW: rope's seeds read 10, 12, 14 and alibi's 10.5, 12.4, 14.6 at 128 (and alibi has
    a seed 3 rope lacks): each row's interval of the mean over seeds ([7.03, 16.97] and [7.4, 17.6]) overlaps
    the other's, so the main table bolds nothing, but seed by seed alibi is 0.5, 0.4, 0.6 above rope:
    mean 0.5, sample std 0.1, n = 3 pairs, 95% interval 0.5 -/+ 4.3027 x 0.1 / sqrt(3) = [0.2516, 0.7484],
    which excludes 0 (bold). At 256 the differences -1, +1, 0 give an interval about 0, not bold.
    Mutations seen failing: pairing by position instead of seed, absolute differences."""
    rope = {0: [10.0, 20.0, 30.0], 1: [12.0, 21.0, 31.0], 2: [14.0, 22.0, 32.0]}
    alibi = {0: [10.5, 19.0, 30.0], 1: [12.4, 22.0, 31.0], 2: [14.6, 22.0, 32.0], 3: [99.0, 99.0, 99.0]}
    for seed in (3, 2, 1, 0):  # dirs sorted in another order than the seeds: pairs go by seed, not by position
        make_run(tmp_path / "runs" / f"alibi{9 - seed}", "alibi", seed, 128, alibi[seed])
    for seed, ppls in rope.items():
        make_run(tmp_path / "runs" / f"rope{seed}", "rope", seed, 128, ppls)
    out = tmp_path / "out"
    run_compare([tmp_path / "runs"], [], out, False, "ppl", Console(file=io.StringIO(), width=250), paired_with="rope")
    markdown = (out / "compare.md").read_text()
    table, paired = markdown.split("Paired differences against 'rope'")
    assert "**" not in table
    row = next(line for line in paired.splitlines() if line.startswith("| alibi |"))
    # at 256 the differences -1, +1, 0: sample std 1, interval 0 -/+ 4.3027 / sqrt(3); at 512 all 0
    assert [c.strip() for c in row.split("|")[3:6]] == [
        "**+0.500 [0.252, 0.748] (n=3)**", "+0.000 [-2.484, 2.484] (n=3)", "+0.000 [0.000, 0.000] (n=3)"]
    assert not any(line.startswith("| rope |") for line in paired.splitlines())  # the baseline has no row there
    groups = {g["label"]: g for g in json.loads((out / "compare.json").read_text())["groups"]}
    cell = groups["alibi"]["paired"]["cells"]["128"]
    assert groups["alibi"]["paired"]["against"] == "rope" and "paired" not in groups["rope"]
    assert cell["n"] == 3 and cell["mean"] == pytest.approx(0.5) and cell["std"] == pytest.approx(0.1)
    assert cell["mean_interval"] == pytest.approx([0.5 - 4.3027 * 0.1 / 3 ** 0.5, 0.5 + 4.3027 * 0.1 / 3 ** 0.5], abs=1e-4)
    csv = (out / "compare.csv").read_text().splitlines()
    assert "128_paired_mean" in csv[0] and "128_paired_low" in csv[0]


def test_paired_with_refuses_what_it_cannot_pair(tmp_path):
    """A ROW that names no row (the rows listed), a row with two runs of one seed, and accuracy."""
    make_run(tmp_path / "runs" / "rope0", "rope", 0, 128, [10.0, 20.0, 30.0])
    make_run(tmp_path / "runs" / "alibi0", "alibi", 0, 128, [10.0, 20.0, 30.0])
    console = Console(file=io.StringIO(), width=250)
    with pytest.raises(RelposError, match=r"--paired-with 'pos=rope' names no row; the rows: 'alibi', 'rope'"):
        run_compare([tmp_path / "runs"], [], tmp_path / "out", False, "ppl", console, paired_with="pos=rope")
    make_run(tmp_path / "runs" / "alibi0again", "alibi", 0, 128, [11.0, 21.0, 31.0])
    with pytest.raises(RelposError, match="row 'alibi' has several runs of one seed at length 128"):
        run_compare([tmp_path / "runs"], [], tmp_path / "out", False, "ppl", console, paired_with="rope")
    with pytest.raises(RelposError, match="--paired-with pairs perplexity-like metrics"):
        run_compare([tmp_path / "runs"], [], tmp_path / "out", False, "accuracy", console, paired_with="rope")
    assert not (tmp_path / "out").exists()  # nothing written by a refused comparison
