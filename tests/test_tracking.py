"""W&B: one offline run per relpos run holds its training curves, eval results and inspect pictures,
read back from the offline run file as `wandb sync` would upload it."""

import json
import subprocess
import sys

import pytest
import wandb

from conftest import TINY, run_in_process
from relpos_cli.tracking import TABLE_KEY_MAX, run_tags, table_key
from wandb_records import OfflineRun

pytestmark = pytest.mark.usefixtures("in_temp_cwd")
LENGTHS = [32, 64, 128]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """Trained, evaluated and inspected, all with wandb.mode=offline."""
    run_dir = tmp_path_factory.mktemp("wandb") / "run"
    offline = [*TINY[:-1], "wandb.mode=offline", "wandb.tags=[mine]", "pos=alibi", "name=12",
               "wandb.group=123"]  # a name and a group YAML reads as numbers
    for args in (["train", *offline, f"hydra.run.dir={run_dir}"],
                 ["eval-length", str(run_dir), f"eval.lengths=[{','.join(map(str, LENGTHS))}]", "eval.tokens=256"],
                 ["inspect", str(run_dir), "inspect.length=8"]):
        code, out, err = run_in_process(*args)
        assert code == 0, out + err
    wandb.teardown()  # what the end of a relpos process does: the W&B service writes out the offline files
    return run_dir


def logged_from_files(run_dir, task_files=()) -> tuple[dict[str, list], dict[str, float]]:
    """The scalars a run's W&B run must hold, from the run dir's own files, as OfflineRun.scalars gives them:
    (history key: values in order; summary key: value). metrics.jsonl: train/<key> for each key but step,
    val/loss; eval_length.json: eval/<metric> against eval/length, summary eval/<metric>@<length>, the
    longest length and the ppl ratio there; each eval_task*.json in task_files: <prefix>/accuracy against
    <prefix>/length, summary accuracy@<length>, the effective length (also of the lower 95% bound) and its
    threshold. The summary also keeps every history key's last value, as W&B does."""
    history, summary = {}, {}
    for row in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()):
        for key, value in row.items():
            if key != "step":
                history.setdefault("val/loss" if key == "val_loss" else f"train/{key}", []).append(value)
    rows = json.loads((run_dir / "eval_length.json").read_text())
    metrics = ("ppl", "loss", "bpb", "ppl_ratio")
    history.update({f"eval/{m}": [r[m] for r in rows] for m in ("length", *metrics)})
    summary.update({f"eval/{m}@{r['length']}": r[m] for r in rows for m in metrics})
    longest = max(rows, key=lambda r: r["length"])
    summary.update({"eval/longest_length": longest["length"], "eval/ppl_ratio_longest": longest["ppl_ratio"]})
    for name in task_files:  # eval_task.<variant>.json is logged under eval_task.<variant>/
        payload, prefix = json.loads((run_dir / name).read_text()), name.removesuffix(".json")
        history.update({f"{prefix}/{m}": [r[m] for r in payload["lengths"]] for m in ("length", "accuracy")})
        summary.update({f"{prefix}/accuracy@{r['length']}": r["accuracy"] for r in payload["lengths"]})
        summary.update({f"{prefix}/effective_length": payload["effective_length"], f"{prefix}/threshold": payload["threshold"],
                        f"{prefix}/effective_length_lower": payload["effective_length_lower"]})
    return history, {**summary, **{key: values[-1] for key, values in history.items()}}


def test_train_eval_and_inspect_are_one_offline_run(run_dir):
    (offline,) = (run_dir / "wandb").glob("offline-run-*")  # one dir, however many commands added to it
    assert offline.name.endswith((run_dir / "wandb_id.txt").read_text())
    run = OfflineRun(offline)
    assert run.run.job_type == "train" and list(run.run.tags) == ["pos=alibi", "mine"]
    assert run.run.display_name == "12"  # the run's own name, not its dir's
    assert run.run.run_group == "123"  # W&B refuses an int group: it gets the string the schema types
    assert run.config["pos"]["name"] == "alibi"

    # every scalar logged, and only those, with the values of the run dir's files: the training curves
    # step by step, eval-length's ppl, loss, bpb and ppl ratio per length, the sortable summary scalars
    assert run.scalars() == logged_from_files(run_dir)
    trained = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["_step"] for row in run.history if "train/loss" in row] == [r["step"] for r in trained]
    assert run.column("eval/length") == LENGTHS and run.summary["eval/longest_length"] == 128
    rows = json.loads((run_dir / "eval_length.json").read_text())
    assert [(row["eval/length"], row["eval/loss"], row["eval/bpb"]) for row in run.history if "eval/length" in row] \
        == [(r["length"], r["loss"], r["bpb"]) for r in rows]  # each length's row holds its own results
    assert all(run.metrics[f"eval/{m}"].step_metric == "eval/length" for m in ("ppl", "loss", "bpb", "ppl_ratio"))
    assert run.summary["eval_length/_type"] == "table-file" and run.summary["eval/eval_length/_type"] == "image-file"
    assert run.summary["inspect/symmetry/_type"] == "table-file"
    assert any("inspect/position_logits_layer0" in k for row in run.history for k in row)

    dry = subprocess.run([sys.executable, "-m", "wandb", "sync", "--dry-run", str(offline)], capture_output=True, text=True)
    assert "Would sync 1 run(s)" in dry.stdout + dry.stderr


def test_tags_name_scheme_and_task_where_the_config_has_one():
    assert run_tags({"pos": {"name": "rope"}, "wandb": {"tags": []}}) == ["pos=rope"]
    assert run_tags({"pos": {"name": "rope"}, "task": {"name": "passkey"}, "wandb": {"tags": ["x", "pos=rope"]}}) \
        == ["pos=rope", "task=passkey", "x"]


def table_rows(offline, run: OfflineRun, key: str) -> list[dict]:
    """A W&B Table logged under `key`, read back from the offline run's files as `wandb sync` uploads it."""
    assert run.summary[f"{key}/_type"] == "table-file"
    table = json.loads((offline / "files" / run.summary[f"{key}/path"]).read_text())
    return [dict(zip(table["columns"], row)) for row in table["data"]]


def test_eval_task_and_both_compares_reach_wandb(run_dir, tmp_path, monkeypatch):
    """eval-task's accuracies join the run's offline W&B run; compare and compare --metric accuracy
    each log their table (one row per configuration and length, the numbers of their JSON) into an
    offline run of their own folder. Mutations checked, each fails: log_eval_task logging the
    accuracy of the first length at every length; log_compare logging nothing. Found with it:
    the comparison figure was logged under the table's key and replaced the table in the summary."""
    from relpos_cli import eval_task
    from relpos_cli.tasks.base import Encoder
    from relpos_cli.tokenizers import ByteTokenizer
    from test_eval_task import constant_model

    # a model that always says "1": flip-flop accuracies that differ between lengths
    monkeypatch.setattr(eval_task, "load_trained_model", constant_model(run_dir, int(Encoder(ByteTokenizer())("1")[0])))
    task = ["task=flip_flop", "task.samples=4", "task.eval_lengths=[32,64]"]
    for args in (["eval-task", str(run_dir), *task],
                 ["compare", str(run_dir), "--no-evaluate", "--out", str(tmp_path / "ppl")],
                 ["compare", str(run_dir), "--metric", "accuracy", *task, "--out", str(tmp_path / "acc")]):
        code, out, err = run_in_process(*args)
        assert code == 0, out + err
    wandb.teardown()

    (offline,) = (run_dir / "wandb").glob("offline-run-*")
    run = OfflineRun(offline)
    rows = json.loads((run_dir / "eval_task.task=flip_flop.json").read_text())["lengths"]
    prefix = "eval_task.task=flip_flop"
    assert len({r["accuracy"] for r in rows}) == 2
    assert run.column(f"{prefix}/length") == [32, 64]
    # the accuracies, effective length and threshold beside the earlier training and eval-length scalars
    assert run.scalars() == logged_from_files(run_dir, [f"{prefix}.json"])
    named = prefix.replace(".", "\\.")  # W&B's escape for a "." that is not nesting
    assert run.metrics[f"{named}/accuracy"].step_metric == f"{named}/length"  # charted against the length
    assert [r["accuracy"] for r in table_rows(offline, run, f"{prefix}/table")] == [r["accuracy"] for r in rows]

    for folder, stem in (("ppl", "compare"), ("acc", "compare_accuracy")):
        (offline,) = (tmp_path / folder / "wandb").glob("offline-run-*")
        logged = table_rows(offline, OfflineRun(offline), stem)
        assert OfflineRun(offline).scalars() == ({}, {})  # a comparison logs its table and figure, no scalar
        report = json.loads((tmp_path / folder / f"{stem}.json").read_text())
        want = [(int(l), c["mean"], c["n"]) for g in report["groups"] for l, c in g["cells"].items()]
        assert [(r["length"], r["mean"], r["n"]) for r in logged] == want and want, stem


def test_a_variant_of_many_settings_is_logged_under_a_key_w_and_b_takes(tmp_path):
    """W&B names a Table's artifact run-<id>-<key> in at most 128 characters: a YaRN variant of four
    settings (docs/evaluation.md's third example) failed the logging after its files were written,
    and offline, where each command rebuilds the run from every result file, every later command."""
    run_dir = tmp_path / "run"
    assert run_in_process("train", *TINY[:-1], "wandb.mode=offline", f"hydra.run.dir={run_dir}")[0] == 0
    yarn = ["eval.rope_scaling.type=yarn", "eval.rope_scaling.beta_fast=16", "eval.rope_scaling.attention_factor=1.2"]
    for args in (yarn, []):  # the long variant, then a plain evaluation of the same run
        code, out, err = run_in_process("eval-length", str(run_dir), *args, "eval.lengths=[32,64]", "eval.tokens=128")
        assert code == 0, out + err
    wandb.teardown()
    (offline,) = (run_dir / "wandb").glob("offline-run-*")
    run = OfflineRun(offline)
    variant = next(p for p in run_dir.glob("eval_length.rope_scaling*.json")).name.removesuffix(".json")
    key = table_key(variant)
    assert len(variant) > TABLE_KEY_MAX >= len(key) and key != table_key(variant + "x")
    stored = json.loads(next(run_dir.glob("eval_length.rope_scaling*.json")).read_text())
    assert [r["ppl"] for r in table_rows(offline, run, key)] == [r["ppl"] for r in stored]


def test_a_missing_wandb_package_is_one_line(tmp_path, monkeypatch):
    """A GPU image without wandb: offline logging (the default) ended in ModuleNotFoundError's traceback
    after the results were written."""
    import builtins

    from relpos_cli.errors import RelposError
    from relpos_cli.tracking import open_run

    real_import = builtins.__import__

    def no_wandb(name, *args, **kwargs):
        if name == "wandb":
            raise ModuleNotFoundError("No module named 'wandb'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    with pytest.raises(RelposError, match="wandb.mode=offline needs the wandb package .*wandb.mode=disabled"):
        open_run(tmp_path, {"wandb": {"mode": "offline"}, "pos": {"name": "rope"}})
