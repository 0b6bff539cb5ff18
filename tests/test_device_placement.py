"""Device placement on one machine with several GPUs (issue 41): the jobs of a local sweep run
round-robin over the visible GPUs instead of all on GPU 0; an index given stays as given. On CPU,
with the GPU count faked."""

import pytest
import torch

from relpos_cli.distributed import resolve_device
from relpos_cli.errors import RelposError
from relpos_cli.settings import validate


@pytest.fixture
def gpus(monkeypatch):
    """A machine with `count` GPUs, as torch.cuda tells it; the devices made current are recorded."""
    current: list[torch.device] = []

    def machine(count: int) -> list[torch.device]:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "set_device", current.append)
        return current

    return machine


@pytest.mark.parametrize("name", ["auto", "cuda"])
def test_sweep_jobs_go_round_robin_over_the_gpus(gpus, name):
    """Mutation checked: resolve_device ignoring the job index puts all six jobs on `cuda` (GPU 0)."""
    current = gpus(4)
    placed = [resolve_device(name, job=k) for k in range(6)]
    assert placed == [torch.device("cuda", i) for i in (0, 1, 2, 3, 0, 1)]
    assert current == placed  # made current too: Triton and flex kernels launch on the current device


def test_an_index_given_stays_and_one_gpu_or_one_job_keeps_cuda(gpus):
    gpus(4)
    assert resolve_device("cuda:1", job=2) == torch.device("cuda", 1)
    assert resolve_device("cuda") == torch.device("cuda")  # no sweep job: the current device, as before
    assert resolve_device("cpu", job=3) == torch.device("cpu")
    gpus(1)
    assert resolve_device("auto", job=3) == torch.device("cuda")  # SLURM: each job sees its own GPU
    gpus(0)
    assert resolve_device("auto", job=3) == torch.device("cpu")


@pytest.mark.parametrize("count, name, message", [
    (2, "cuda:2", "device=cuda:2 but 2 CUDA device(s) are visible: cuda:0 to cuda:1"),
    (0, "cuda:0", "device=cuda:0 but no CUDA device is available"),
    (2, "gpu", "device='gpu'; choose one of: auto, cpu, cuda, cuda:N"),
    (2, "cuda:x", "device='cuda:x'; choose one of"),
])
def test_bad_devices_are_one_line_errors(gpus, count, name, message):
    gpus(count)
    with pytest.raises(RelposError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve_device(name)


def test_a_config_may_name_one_gpu_of_several():
    """Refused before by the schema: device='cuda:1'; choose one of: auto, cpu, cuda."""
    from hydra import compose, initialize_config_dir

    from relpos_cli.config import conf_dir

    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        for device in ("cuda:1", "cuda:12"):
            assert validate(compose("config", overrides=[f"device={device}"])).device == device
        with pytest.raises(RelposError, match="device='gpu:1'; choose one of"):
            validate(compose("config", overrides=["device=gpu:1"]))


def test_each_job_of_a_hydra_sweep_resolves_its_own_gpu(gpus, tmp_path, monkeypatch):
    """The job index comes from Hydra (hydra.job.num) in a real multirun. Mutation checked:
    sweep_job_number returning None puts every job on `cuda`."""
    from relpos_cli.jobs import run_hydra_job

    gpus(2)
    monkeypatch.chdir(tmp_path)
    placed = []
    failed = run_hydra_job(lambda cfg: placed.append(resolve_device(cfg.device)),
                           ["seed=0,1,2", "device=auto", f"hydra.sweep.dir={tmp_path / 'sweep'}"], True, None)
    assert not failed and placed == [torch.device("cuda", i) for i in (0, 1, 0)]
