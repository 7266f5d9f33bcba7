"""The operations the benchmarks time, shared by rank 0 (the pytest process) and the peer."""

from __future__ import annotations

from typing import Callable

import fastdist
import torch
import torch.distributed as dist


def _checked(fn: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        fastdist.set_checks(True)
        try:
            fn()
        finally:
            fastdist.set_checks(False)

    return run


def make_groups() -> tuple:
    """The benchmarks' two groups over the same ranks, made the same way (new_group): a plain gloo
    group, made before fastdist watches anything (the default group came from torch's own
    init_process_group), and a watched one, made once watching is on (as after
    fastdist.init_process_group). Every rank calls this in the same order."""
    from fastdist.groups import registry
    from fastdist.ops import watching

    ranks = list(range(dist.get_world_size()))
    plain = dist.new_group(ranks)
    watching.activate(None)
    watched = dist.new_group(ranks)
    assert registry.is_watched(watched) and not registry.is_watched(plain)
    return plain, watched


def same_connections(watched: dist.ProcessGroup) -> dist.ProcessGroup:
    """A plain torch ProcessGroup over the watched group's own gloo backend (its inner one): the
    same connections and gloo threads, without fastdist's wrapper. At 1 MB each gloo connection
    settles into a speed of its own on this 2-core machine (six groups over the same two ranks:
    medians of 0.9 to 2.3 ms in one run), which swamps any wrapper's cost; compared over the same
    connections, only the wrapper differs."""
    cpu = torch.device("cpu")
    pg = dist.ProcessGroup(dist.HashStore(), watched.rank(), watched.size())
    pg._register_backend(cpu, dist.ProcessGroup.BackendType.GLOO, watched._get_backend(cpu).inner)
    pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    return pg


def _ddp_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()

    return step


def make_ops(world_size: int) -> dict[str, Callable[[], None]]:
    plain, watched = make_groups()
    same = same_connections(watched)
    one = torch.ones(1)
    out1 = [torch.zeros(1) for _ in range(world_size)]
    mb = torch.ones(256 * 1024)  # 1 MB of float32
    out_mb = [torch.zeros_like(mb) for _ in range(world_size)]
    # A DDP training step on a model of about 1M parameters, on each group (same weights).
    ddp = {}
    x = torch.randn(32, 1024, generator=torch.Generator().manual_seed(0))
    for name, group in (("plain", plain), ("watched", watched)):
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(
            torch.nn.Sequential(torch.nn.Linear(1024, 960), torch.nn.ReLU(), torch.nn.Linear(960, 16)),
            process_group=group,
        )
        ddp[name] = _ddp_step(model, torch.optim.SGD(model.parameters(), lr=1e-3), x)
    return {
        # fastdist's own calls (on a watched group, as after fastdist.init_process_group) against
        # raw torch on a plain gloo group.
        "raw_barrier": lambda: dist.barrier(same),
        "fd_barrier": lambda: fastdist.barrier(watched, timeout=30),
        "raw_all_gather_1": lambda: dist.all_gather(out1, one, same),
        "fd_all_gather_1": lambda: fastdist.all_gather(out1, one, watched, timeout=30),
        # 1 MB: raw torch over the watched group's own connections (see same_connections).
        "raw_all_gather_1mb": lambda: dist.all_gather(out_mb, mb, same),
        "fd_all_gather_1mb": lambda: fastdist.all_gather(out_mb, mb, watched, timeout=30),
        "raw_all_reduce_1": lambda: dist.all_reduce(one, group=same),
        "fd_all_reduce_1": lambda: fastdist.all_reduce(one, group=watched, timeout=30),
        "raw_all_reduce_1mb": lambda: dist.all_reduce(mb, group=same),
        "fd_all_reduce_1mb": lambda: fastdist.all_reduce(mb, group=watched, timeout=30),
        # torch.distributed itself on a watched group against the same on a plain group.
        "w_all_reduce_1": lambda: dist.all_reduce(one, group=watched),
        "w_all_reduce_1mb": lambda: dist.all_reduce(mb, group=watched),
        "raw_ddp_step": ddp["plain"],
        "w_ddp_step": ddp["watched"],
        # FASTDIST_CHECK's price: the same all_reduce with the cross-rank signature check on.
        "fd_all_reduce_1_checked": _checked(lambda: fastdist.all_reduce(one, group=watched, timeout=30)),
    }
