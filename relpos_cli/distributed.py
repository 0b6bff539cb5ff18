"""Data-parallel training under torchrun: one process per device, one global batch.

`train.batch_size` is the global batch. Every rank draws the same global batch (the sampler's
generator is seeded alike everywhere) and keeps its own rows, so N processes run the same
optimisation as one process, up to the order of floating-point sums. `train.grad_accum` splits
the global batch into micro-steps when a device cannot hold it. Rank 0 alone writes the run dir.
Every command that runs a model asks here which device `device=auto|cpu|cuda` means (resolve_device).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn

from relpos_cli.compile_cache import compile_training_loss
from relpos_cli.errors import RelposError


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def machine_memory() -> int | None:
    """This machine's physical memory in bytes, what a command checks an allocation against before
    making it; None where the system does not say (not POSIX)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def sweep_job_number() -> int | None:
    """This process's job in a Hydra multirun (hydra.job.num: 0, 1, ... in the order the launcher
    was given them, in its worker processes too); None outside one."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return None
    hydra_cfg = HydraConfig.get()
    return int(hydra_cfg.job.num) if hydra_cfg.mode == RunMode.MULTIRUN else None


def resolve_device(name: str, job: int | None = None) -> torch.device:
    """device=auto|cpu|cuda|cuda:N as a torch device; a CUDA one also becomes the current device,
    where Triton and flex kernels launch.

    The jobs of a sweep running side by side on one machine (hydra/launcher=local, n_jobs > 1) all
    took GPU 0 of several: with auto or cuda, job k runs on GPU k mod the visible GPUs, round-robin
    (under SLURM each job sees its own one GPU, so it keeps it). An index given (cuda:1) stays as given.

    Args:
        name: cfg.device (or a command's --device).
        job: the sweep job's index; default: this Hydra multirun job's (sweep_job_number), None outside one.
    """
    if name not in ("auto", "cpu", "cuda") and not re.fullmatch(r"cuda:\d+", str(name)):
        raise RelposError(f"device={name!r}; choose one of: auto, cpu, cuda, cuda:N")
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RelposError(f"device={name} but no CUDA device is available; use device=cpu or device=auto")
    count = torch.cuda.device_count()
    if ":" in name:
        device = torch.device(name)
        if device.index >= count:
            raise RelposError(f"device={name} but {count} CUDA device(s) are visible: cuda:0 to cuda:{count - 1}")
    else:
        job = sweep_job_number() if job is None else job
        if job is None or count < 2:
            return torch.device("cuda")  # the current device, as before: one GPU, or one job
        device = torch.device("cuda", job % count)
    torch.cuda.set_device(device)
    return device


def setup() -> Ranks:
    """Join the process group torchrun describes in the environment (once); a single process otherwise.

    gloo carries CPU tensors and NCCL CUDA ones, so one group serves CPU and GPU runs alike."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return Ranks()
    if not dist.is_initialized():
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=30))
    return Ranks(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))


def teardown(finished: bool) -> None:
    """Leave the process group. After a run every rank finished, they first wait for each other:
    a rank that closed its gloo connections while another still used them aborted that one at exit
    ("terminate called without an active exception"). After an error no rank waits (the others may
    never arrive). A rank whose wait finds another gone (rank 0 stopped on a full disk while writing
    checkpoint.pt, say, and said why) stops with one line, not gloo's traceback."""
    if not dist.is_initialized():
        return
    try:
        if finished:
            dist.barrier()
    except RuntimeError:  # gloo's "Connection closed by peer", NCCL's DistBackendError
        raise RelposError(f"rank {dist.get_rank()}: another process of the run stopped before the end (its "
                          f"error is above); this one finished its part") from None
    finally:
        dist.destroy_process_group()


def local_device(device: torch.device, ranks: Ranks) -> torch.device:
    """Each rank of a CUDA run drives the GPU of its local rank."""
    if device.type != "cuda" or not ranks.enabled:
        return device
    torch.cuda.set_device(ranks.local_rank)
    return torch.device("cuda", ranks.local_rank)


def broadcast_from_main(value: Any) -> Any:
    """Rank 0's value on every rank (e.g. the run dir, whose name holds rank 0's clock)."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def check_batch_split(batch_size: int, grad_accum: int, ranks: Ranks) -> None:
    parts = grad_accum * ranks.world_size
    if batch_size % parts:
        raise RelposError(
            f"train.batch_size={batch_size} (the global batch) must divide into train.grad_accum={grad_accum} "
            f"x {ranks.world_size} process(es) = {parts} equal parts"
        )


def micro_batches(x: Tensor, y: Tensor, grad_accum: int, ranks: Ranks) -> list[tuple[Tensor, Tensor]]:
    """This rank's rows of each micro-step: micro-step m is rows [m*B/A, (m+1)*B/A) of the global
    batch, split evenly over the ranks. Equal sizes make the mean of the per-rank mean losses the
    global mean loss, which is what makes N processes equal one."""
    per_rank = x.shape[0] // (grad_accum * ranks.world_size)
    slices = []
    for m in range(grad_accum):
        start = (m * ranks.world_size + ranks.rank) * per_rank
        slices.append((x[start : start + per_rank], y[start : start + per_rank]))  # (B / (A*N), T)
    return slices


class LossModule(nn.Module):
    """DDP synchronises gradients through the wrapped module's forward: make that forward the loss."""

    def __init__(self, model: nn.Module, objective: Callable | None = None):
        super().__init__()
        self.model = model
        self.objective = objective

    def forward(self, tokens: Tensor, targets: Tensor, positions: Tensor | None = None) -> Tensor:
        if self.objective is None:
            return self.model.loss(tokens, targets, positions=positions)
        return self.objective(self.model, tokens, targets, positions=positions)


def loss_function(model: nn.Module, ranks: Ranks, device: torch.device, compile: bool | str,
                  objective: Callable | None = None) -> tuple[Callable, Callable]:
    """(loss_fn(x, y), no_sync()): the training loss, under DDP when there are several ranks.
    compile: train.compile (false, true or a torch.compile mode).
    objective(model, x, y, positions=None) replaces model.loss (a task's answer-only loss).
    no_sync() skips the gradient all-reduce of the micro-steps before the last."""
    if not ranks.enabled:
        loss_fn = model.loss if objective is None else functools.partial(objective, model)
        no_sync = contextlib.nullcontext
    else:
        wrapped = nn.parallel.DistributedDataParallel(
            LossModule(model, objective), device_ids=[device.index] if device.type == "cuda" else None
        )
        loss_fn, no_sync = wrapped, wrapped.no_sync
    # train.compile: fuses the forward + loss (and its backward); off by default because compiling
    # takes longer than a short CPU run saves
    if compile is not False:
        loss_fn = compile_training_loss(loss_fn, compile)
    return loss_fn, no_sync


def mean_over_ranks(value: Tensor, ranks: Ranks) -> Tensor:
    """The mean of a scalar over ranks, identical on every rank (so every rank takes the same decisions)."""
    if not ranks.enabled:
        return value
    value = value.detach().clone()
    dist.all_reduce(value)
    return value / ranks.world_size


def any_rank(flag: bool, ranks: Ranks, device: torch.device) -> bool:
    """True on every rank if it is true on one: a signal that reaches one rank stops them all at the same step."""
    if not ranks.enabled:
        return flag
    t = torch.tensor([int(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def sum_over_ranks(value: float, ranks: Ranks, device: torch.device) -> float:
    if not ranks.enabled:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t.item())


@contextlib.contextmanager
def main_first(ranks: Ranks) -> Iterator[None]:
    """Rank 0 runs the block (e.g. tokenizing into the cache) before the other ranks enter it."""
    if ranks.enabled and not ranks.is_main:
        dist.barrier()
    yield
    if ranks.enabled and ranks.is_main:
        dist.barrier()
