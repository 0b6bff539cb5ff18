"""A library leaves its host process's settings alone: importing relpos_cli and every one of its
modules changes nothing in os.environ or torch's dynamo config, and relpos's flex attention raises
dynamo's recompile limit only around its own calls. In a fresh interpreter, so nothing imported
earlier by other tests hides a change."""

import json
import subprocess
import sys

from conftest import REPO

IMPORT_EVERYTHING = """
import json, os, pkgutil, importlib, sys
import torch, torch._dynamo

def shown(value):
    # a set's repr follows its insertion history: the same set rebuilt can print in another order
    return repr(sorted(map(repr, value))) if isinstance(value, (set, frozenset)) else repr(value)

def snapshot():
    return {"environ": dict(os.environ), "dynamo": {k: shown(v) for k, v in torch._dynamo.config.get_config_copy().items()},
            "tf32": [torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32]}

before = snapshot()
import relpos_cli
# __main__ runs the CLI; lm_eval_model is lm-evaluation-harness's plugin, imported inside lm-eval's own
# process: importing it imports lm-eval, which sets HF_XET_HIGH_PERFORMANCE for its downloads
names = sorted(m.name for m in pkgutil.walk_packages(relpos_cli.__path__, "relpos_cli.")
               if m.name not in ("relpos_cli.__main__", "relpos_cli.lm_eval_model"))
for name in names:
    importlib.import_module(name)
after_import = snapshot()

from relpos_cli import attention
q = torch.randn(1, 1, 16, 8)
with torch.no_grad():
    attention.flex_attention(q, q, q, None)  # compiles flex once, with relpos's recompile limit
after_flex = snapshot()
print(json.dumps({"modules": len(names), "before": before, "after_import": after_import, "after_flex": after_flex}))
"""


def changed(a: dict, b: dict) -> dict:
    """Keys whose values differ, leaving out the variables torch's compiler sets for itself when it
    compiles (_TORCHINDUCTOR_*): any torch.compile in the host sets them, relpos or not."""
    return {k: (a.get(k), b.get(k)) for k in a.keys() | b.keys()
            if a.get(k) != b.get(k) and not k.startswith("_TORCHINDUCTOR_")}


def test_importing_relpos_and_calling_flex_leave_the_host_settings_alone(tmp_path):
    """Mutations checked, each fails: os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1") back in
    relpos_cli/__init__.py; the previous attention.py, which raised the recompile limit globally when
    it first compiled flex."""
    env = {"PYTHONPATH": str(REPO), "RELPOS_CACHE": str(tmp_path), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
           "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", IMPORT_EVERYTHING], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.splitlines()[-1])
    assert seen["modules"] > 30  # every module of the package was imported
    for stage in ("after_import", "after_flex"):
        for what in ("environ", "dynamo"):
            assert changed(seen["before"][what], seen[stage][what]) == {}, (stage, what)
        assert seen[stage]["tf32"] == seen["before"]["tf32"], stage
