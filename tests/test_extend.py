"""Extending a trained run: init_from (fine-tune from a parent's final weights)."""

import json
import shutil

import pytest
import torch
from omegaconf import OmegaConf

from conftest import TINY, final_weights, metrics, run_in_process
from relpos_cli.checkpoint import load_config, load_trained_model
from relpos_cli.train import BatchPlan, WindowSampler

pytestmark = pytest.mark.usefixtures("in_temp_cwd")
PARENT = [*TINY, "train.steps=6", "device=cpu", "pos=rope"]
CHILD = ["train.seq_len=64", "train.steps=8", "train.batch_size=4", "train.log_every=1", "train.val_batches=1",
         "train.ckpt_every=4", "wandb.mode=disabled", "device=cpu"]
# the child also draws its lengths and positions, so the resume test covers those draws
DRAWN = ["train.randomized_positions=256", "train.length_schedule=uniform", "train.min_seq_len=16"]


def train(*args):
    code, out, err = run_in_process("train", *args)
    assert code == 0, err
    return out


@pytest.fixture(scope="module")
def parent(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("parent") / "run"
    train(*PARENT, f"hydra.run.dir={run_dir}")
    return run_dir


# what the child's training loop fed its model, recorded as it trained (not re-derived with the
# code under test): the weights, tokens and positions of the first step, and every step's batch shape
FED: dict = {}


@pytest.fixture(scope="module")
def child(parent, tmp_path_factory):
    from relpos_cli.model import Transformer

    run_dir = tmp_path_factory.mktemp("child") / "run"
    loss = Transformer.loss

    def recording_loss(model, tokens, targets, reduction="mean", positions=None):
        if torch.is_grad_enabled():  # a training step, not validation
            if "weights" not in FED:
                FED.update(weights={k: v.clone() for k, v in model.state_dict().items()}, first=(tokens, targets, positions))
            FED.setdefault("shapes", []).append(tuple(tokens.shape))
        return loss(model, tokens, targets, reduction, positions)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Transformer, "loss", recording_loss)
        train(f"init_from={parent}", *CHILD, *DRAWN, f"hydra.run.dir={run_dir}")
    return run_dir


def test_child_starts_from_the_parents_exact_weights(parent, child):
    """The weights the child's first step ran with are the parent's final ones, and its logged loss is
    the parent's model on the batch that step was fed, at the randomized positions it drew.
    Mutation checked: not loading the parent's weights at step 0 (train.py) fails here."""
    parent_weights = final_weights(parent)
    assert FED["weights"].keys() == parent_weights.keys()
    assert all(torch.equal(FED["weights"][k], parent_weights[k]) for k in parent_weights)
    _, model = load_trained_model(parent, torch.device("cpu"))
    x, y, positions = FED["first"]
    assert positions is not None and bool((positions.diff() > 0).all()) and int(positions[-1]) < 256
    model.train()
    assert metrics(child)[0]["loss"] == model.loss(x, y, positions=positions).item()
    assert metrics(child)[0]["loss"] != model.loss(x, y).item()  # the positions made a difference
    cfg = load_config(child)
    assert cfg.init_from == str(parent) and cfg.model.d_model == 32  # model=tiny came from the parent
    assert cfg.train.seq_len == 64 and metrics(child)[0]["step"] == 1


@pytest.mark.parametrize("kept", ["periodic", "none"])
def test_a_child_resumes_bitwise(child, tmp_path, kept):
    """A child killed after its step-4 checkpoint (or before any) resumes into the same run."""
    copy = tmp_path / "copy"
    shutil.copytree(child, copy)
    (copy / "checkpoint.pt").unlink()
    if kept == "none":
        shutil.rmtree(copy / "checkpoints")
    train(f"resume={copy}")
    assert [m["loss"] for m in metrics(copy)] == [m["loss"] for m in metrics(child)]
    want, got = final_weights(child), final_weights(copy)
    assert all(torch.equal(want[k], got[k]) for k in want)


@pytest.mark.parametrize("override, message", [
    ("model.d_model=64", "model.d_model=64 but the parent has model.d_model=32"),
    ("model=small", "model.d_model=192 but the parent has model.d_model=32"),
    ("pos=alibi", "pos=alibi but the parent has pos=rope"),
    ("pos.base=500", "pos.base=500 but the parent has pos.base=10000.0"),
])
def test_changing_the_model_or_the_scheme_is_a_one_line_error(parent, tmp_path, override, message):
    code, _, err = run_in_process("train", f"init_from={parent}", override, *CHILD, f"hydra.run.dir={tmp_path / 'c'}")
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_a_parent_that_is_missing_or_unfinished_is_a_one_line_error(parent, tmp_path):
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    shutil.copy(parent / "config.yaml", unfinished)
    for missing, message in [(tmp_path / "nowhere", "run dir not found"), (unfinished, "has no checkpoint.pt")]:
        code, _, err = run_in_process("train", f"init_from={missing}", *CHILD, f"hydra.run.dir={tmp_path / 'c'}")
        assert code == 2 and f"init_from={missing}: " in err and message in err and len(err.strip().splitlines()) == 1


def test_compare_shows_parent_and_child_side_by_side(parent, child, tmp_path):
    code, out, err = run_in_process("compare", str(parent), str(child), "eval.lengths=[32,64]", "eval.tokens=256",
                                    "--out", str(tmp_path / "cmp"))
    assert code == 0, err
    # the child differs from its parent in several keys at once: one of them tells the rows apart;
    # compare.json keeps every differing key's value
    groups = json.loads((tmp_path / "cmp" / "compare.json").read_text())["groups"]
    assert len({g["label"] for g in groups}) == 2 and all("," not in g["label"] for g in groups)
    configs = sorted((g["config"] for g in groups), key=lambda c: c["init_from"] is None)
    # the child's init_from is its parent as it differs from the child (PARENT's and CHILD's own values)
    assert configs[0]["train.randomized_positions"] == 256
    assert configs[0]["init_from"]["train.steps"] == 6 and configs[0]["init_from"]["train.seq_len"] == 32
    assert configs[0]["init_from"]["train.randomized_positions"] is None and "seed" not in configs[0]["init_from"]
    assert configs[1]["init_from"] is None


@pytest.fixture(scope="module")
def second_family(tmp_path_factory):
    """A parent that differs from `parent` in its seed alone, and a child fine-tuned from it as `child`
    was from `parent`."""
    root = tmp_path_factory.mktemp("seed1")
    train(*PARENT, "seed=1", f"hydra.run.dir={root / 'parent'}")
    train(f"init_from={root / 'parent'}", *CHILD, *DRAWN, "seed=1", f"hydra.run.dir={root / 'child'}")
    return root


def test_children_of_parents_that_differ_in_their_seed_are_seeds_of_one_row(parent, child, second_family, tmp_path):
    """Extending three seeds' parents gives one row with n = 3, not a row per parent path.
    Mutation checked: comparing init_from by its path (as before) gives a row per child here."""
    runs = [parent, child, second_family / "parent", second_family / "child"]
    code, _, err = run_in_process("compare", *map(str, runs), "eval.lengths=[32,64]", "eval.tokens=256",
                                  "--out", str(tmp_path / "cmp"))
    assert code == 0, err
    groups = json.loads((tmp_path / "cmp" / "compare.json").read_text())["groups"]
    assert sorted(sorted(g["runs"]) for g in groups) == sorted([sorted(str(r.resolve()) for r in runs[0::2]),
                                                                sorted(str(r.resolve()) for r in runs[1::2])])
    assert all(c["n"] == 2 for g in groups for c in g["cells"].values())


# ---- train.randomized_positions and train.length_schedule ---------------------------------------------
def plan(**train):
    return BatchPlan(OmegaConf.create({"seq_len": 64, "min_seq_len": 16, "length_schedule": "fixed", "steps": 50,
                                       "randomized_positions": 256, **train}), seed=0)


def test_randomized_positions_are_sorted_distinct_in_range_and_new_each_batch():
    draws = [plan_.positions(64, torch.device("cpu")) for plan_ in [plan()] for _ in range(50)]
    for p in draws:
        assert p.shape == (64,) and p.dtype == torch.int64
        assert bool((p[1:] > p[:-1]).all()) and int(p[0]) >= 0 and int(p[-1]) < 256  # sorted, distinct, in [0, N)
    assert len({tuple(p.tolist()) for p in draws}) == 50
    assert max(int(p[-1]) for p in draws) > 200  # the whole range is used, not only 0..L-1
    assert plan(randomized_positions=None).positions(64, torch.device("cpu")) is None


def test_the_draws_continue_exactly_from_a_saved_generator_state():
    first, second = plan(length_schedule="uniform"), plan(length_schedule="uniform")
    for step in range(1, 11):
        first.positions(first.length(step), torch.device("cpu"))
    second.generator.set_state(first.generator.get_state())
    for step in range(11, 21):
        length = first.length(step)
        assert second.length(step) == length
        assert torch.equal(first.positions(length, torch.device("cpu")), second.positions(length, torch.device("cpu")))


def test_length_schedules():
    assert {plan().length(s) for s in range(1, 51)} == {64}
    uniform_plan = plan(length_schedule="uniform")
    uniform = [uniform_plan.length(s) for s in range(1, 2001)]
    assert min(uniform) == 16 and max(uniform) == 64 and len(set(uniform)) == 49  # every length in [16, 64]
    curriculum_plan = plan(length_schedule="curriculum")
    curriculum = [curriculum_plan.length(s) for s in range(1, 51)]
    assert curriculum[0] == 16 and curriculum[-1] == 64 and curriculum == sorted(curriculum)
    # linear in the step: 48 tokens over 49 steps, one token or none per step, every length reached
    assert {b - a for a, b in zip(curriculum, curriculum[1:])} == {0, 1} and set(curriculum) == set(range(16, 65))


@pytest.mark.parametrize("pos", ["alibi", "t5", "fire", "rope", "learned"])
def test_explicit_positions_agree_across_backends_and_never_hit_a_stale_bias(pos):
    """Non-consecutive positions through every backend = the eager reference; the bias cache of
    a parameter-free bias (alibi) is rebuilt for new positions of the same length."""
    from relpos_cli.model import build_model

    cfg = {"model": {"d_model": 32, "n_layers": 2, "n_heads": 2, "mlp_ratio": 2}, "train": {"seq_len": 32},
           "pos": {"name": pos}}
    torch.manual_seed(0)
    models = {b: build_model({**cfg, "model": {**cfg["model"], "attn_backend": b}}, 64).eval()
              for b in ("eager", "sdpa", "chunked", "auto")}
    for m in models.values():
        m.load_state_dict(models["eager"].state_dict())
    tokens = torch.randint(0, 64, (2, 32))
    plan_ = plan()
    with torch.no_grad():
        for _ in range(2):
            positions = plan_.positions(32, torch.device("cpu"))
            want = models["eager"](tokens, positions=positions)
            assert not torch.allclose(want, models["eager"](tokens))
            for backend, m in models.items():
                assert torch.allclose(m(tokens, positions=positions), want, atol=1e-5), backend


@pytest.mark.parametrize("overrides, message", [
    (["pos=none", "train.randomized_positions=256"], "train.randomized_positions applies to schemes whose logits read position values; pos=none does not"),
    (["pos=learned", "pos.max_positions=100", "train.randomized_positions=256"], "train.randomized_positions=256 draws positions up to 255: pos=learned has a table of 100 positions"),
    (["train.randomized_positions=16"], "train.randomized_positions=16 is below train.seq_len=32"),
    (["train.length_schedule=uniform", "train.min_seq_len=64"], "train.min_seq_len must be in [1, 32], got 64"),
    (["train.length_schedule=longest"], "train.length_schedule='longest'; choose one of: fixed, uniform, curriculum"),
    (["pos=alibi", "+pos.scaling.type=linear"], "pos.scaling applies to schemes that rotate q and k with RoPE's frequencies (p_rope, rope, xpos); pos=alibi does not"),
    (["pos.scaling.type=yarn", "pos.scaling.factor=0.5"], "pos.scaling.factor=0.5 is below 1"),
])
def test_bad_extension_settings_are_one_line_errors(tmp_path, overrides, message):
    code, _, err = run_in_process("train", *TINY, "device=cpu", *overrides, f"hydra.run.dir={tmp_path / 'r'}")
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_metrics_count_the_tokens_of_the_drawn_lengths(child):
    """Each row's token count is the sum of the batches the model was fed up to that step, whose
    lengths the uniform schedule varies. Mutation checked: counting batch_size x seq_len per step fails."""
    shapes = FED["shapes"]
    assert len(shapes) == 8 and len({t for _, t in shapes}) > 1 and all(b == 4 for b, _ in shapes)
    fed = [sum(b * t for b, t in shapes[:step]) for step in range(1, 9)]
    assert [row["tokens"] for row in metrics(child)] == fed


def test_task_batches_follow_the_batch_length():
    """A task run's batch of length L: examples drawn up to L and padded to it, mixed language-model
    rows of L tokens."""
    import numpy as np

    from relpos_cli.tasks import build_task, task_settings
    from relpos_cli.tasks.base import Encoder
    from relpos_cli.tasks.training import IGNORE, TaskSampler
    from relpos_cli.tokenizers import ByteTokenizer

    corpus = np.arange(5000) % 200
    lm = WindowSampler(corpus, 64, 2, 0, torch.device("cpu"))
    from relpos_cli.config import conf_dir

    task = build_task(task_settings(OmegaConf.to_container(OmegaConf.load(conf_dir() / "task" / "copy.yaml"))),
                      Encoder(ByteTokenizer()))
    sampler = TaskSampler(task, 64, 6, lm, 0, 0, torch.device("cpu"))
    for length in (8, 20, 64):
        x, y = sampler(length)
        assert x.shape == y.shape == (8, length)
        answers = (y[2:] != IGNORE).sum(1)
        assert bool((answers >= 1).all()) and bool((answers <= length // 2).all())
    assert sampler()[0].shape == (8, 64)


def test_compare_labels_name_a_schemes_nested_options_only_where_they_differ_within_it():
    from relpos_cli.tables import configuration_labels

    rope, alibi = {"pos.name": "rope", "pos.scaling.type": "none"}, {"pos.name": "alibi"}
    assert configuration_labels([rope, alibi], ["pos.name", "pos.scaling.type"])[1] == ["rope", "alibi"]
    yarn = {"pos.name": "rope", "pos.scaling.type": "yarn"}
    assert configuration_labels([rope, alibi, yarn], ["pos.name", "pos.scaling.type"])[1] == [
        "rope, type=none", "alibi", "rope, type=yarn"]
