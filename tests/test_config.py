"""Every yaml in the config tree composes, and the user-facing keys exist."""

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from relpos_cli.config import apply_overrides, conf_dir
from relpos_cli.errors import RelposError

# experiment presets are appended (+experiment=...) to the global package: tests/test_eval_cli.py composes them
GROUP_OPTIONS = [(g.name, y.stem) for g in sorted(conf_dir().iterdir()) if g.is_dir() and g.name != "experiment"
                 for y in sorted(g.glob("*.yaml"))]


def compose_config(*overrides):
    with initialize_config_dir(str(conf_dir()), version_base="1.3"):
        return compose("config", overrides=list(overrides), return_hydra_config=False)


@pytest.mark.parametrize("group,option", GROUP_OPTIONS)
def test_every_yaml_composes(group, option):
    cfg = compose_config(f"{group}={option}")
    assert cfg[group] is not None


def test_pos_yaml_names_match_registry():
    from relpos_cli.positions import scheme_names

    files = sorted(p.stem for p in (conf_dir() / "pos").glob("*.yaml"))
    assert files == scheme_names()
    for name in files:
        assert OmegaConf.load(conf_dir() / "pos" / f"{name}.yaml").name == name


@pytest.mark.parametrize(
    "key",
    ["model.d_model", "model.n_layers", "model.n_heads", "train.seq_len", "train.batch_size", "train.steps",
     "train.lr", "train.log_every", "seed", "device", "eval.lengths", "eval.tokens", "wandb.mode", "pos.name"],
)
def test_user_interface_keys_exist(key):
    assert OmegaConf.select(compose_config(), key) is not None


def test_defaults():
    cfg = compose_config()
    assert cfg.wandb.mode == "offline" and cfg.device == "auto" and cfg.data.source == "stdlib"


def test_apply_overrides_to_a_saved_config():
    cfg = OmegaConf.create({"eval": {"lengths": [1], "tokens": 5}, "pos": {"name": "t5"}})
    cfg = apply_overrides(cfg, ["eval.lengths=[128,256]", "+eval.extra=3"])
    assert list(cfg.eval.lengths) == [128, 256] and cfg.eval.extra == 3
    with pytest.raises(RelposError, match="unknown config key 'eval.lenghts'"):
        apply_overrides(cfg, ["eval.lenghts=[1]"])


def test_a_sweep_run_dir_is_one_init_from_value():
    """Hydra would read `init_from=out/0_pos=rope,seed=0` as several overrides; quoted, the path comes back whole."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from relpos_cli.config import quote_path_overrides

    path = "outputs/x/0_+experiment=tasks,pos=rope,seed=0"
    quoted = quote_path_overrides([f"init_from={path}", "pos=rope,alibi", f"+init_from={path}"])
    assert quoted[1] == "pos=rope,alibi"  # other keys keep their sweep syntax
    parsed = OverridesParser.create().parse_overrides(quoted)
    assert parsed[0].value() == path and parsed[2].value() == path and not parsed[0].is_sweep_override()
