"""The README's and docs/'s Python examples, read from the pages, and the rank code that runs them
as written (tests/docs/test_docs.py).

Every ```python block on a page is preceded by ``<!-- example: NAME -->`` (an HTML comment: shown
neither on GitHub nor on the site). A block named in ``SETUPS`` runs as it is written on two
processes (env://, gloo, MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE as torchrun sets them): its setup
makes only what the page leaves to the reader (a model, a batch function, a step count, a tensor,
a group the page's earlier block initialized), ``ADDRESSES`` maps the page's example hosts to this
machine's, and its check, run after the block on its names, asserts what the block must have
done. The rest are in test_docs.NOT_RUN_HERE, each with the test that runs its job."""

from __future__ import annotations

import os
import re
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(
    r"^[ \t]*<!-- example: (?P<name>[a-z0-9-]+) -->\n[ \t]*```python\n(?P<src>.*?)^[ \t]*```",
    re.DOTALL | re.MULTILINE,
)
_FENCE = re.compile(r"^[ \t]*```python$", re.MULTILINE)


def blocks() -> dict[str, tuple[str, str]]:
    """Every named example: name -> (where: ``page:line``, its source, dedented). A ```python
    block without a name, or a name used twice, is an error (ValueError naming the page)."""
    out: dict[str, tuple[str, str]] = {}
    for page in PAGES:
        text = page.read_text()
        found = list(_BLOCK.finditer(text))
        if len(found) != len(_FENCE.findall(text)):
            raise ValueError(f"{page.name}: a ```python block without <!-- example: NAME --> above it")
        for m in found:
            if m.group("name") in out:
                raise ValueError(f"{page.name}: example {m.group('name')!r} is named twice")
            line = text.count("\n", 0, m.start("src")) + 1
            out[m.group("name")] = (f"{page.relative_to(ROOT)}:{line}", textwrap.dedent(m.group("src")))
    return out


# What the pages leave to the reader -------------------------------------------------------------


def _init(ns: dict[str, Any]) -> None:
    """The group a page's earlier example made."""
    import fastdist

    fastdist.init_process_group("gloo")


def _ddp_loop(ns: dict[str, Any]) -> None:
    """A model, its data (a function of the step alone) and the step count; ``Progress`` is
    train_ddp.py's, as replacement.md shows it."""
    import torch
    from fastdist.examples.train_ddp import Progress

    torch.manual_seed(0)
    rank = int(os.environ["RANK"])
    ns.update(
        net=torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)),
        batch=lambda step: torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + rank)),
        steps=3,
        Progress=Progress,
    )


def _tensors(ns: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    _init(ns)
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.full((2,), float(rank))
    ns.update(
        tensor=t,
        t=t,
        out_list=[torch.zeros(2) for _ in range(world)],
        out=[torch.zeros(2) for _ in range(world)],
        group=dist.group.WORLD,
        grad=torch.ones(3),
        torch_work_or_future=dist.all_reduce(torch.ones(1), async_op=True),
    )


def _recover_loop(ns: dict[str, Any]) -> None:
    import torch

    ns.update(grad=torch.ones(1), steps=3)


def _rpc(ns: dict[str, Any]) -> None:
    import torch

    ns.update(rank=int(os.environ["RANK"]), fn=torch.neg, x=torch.ones(2))


def _rendezvous(ns: dict[str, Any]) -> None:
    ns.update(r=int(os.environ["RANK"]), n=int(os.environ["WORLD_SIZE"]))


def _grow(ns: dict[str, Any]) -> None:
    import torch

    _init(ns)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def train_step() -> None:
        opt.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        opt.step()

    ns.update(step=0, steps=3, model=model, state={"model": model, "optim": opt}, train_step=train_step)


def _fsdp2(ns: dict[str, Any]) -> None:
    """A model sharded with FSDP2 over both ranks, its optimizer and one step of training."""
    import torch
    from fastdist.examples.train_ddp import Progress
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    _init(ns)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    fully_shard(model, mesh=init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    rank = int(os.environ["RANK"])

    def train_one_step(step: int) -> None:
        opt.zero_grad()
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + rank))
        model(x).pow(2).mean().backward()
        opt.step()

    progress = Progress()
    ns.update(
        model=model,
        opt=opt,
        progress=progress,
        steps=3,
        train_one_step=train_one_step,
        state={"model": model, "optim": opt, "progress": progress},
    )


def _fsdp2_restarted(ns: dict[str, Any]) -> None:
    """As _fsdp2, restarted: a checkpoint of the untrained model is on disk."""
    import fastdist

    _fsdp2(ns)
    ckpt = os.path.join(os.environ["FASTDIST_DOC_TMP"], "ckpt")
    fastdist.save_checkpoint(ns["state"], ckpt)
    ns.update(ckpt=ckpt, restarted=True, os=os)


# What each example must have done ---------------------------------------------------------------


def _trained(ns: dict[str, Any]) -> dict[str, Any]:
    """The loop ran its steps; the parameters' sum (equal on every rank under DDP)."""
    step = ns["progress"].step if "progress" in ns else ns["step"]
    assert step == ns["steps"], step
    model = ns["model"]
    return {"step": step, "params": float(sum(p.detach().sum() for p in model.parameters()))}


def _gathered(ns: dict[str, Any], key: str = "out_list") -> dict[str, Any]:
    return {"gathered": [t.tolist() for t in ns[key]]}


def _async(ns: dict[str, Any]) -> dict[str, Any]:
    assert ns["h"].is_completed() and ns["h"].exception() is None
    return {"grad": ns["grad"].tolist()}


def _rpc_done(ns: dict[str, Any]) -> dict[str, Any]:
    return {"rank": ns["rank"]}


def _progress(ns: dict[str, Any]) -> dict[str, Any]:
    p = ns["Progress"]()
    p.load_state_dict({"step": 4})
    assert p.state_dict() == {"step": 4}
    return {"step": p.step}


def _world(ns: dict[str, Any]) -> dict[str, Any]:
    import fastdist

    return {"rank": fastdist.get_rank(), "world": fastdist.get_world_size()}


def _scopes(ns: dict[str, Any]) -> dict[str, Any]:
    rt = ns["rt"]
    assert rt.closed and not rt.is_timed_out() and 0 < rt.remaining() <= 30
    return _gathered(ns, "out")


def _grad(ns: dict[str, Any]) -> dict[str, Any]:
    return {"grad": ns["grad"].tolist()}


def _fsdp2_trained(ns: dict[str, Any]) -> dict[str, Any]:
    assert ns["progress"].step == ns["steps"]
    full = [p.full_tensor() for p in ns["model"].parameters()]
    return {"step": ns["progress"].step, "params": float(sum(p.sum() for p in full))}


# name -> (setup, check): the examples that run here as written.
SETUPS: dict[
    str, tuple[Callable[[dict[str, Any]], None] | None, Callable[[dict[str, Any]], dict[str, Any]]]
] = {
    "readme-barrier": (None, _world),
    "readme-ddp-loop": (_ddp_loop, _trained),
    "index-barrier": (_init, _world),
    "index-ddp-loop": (_ddp_loop, _trained),
    "api-bounded": (_tensors, _gathered),
    "api-async": (_tensors, _async),
    "api-recover": (_recover_loop, _grad),
    "api-rpc": (_rpc, _rpc_done),
    "api-rendezvous": (_rendezvous, _world),
    "api-scopes": (_tensors, _scopes),
    "replacement-ddp-loop": (_ddp_loop, _trained),
    "replacement-progress": (None, _progress),
    "replacement-grow": (_grow, _trained),
    "snapshots-fsdp2": (_fsdp2, _fsdp2_trained),
    "snapshots-checkpoint": (_fsdp2_restarted, _fsdp2_trained),
}


def _lightning(ns: dict[str, Any]) -> None:
    """What frameworks.md's first example imported: Lightning, fastdist.lightning, fully_shard."""
    import fastdist.lightning
    import lightning as L
    from torch.distributed.fsdp import fully_shard

    ns.update(L=L, fully_shard=fully_shard, fastdist=fastdist)


def _strategy(ns: dict[str, Any]) -> dict[str, Any]:
    st = ns["strategy"]
    return {
        "step_timeout": st._fastdist_step_timeout,
        "collective_timeout": st._fastdist_collective_timeout,
        "copies": st._fastdist_snapshot_copies,
    }


# name -> (setup, check): examples that make objects only (no group, no process of their own): they
# run as written in the test's process.
IN_PROCESS: dict[str, tuple[Callable[[dict[str, Any]], None], Callable[[dict[str, Any]], dict[str, Any]]]] = {
    "lightning-fsdp2": (_lightning, _strategy),
    "lightning-fsdp2-snapshots": (_lightning, _strategy),
}


def run_in_process(name: str) -> dict[str, Any]:
    """The example ``name`` of IN_PROCESS, as written, after its setup: its check's fields."""
    where, src = blocks()[name]
    setup, check = IN_PROCESS[name]
    ns: dict[str, Any] = {"__name__": f"example_{name.replace('-', '_')}"}
    setup(ns)
    exec(compile(src, where, "exec"), ns)  # noqa: S102 - the page's example, as written
    return check(ns)


# The pages' example hosts, as this machine's: "{port}" is the job's MASTER_PORT.
ADDRESSES = {"10.0.0.1:29500": "127.0.0.1:{port}"}


def run_example(ctx: Any) -> None:
    """Rank code: the example named by $FASTDIST_DOC_EXAMPLE, as written, after its setup; records
    ``ran`` with its check's fields."""
    name = os.environ["FASTDIST_DOC_EXAMPLE"]
    os.environ.update(RANK=str(ctx.rank), WORLD_SIZE=str(ctx.world_size), LOCAL_RANK=str(ctx.rank))
    where, src = blocks()[name]
    for page_addr, here in ADDRESSES.items():
        src = src.replace(page_addr, here.format(port=os.environ["MASTER_PORT"]))
    setup, check = SETUPS[name]
    import fastdist
    import torch

    # Every page opens with ``import fastdist, torch``; its later examples take them as imported.
    ns: dict[str, Any] = {
        "__name__": f"example_{name.replace('-', '_')}",
        "fastdist": fastdist,
        "torch": torch,
    }
    if setup is not None:
        setup(ns)
    exec(compile(src, where, "exec"), ns)  # noqa: S102 - the page's example, as written
    ctx.record("ran", **check(ns))
