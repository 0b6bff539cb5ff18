"""init_from with the parent's own scheme named again, for every registered scheme (issue 41):
`pos=<the parent's scheme>` and each of the parent's pos.* values repeated are accepted, and the
child keeps the parent's options; a weight-shaping option set to another value is still refused."""

import pytest
from omegaconf import OmegaConf

from conftest import run_in_process
from relpos_cli.config import conf_dir, flatten_config
from relpos_cli.positions import scheme_names

pytestmark = pytest.mark.usefixtures("in_temp_cwd")
RUN = ["model=tiny", "train.steps=1", "train.batch_size=2", "train.seq_len=16", "train.log_every=1",
       "train.val_batches=1", "wandb.mode=disabled", "device=cpu"]
# each scheme's parent trained with options other than its yaml's defaults, where it has any, so that
# a child composed from the defaults differs from it
NON_DEFAULT = {
    "cope": ["pos.max_positions=32"],
    "dape": ["pos.base=kerple_log", "+pos.base_options.shared_layers=false", "pos.mlp_width=8"],
    "fire": ["pos.mlp_width=8", "pos.init_c=0.2", "pos.init_threshold=8.0"],
    "kerple_log": ["pos.shared_layers=false"],
    "kerple_power": ["pos.shared_layers=false"],
    "learned": ["pos.max_positions=64"],
    "nope_scaled": ["pos.temperature=learned"],
    "p_rope": ["pos.keep=0.5", "pos.scaling.type=linear", "pos.scaling.original_length=8"],
    "rope": ["pos.base=500.0", "pos.rotary_fraction=0.5", "pos.scaling.type=yarn", "pos.scaling.original_length=8"],
    "sandwich": ["pos.dim=64", "pos.frequencies=vaswani"],
    "shaw": ["pos.max_distance=8"],
    "sinusoidal": ["pos.base=500.0", "pos.scale=fixed_inverse_sqrt_d"],
    "stickbreaking": ["pos.attend_current=true"],
    "t5": ["pos.num_buckets=16", "pos.max_distance=64", "pos.bidirectional=true", "pos.shared_layers=false",
           "pos.parameterization=hf"],
    "xpos": ["pos.scale_base=256.0", "pos.rotary_fraction=0.5"],
}
# an option whose other value shapes other weights, with such a value: refused
REFUSED = {"p_rope": "pos.keep=0.25", "dape": "pos.base=alibi", "nope_scaled": "pos.temperature=log_length",
           "stickbreaking": "pos.attend_current=false", "t5": "pos.num_buckets=32"}


def as_override(value) -> str:
    """A config value as Hydra's override grammar writes it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ",".join(as_override(v) for v in value) + "]"
    return str(value)


def repeated_values(pos: dict) -> list[str]:
    """Every pos.* leaf of a run's scheme as an override, `+` where the scheme's yaml lacks the key
    (DAPE's base_options.shared_layers, as docs/schemes.md writes it)."""
    defaults = flatten_config(OmegaConf.to_container(OmegaConf.load(conf_dir() / "pos" / f"{pos['name']}.yaml")), "pos")
    return [f"{'' if key in defaults else '+'}{key}={as_override(value)}"
            for key, value in flatten_config(pos, "pos").items() if key != "pos.name"]


def train(*args):
    return run_in_process("train", *RUN, *args)


@pytest.fixture(scope="module", params=scheme_names())
def parent(request, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp(f"parent_{request.param}") / "run"
    code, _, err = train(f"pos={request.param}", *NON_DEFAULT.get(request.param, []), f"hydra.run.dir={run_dir}")
    assert code == 0, err
    return run_dir


def parent_pos(run_dir) -> dict:
    return OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml").pos)


def test_the_parents_scheme_named_again_keeps_its_options(parent, tmp_path):
    """`init_from=RUN pos=<its scheme>` was refused where the parent's options were not the yaml's
    defaults (pos.keep=0.75 but the parent has pos.keep=0.5); another value of a weight-shaping
    option is still refused, in one line naming the key, with `pos=` and without it.
    Mutation checked: without the `given - {"pos"}` in lineage.inherit, p_rope, stickbreaking,
    nope_scaled, dape and the other non-default parents fail here."""
    pos = parent_pos(parent)
    code, _, err = train(f"init_from={parent}", f"pos={pos['name']}", f"hydra.run.dir={tmp_path / 'child'}")
    assert code == 0, err
    assert parent_pos(tmp_path / "child") == pos
    if pos["name"] in REFUSED:
        key = REFUSED[pos["name"]].split("=")[0]
        for scheme in ([], [f"pos={pos['name']}"]):
            code, _, err = train(f"init_from={parent}", *scheme, REFUSED[pos["name"]], f"hydra.run.dir={tmp_path / 'other'}")
            assert code == 2 and len(err.strip().splitlines()) == 1, err
            assert f"{key}=" in err and "but the parent has" in err
            assert not (tmp_path / "other" / "checkpoint.pt").exists()


def test_each_of_the_parents_own_values_repeated_is_accepted(parent, tmp_path):
    """Every pos.* value of the parent given again without `pos=`: the default scheme's yaml knew no
    pos.keep ("unknown config key"). Mutation checked: without lineage.with_parent_scheme in
    jobs.train_command, every scheme but rope fails here."""
    pos = parent_pos(parent)
    code, _, err = train(f"init_from={parent}", *repeated_values(pos), f"hydra.run.dir={tmp_path / 'child'}")
    assert code == 0, f"{repeated_values(pos)}: {err}"
    assert parent_pos(tmp_path / "child") == pos
