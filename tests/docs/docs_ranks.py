"""The README's and docs/'s Python examples, read from the pages, and the rank code that runs them
as written (tests/docs/test_docs.py).

Every ```python block on a page is preceded by ``<!-- example: NAME -->`` (an HTML comment: shown
neither on GitHub nor on the site). A block named in ``SETUPS`` runs as it is written on two
processes (``WORLD``: three for Fabric's ``devices=3``), env://, gloo, RANK/WORLD_SIZE/LOCAL_RANK/
MASTER_ADDR/MASTER_PORT as torchrun sets them (so Lightning and Accelerate take each process for a
rank): its setup makes only what the page leaves to the reader (a model, a loader, a step count, a
tensor, what the page's earlier example made), ``ADDRESSES`` maps the page's example hosts to this
machine's, and its check, run after the block on its names, returns what the test compares
across ranks. ``IN_PROCESS`` examples only make objects and run in the test's process. The rest
are in test_docs.NOT_RUN_HERE, each with the test that runs its job."""

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


def _data(n: int) -> Any:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    x = torch.randn(n, 8, generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=4)


def _net() -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


class Position:
    """accelerate-windows' position: windows done, as a Stateful."""

    def __init__(self) -> None:
        self.windows = 0

    def state_dict(self) -> dict[str, int]:
        return {"windows": self.windows}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.windows = int(sd["windows"])


def _accelerate(ns: dict[str, Any]) -> None:
    """The names of the page's Accelerate example: a model, optimizer, scheduler, loader."""
    import datetime

    import torch
    import torch.nn.functional as F
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ns.update(
        timedelta=datetime.timedelta,
        InitProcessGroupKwargs=InitProcessGroupKwargs,
        Accelerator=Accelerator,
        model=model,
        opt=opt,
        sched=torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5),
        loader=_data(32),
        loss_fn=F.mse_loss,
    )


def _accelerate_windows(ns: dict[str, Any]) -> None:
    """As the page's example before it left things: the accelerator made, everything prepared."""
    _accelerate(ns)
    import fastdist.accelerate

    kwargs = ns["InitProcessGroupKwargs"](timeout=ns["timedelta"](minutes=10))
    fastdist.accelerate.init_process_group(kwargs)
    accelerator = ns["Accelerator"](cpu=True, kwargs_handlers=[kwargs], gradient_accumulation_steps=2)
    prepared = accelerator.prepare(ns["model"], ns["opt"], _data(64), ns["sched"])
    ns.update(zip(("model", "opt", "loader", "sched"), prepared))
    ns.update(accelerator=accelerator, accum=2, windows=3, Position=Position)


def _fabric(ns: dict[str, Any]) -> None:
    """The names of the page's Fabric loop; each process is a rank (as under torchrun)."""
    import fastdist.lightning
    import torch
    import torch.nn.functional as F
    from lightning.fabric import Fabric

    model = _net()
    ns.update(
        Fabric=Fabric,
        fastdist=fastdist,
        model=model,
        opt=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        loader=_data(48),
        accum=2,
        loss_fn=F.mse_loss,
    )


def _fabric_fsdp2(ns: dict[str, Any]) -> None:
    """The names of the page's Fabric FSDP2 loop: the model, the loop's position, the step."""
    import fastdist.lightning
    import torch
    import torch.nn.functional as F
    from fastdist.examples.train_ddp import Progress
    from lightning.fabric import Fabric
    from torch.distributed.fsdp import fully_shard

    rank = int(os.environ["RANK"])

    def step() -> None:  # on the names the example made: its model and optimizer
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * ns["progress"].step + rank))
        ns["fabric"].backward(F.mse_loss(ns["model"](x), x.sum(1, keepdim=True).sin()))
        ns["opt"].step()
        ns["opt"].zero_grad()

    ns.update(
        Fabric=Fabric,
        fully_shard=fully_shard,
        fastdist=fastdist,
        net=_net(),
        progress=Progress(),
        steps=3,
        step=step,
    )


def _hf_trainer(ns: dict[str, Any]) -> None:
    """A tiny GPT-2 from its config and token data; the Trainer writes in the test's folder."""
    import torch
    import transformers

    class Data(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
        def __init__(self, n: int, seed: int) -> None:
            self.ids = torch.randint(0, 64, (n, 12), generator=torch.Generator().manual_seed(seed))

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    os.chdir(os.environ["FASTDIST_DOC_TMP"])  # output_dir="out", as the page writes it
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2)
    ns.update(model=transformers.GPT2LMHeadModel(config), train=Data(64, 1), val=Data(16, 2))


# What each example must have done ---------------------------------------------------------------


def _trained(ns: dict[str, Any]) -> dict[str, Any]:
    """The loop ran its steps; the parameters' sum (whole under FSDP2: equal on every rank)."""
    step = ns["progress"].step if "progress" in ns else ns["step"]
    assert step == ns["steps"], step
    return {"step": step, "params": _sum(ns["model"])}


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


def _windows(ns: dict[str, Any]) -> dict[str, Any]:
    assert ns["position"].windows == ns["windows"]
    return {"step": ns["position"].windows, "params": _sum(ns["model"])}


def _sum(model: Any) -> float:
    full = [getattr(p, "full_tensor", lambda p=p: p)() for p in model.parameters()]
    return float(sum(p.detach().sum() for p in full))


def _gathered_losses(ns: dict[str, Any]) -> dict[str, Any]:
    sched = getattr(ns["sched"], "scheduler", ns["sched"])  # Accelerate's wrapper holds torch's
    return {"step": sched.last_epoch, "params": _sum(ns["model"]), "losses": ns["losses"].numel()}


def _fabric_trained(ns: dict[str, Any]) -> dict[str, Any]:
    return {"step": ns["i"] + 1, "params": _sum(ns["model"])}


def _trainer_trained(ns: dict[str, Any]) -> dict[str, Any]:
    assert ns["trainer"].state.global_step > 0, ns["trainer"].state
    return {"step": ns["trainer"].state.global_step, "params": _sum(ns["model"])}


def _grad(ns: dict[str, Any]) -> dict[str, Any]:
    return {"grad": ns["grad"].tolist()}


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
    "snapshots-fsdp2": (_fsdp2, _trained),
    "snapshots-checkpoint": (_fsdp2_restarted, _trained),
    "accelerate-loop": (_accelerate, _gathered_losses),
    "accelerate-windows": (_accelerate_windows, _windows),
    "fabric-loop": (_fabric, _fabric_trained),
    "fabric-fsdp2": (_fabric_fsdp2, _trained),
    "hf-trainer": (_hf_trainer, _trainer_trained),
}
# The processes an example needs, where not two: Fabric's devices=3.
WORLD = {"fabric-loop": 3, "fabric-fsdp2": 3}


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
# What a page writes for GPUs, as it is written on a machine without one: Accelerate runs each CPU
# process alone unless told cpu=True (fastdist.accelerate.step refuses that: test_frameworks.py).
ON_CPU = {"accelerate-loop": {"Accelerator(kwargs_handlers=": "Accelerator(cpu=True, kwargs_handlers="}}


def run_example(ctx: Any) -> None:
    """Rank code: the example named by $FASTDIST_DOC_EXAMPLE, as written, after its setup; records
    ``ran`` with its check's fields."""
    name = os.environ["FASTDIST_DOC_EXAMPLE"]
    os.environ.update(RANK=str(ctx.rank), WORLD_SIZE=str(ctx.world_size), LOCAL_RANK=str(ctx.rank))
    where, src = blocks()[name]
    for page_addr, here in ADDRESSES.items():
        src = src.replace(page_addr, here.format(port=os.environ["MASTER_PORT"]))
    for gpu, cpu in ON_CPU.get(name, {}).items():
        assert gpu in src, f"{name}: the page no longer writes {gpu!r}"
        src = src.replace(gpu, cpu)
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
