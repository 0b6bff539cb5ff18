"""W&B: one offline run per relpos run holds its training curves, eval results and inspect pictures,
read back from the offline run file as `wandb sync` would upload it."""

import json
import subprocess
import sys

import pytest
import wandb

from conftest import TINY, run_in_process
from relpos_cli.tracking import run_tags
from wandb_records import OfflineRun

pytestmark = pytest.mark.usefixtures("in_temp_cwd")
LENGTHS = [32, 64, 128]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """Trained, evaluated and inspected, all with wandb.mode=offline."""
    run_dir = tmp_path_factory.mktemp("wandb") / "run"
    offline = [*TINY[:-1], "wandb.mode=offline", "wandb.tags=[mine]", "pos=alibi"]
    for args in (["train", *offline, f"hydra.run.dir={run_dir}"],
                 ["eval-length", str(run_dir), f"eval.lengths=[{','.join(map(str, LENGTHS))}]", "eval.tokens=256"],
                 ["inspect", str(run_dir), "inspect.length=8"]):
        code, out, err = run_in_process(*args)
        assert code == 0, out + err
    wandb.teardown()  # what the end of a relpos process does: the W&B service writes out the offline files
    return run_dir


def test_train_eval_and_inspect_are_one_offline_run(run_dir):
    (offline,) = (run_dir / "wandb").glob("offline-run-*")  # one dir, however many commands added to it
    assert offline.name.endswith((run_dir / "wandb_id.txt").read_text())
    run = OfflineRun(offline)
    assert run.run.job_type == "train" and list(run.run.tags) == ["pos=alibi", "mine"]
    assert run.config["pos"]["name"] == "alibi"

    trained = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert run.column("train/loss") == [r["loss"] for r in trained]  # the curves, step by step
    assert [row["_step"] for row in run.history if "train/loss" in row] == [r["step"] for r in trained]
    assert run.column("val/loss") == [r["val_loss"] for r in trained if "val_loss" in r]

    rows = json.loads((run_dir / "eval_length.json").read_text())
    assert run.column("eval/length") == LENGTHS and run.column("eval/ppl") == [r["ppl"] for r in rows]
    assert run.metrics["eval/ppl"].step_metric == "eval/length"  # charted against the length
    for r in rows:  # sortable scalars in the runs table
        assert run.summary[f"eval/ppl@{r['length']}"] == r["ppl"]
    assert run.summary["eval/ppl_ratio_longest"] == rows[-1]["ppl_ratio"] and run.summary["eval/longest_length"] == 128
    assert run.summary["eval_length/_type"] == "table-file" and run.summary["eval/eval_length/_type"] == "image-file"
    assert run.summary["inspect/symmetry/_type"] == "table-file"
    assert any("inspect/position_logits_layer0" in k for row in run.history for k in row)

    dry = subprocess.run([sys.executable, "-m", "wandb", "sync", "--dry-run", str(offline)], capture_output=True, text=True)
    assert "Would sync 1 run(s)" in dry.stdout + dry.stderr


def test_tags_name_scheme_and_task_where_the_config_has_one():
    assert run_tags({"pos": {"name": "rope"}, "wandb": {"tags": []}}) == ["pos=rope"]
    assert run_tags({"pos": {"name": "rope"}, "task": {"name": "passkey"}, "wandb": {"tags": ["x", "pos=rope"]}}) \
        == ["pos=rope", "task=passkey", "x"]
