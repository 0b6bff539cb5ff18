"""Compare rows named at a glance: a run's own `name`, else the fewest keys that tell configurations
apart (shortest first), with what every row shares said once; lengths on a log axis only where they
double."""

import pytest

from conftest import TINY, run_in_process
from relpos_cli.importing import source_name
from relpos_cli.plots import lengths_double
from relpos_cli.tables import configuration_labels, distinguishing_keys, shared_settings

pytestmark = pytest.mark.usefixtures("in_temp_cwd")

EXTEND_KEYS = ["init_from", "pos.scaling.type", "train.batch_size", "train.lr", "train.seq_len", "train.steps",
               "train.warmup_steps"]


def extend_configs() -> list[dict]:
    """The `extend` experiment's runs as compare sees them: a parent at L = 64 and four children at
    4L that differ from it in five training keys at once and from each other in the scaling type."""
    common = {"pos.name": "rope", "model.d_model": 64, "model.n_layers": 2, "data.source": "stdlib"}
    parent = {**common, "init_from": None, "pos.scaling.type": "none", "train.batch_size": 16, "train.lr": 3e-3,
              "train.seq_len": 64, "train.steps": 600, "train.warmup_steps": 60}
    children = [{**common, "init_from": "/home/me/outputs/extend/parent", "pos.scaling.type": kind,
                 "train.batch_size": 4, "train.lr": 1e-3, "train.seq_len": 256, "train.steps": 200,
                 "train.warmup_steps": 20} for kind in ("none", "linear", "ntk", "yarn")]
    return [parent, *children]


def test_the_fewest_keys_that_tell_rows_apart_name_them():
    """Mutation checked: choosing keys in the order they differ (init_from first, as before) gives
    seven-key labels over 24 characters and fails here."""
    configs = extend_configs()
    keys, labels = configuration_labels(configs, EXTEND_KEYS)
    assert keys == ["train.seq_len", "pos.scaling.type"] or keys == ["pos.scaling.type", "train.seq_len"]
    assert len(set(labels)) == 5 and max(map(len, labels)) <= 24  # one line in compare's label column
    assert "seq_len=64" in labels[0] and "type=yarn" in labels[-1] and "seq_len=256" in labels[-1]
    assert shared_settings(configs) == "pos=rope, data=stdlib, d_model=64, n_layers=2"


def test_the_caption_names_the_corpus_as_its_overrides_do():
    """The data config has no `name` but for data=hub's dataset config: a caption that looked for
    `data.name` alone said nothing of the corpus for stdlib and text_files runs, and a bare
    config name (`data=wikitext-103-raw-v1`) for hub runs."""
    common = {"pos.name": "alibi", "train.seq_len": 64}
    hub = {**common, "data.source": "hub", "data.path": "Salesforce/wikitext", "data.name": "wikitext-103-raw-v1"}
    assert shared_settings([hub, dict(hub)]) == (
        "pos=alibi, data=hub, data.path=Salesforce/wikitext, data.name=wikitext-103-raw-v1, seq_len=64")
    unnamed = {**hub, "data.name": None}
    assert shared_settings([unnamed]) == "pos=alibi, data=hub, data.path=Salesforce/wikitext, seq_len=64"
    files = {**common, "data.source": "text_files", "data.files": ["/corpora/a.txt", "/corpora/b.txt"]}
    assert shared_settings([files]) == "pos=alibi, data=text_files, data.files=[a.txt,b.txt], seq_len=64"
    assert "data=" not in shared_settings([files, {**common, "data.source": "stdlib"}])  # differs: each row says it


def test_a_key_chosen_early_is_dropped_when_later_ones_make_it_redundant():
    # a splits {0,1} from {2,3}; b and c together tell all four apart, so a is not needed
    configs = [{"a": 0, "b": 0, "c": 0}, {"a": 0, "b": 1, "c": 1}, {"a": 1, "b": 0, "c": 1}, {"a": 1, "b": 1, "c": 0}]
    chosen = distinguishing_keys(configs, ["a", "b", "c"])
    assert len(chosen) == 2 and len({tuple(c[k] for k in chosen) for c in configs}) == 4


def test_a_runs_own_name_labels_it_unless_another_configuration_shares_it():
    configs = [{**c, "name": n} for c, n in zip(extend_configs(), ["parent", "plain", "PI", "NTK", "YaRN"])]
    keys, labels = configuration_labels(configs, ["name", *EXTEND_KEYS])
    assert labels == ["parent", "plain", "PI", "NTK", "YaRN"] and keys[0] == "name"
    # the same name on two configurations: the keys that tell them apart follow it
    configs[3]["name"] = configs[4]["name"] = "scaled"
    labels = configuration_labels(configs, ["name", *EXTEND_KEYS])[1]
    assert labels[3] != labels[4] and labels[3].startswith("scaled, ") and labels[0] == "parent"
    # seeds of one configuration share its name: still the name alone
    seeds = [{"pos.name": "rope", "name": "base"}, {"pos.name": "rope", "name": "base"}, {"pos.name": "alibi"}]
    assert configuration_labels(seeds, ["name", "pos.name"])[1] == ["base", "base", "alibi"]


def test_an_imported_run_is_named_after_its_model():
    assert source_name("hf:HuggingFaceTB/SmolLM2-135M@main") == "SmolLM2-135M"
    assert source_name("/models/SmolLM2-135M-Instruct.Q4_1.gguf") == "SmolLM2-135M-Instruct.Q4_1"
    assert source_name("/models/pythia-70m/") == "pythia-70m"
    assert len(source_name("/m/" + "x" * 80)) == 32


def test_lengths_on_a_log_axis_only_where_they_double():
    assert lengths_double([128, 256, 512, 1024, 2048]) and lengths_double([64, 256, 1024])
    assert not lengths_double([128, 256, 384, 512])  # 1x..4x of the training length: a linear axis


@pytest.mark.parametrize("name", ["", "x" * 33, "'a\tb'", "' padded'"])
def test_bad_names_are_refused_in_one_line_before_training(name, tmp_path):
    code, out, err = run_in_process("train", *TINY, f"name={name}", f"hydra.run.dir={tmp_path / 'run'}")
    assert code != 0 and "a run's name is 1 to 32 printable characters" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "run" / "checkpoint.pt").exists()


def test_an_imported_runs_training_defaults_are_not_compared(tmp_path):
    """An imported run's train.* keys are relpos's defaults (steps=600), not how the model was
    trained: compare keeps only its train.seq_len. Before, `all rows: ... steps=600` was said of
    SmolLM2, and beside a trained run `steps` would have told them apart."""
    from relpos_cli.results import IMPORT_FILE
    from relpos_cli.runs import Run, labelled_runs, name_variants

    config = {"pos": {"name": "rope"}, "model": {"d_model": 64}, "train": {"seq_len": 128, "steps": 600, "lr": 3e-3}}
    imported, trained = Run(tmp_path / "imported", config=config), Run(tmp_path / "trained", config=config)
    imported.path.mkdir()
    (imported.path / IMPORT_FILE).write_text("{}")
    _, labelled = labelled_runs([imported])
    assert labelled[0][1] == {"pos.name": "rope", "model.d_model": 64, "train.seq_len": 128}
    groups = [{"variant": "default", "label": "x"}]
    name_variants(groups, labelled)
    assert groups[0]["shared"] == "pos=rope, d_model=64, seq_len=128"
    _, both = labelled_runs([imported, trained])
    assert "train.steps" in both[1][1] and "train.steps" not in both[0][1]


def test_variants_of_several_methods_keep_the_method_in_their_labels():
    """SmolLM2's extension table named leaky ReRoPE `slope=0.125, window=4096`, ReRoPE `window=4096`
    and Self-Extend `group=8`: the method was lost. One method's variants stay short (`type=yarn`)."""
    from relpos_cli.tables import variant_labels

    mixed = ["default", "rerope.window=4096", "rerope.slope=0.125,rerope.window=4096",
             "self_extend.group=8,self_extend.window=4096", "rope_scaling.factor=auto_per_length,rope_scaling.type=yarn"]
    labels, _ = variant_labels(mixed)
    assert labels["default"] == "–"
    assert "rerope.window=4096" in labels["rerope.window=4096"]
    assert labels["self_extend.group=8,self_extend.window=4096"].startswith("self_extend.")
    assert "rope_scaling.type=yarn" in labels["rope_scaling.factor=auto_per_length,rope_scaling.type=yarn"]
    assert len(set(labels.values())) == len(mixed)
    scalings, _ = variant_labels(["default", "rope_scaling.factor=auto_per_length,rope_scaling.type=yarn",
                                  "rope_scaling.factor=auto_per_length,rope_scaling.type=ntk"])
    assert scalings["rope_scaling.factor=auto_per_length,rope_scaling.type=yarn"] == "type=yarn, factor=auto_per_length"


def test_a_variant_label_names_every_item_that_differs():
    """The fewest telling items named linear 4 and YaRN 16 `factor=4` and `factor=16` (which scaling
    was lost), Self-Extend by its group alone and sliding by its stride."""
    from relpos_cli.tables import variant_labels

    labels, _ = variant_labels(["default", "rope_scaling.factor=4,rope_scaling.type=linear",
                                "rope_scaling.factor=16,rope_scaling.type=yarn"])
    assert labels == {"default": "–", "rope_scaling.factor=4,rope_scaling.type=linear": "type=linear, factor=4",
                      "rope_scaling.factor=16,rope_scaling.type=yarn": "type=yarn, factor=16"}
    labels, _ = variant_labels(["default", "self_extend.group=8,self_extend.window=64", "protocol=sliding,stride=64"])
    assert labels["self_extend.group=8,self_extend.window=64"] == "self_extend.group=8, self_extend.window=64"
    assert labels["protocol=sliding,stride=64"] == "protocol=sliding, stride=64"


def test_a_setting_switched_off_is_left_out_of_a_label_that_says_something_else():
    """The PoSE comparison: plain RoPE, PoSE and randomized positions beside other schemes. Mutation
    checked: keeping null parts gives `dape, position_skip=null, randomized_positions=null`."""
    off = {"train.position_skip": None, "train.randomized_positions": None}
    configs = [{"pos.name": "dape", **off}, {"pos.name": "rope", **off},
               {"pos.name": "rope", **off, "train.position_skip": 2048},
               {"pos.name": "rope", **off, "train.randomized_positions": 2048}]
    keys = ["pos.name", "train.position_skip", "train.randomized_positions"]
    assert configuration_labels(configs, keys)[1] == [
        "dape", "rope", "rope, position_skip=2048", "rope, randomized_positions=2048"]
    # the null setting is all a label has: it stays, or plain RoPE would read "(all the same)"
    assert configuration_labels(configs[1:3], ["train.position_skip"])[1] == ["position_skip=null", "position_skip=2048"]
    # null beside absent would make two labels alike ("c=1" twice): every part stays
    alike = [{"a": None, "c": 1}, {"c": 1}, {"a": 2, "c": 1}, {"a": 2, "c": 3}]
    assert configuration_labels(alike, ["a", "c"])[1] == ["a=null, c=1", "c=1", "a=2, c=1", "a=2, c=3"]


def test_a_null_that_means_a_derived_default_is_compared_as_the_value_the_run_uses(tmp_path):
    """A trained run's model.mlp_hidden=null (mlp_ratio x d_model) and n_kv_heads=null (n_heads)
    beside an imported run that states the same widths: they must not tell the rows apart, and a real
    difference is labelled with the widths both use. Mutation checked: without runs.DERIVED_MODEL_KEYS
    the labels read `rope`, `rope, n_kv_heads=4`, `alibi` and `mlp_hidden=null`, `mlp_hidden=512`."""
    from relpos_cli.results import IMPORT_FILE
    from relpos_cli.runs import Run, labelled_runs

    def run(name, pos, **model):
        config = {"pos": {"name": pos}, "train": {"seq_len": 128},
                  "model": {"d_model": 64, "n_heads": 4, "mlp_ratio": 4, "mlp_hidden": None, "n_kv_heads": None, **model}}
        return Run(tmp_path / name, config=config)

    imported = run("imported", "rope", mlp_hidden=4 * 64, n_kv_heads=4)
    imported.path.mkdir()
    (imported.path / IMPORT_FILE).write_text("{}")
    shown, labelled = labelled_runs([run("trained", "rope"), imported, run("other", "alibi")])
    assert shown == ["pos.name"] and [label for _, _, label, _ in labelled] == ["rope", "rope", "alibi"]
    assert labelled[0][3] == labelled[1][3]  # one configuration: compare groups them as one row
    assert labelled[0][1]["model.mlp_hidden"] == 256 and labelled[0][1]["model.n_kv_heads"] == 4
    _, labelled = labelled_runs([run("trained", "rope"), run("wide", "rope", mlp_hidden=512)])
    assert [label for _, _, label, _ in labelled] == ["mlp_hidden=256", "mlp_hidden=512"]
