"""What each rank runs in the torch 2.x tests (``python -m parallel SPEC``; see
ranks.py): PyTorch's mesh-based parallelism over a backend given by name, so that one
test runs it over ferroccl and over gloo and compares."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import ferroccl
import ferroccl.torch
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from workers import init, main

DIM, HEADS, SEQ = 32, 4, 6


class Attention(nn.Module):
    """Self-attention whose heads follow its projections' width: split column-wise
    across a tensor-parallel mesh, each rank computes its own heads."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(DIM, DIM) for _ in range(3))
        self.out = nn.Linear(DIM, DIM)

    def forward(self, x):
        b, s, _ = x.shape
        hd = DIM // HEADS

        def heads(t):
            return t.view(b, s, -1, hd).transpose(1, 2)

        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        w = torch.softmax(q @ k.transpose(-1, -2) / hd**0.5, dim=-1)
        return self.out((w @ v).transpose(1, 2).reshape(b, s, -1))


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    """A small transformer block."""

    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn, self.mlp = Attention(), Mlp()

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def block(seed=0) -> Block:
    torch.manual_seed(seed)
    return Block()


def tp_plan(prefix=""):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {f"{prefix}attn.{p}": ColwiseParallel() for p in "qkv"}
    plan[f"{prefix}attn.out"] = RowwiseParallel()
    plan[f"{prefix}mlp.up"] = ColwiseParallel()
    plan[f"{prefix}mlp.down"] = RowwiseParallel()
    return plan


def full(t):
    """A parameter as one plain tensor (DTensors gathered)."""
    t = t.detach()
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def train(model, batches, steps, mean_over=None):
    """SGD on ``batches(step)``; the loss of each step averaged over ``mean_over``
    (the data-parallel group), and the parameters at the end, gathered."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for step in range(steps):
        x = batches(step)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss = loss.detach().clone()
        if mean_over is not None:
            dist.all_reduce(loss, group=mean_over)
            loss /= dist.get_world_size(mean_over)
        losses.append(loss.item())
    return losses, [full(p) for p in model.parameters()]


def data(seed):
    g = torch.Generator().manual_seed(seed)
    return lambda step: torch.randn(4, SEQ, DIM, generator=g)


def fsdp2(rank, n, how, tmp, backend, steps=8):
    """FSDP2 (``fully_shard``) on the block: each rank its own data."""
    from torch.distributed.device_mesh import init_device_mesh

    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch 2.4 and 2.5
        from torch.distributed._composable.fsdp import fully_shard

    init(rank, n, how, tmp, backend=backend)
    mesh = init_device_mesh("cpu", (n,))
    model = block()
    fully_shard(model.attn, mesh=mesh)
    fully_shard(model.mlp, mesh=mesh)
    fully_shard(model, mesh=mesh)
    out = train(model, data(100 + rank), steps, mean_over=dist.group.WORLD)
    dist.destroy_process_group()
    return out


def tensor_parallel(rank, n, how, tmp, backend, steps=8):
    """Megatron's layout through DTensor: the attention's and the MLP's first
    projections column-wise, the second row-wise; every rank the same data."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    init(rank, n, how, tmp, backend=backend)
    mesh = init_device_mesh("cpu", (n,))
    model = parallelize_module(block(), mesh, tp_plan())
    out = train(model, data(7), steps)
    dist.destroy_process_group()
    return out


def mesh_2d(rank, n, how, tmp, backend, steps=8):
    """A 2 x 2 mesh (data x tensor): tensor parallel within, FSDP2 across; each data
    rank its own data."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard

    init(rank, n, how, tmp, backend=backend)
    mesh = init_device_mesh("cpu", (2, n // 2), mesh_dim_names=("dp", "tp"))
    model = parallelize_module(block(), mesh["tp"], tp_plan())
    fully_shard(model, mesh=mesh["dp"])
    dp = mesh.get_group("dp")
    out = train(model, data(100 + mesh.get_local_rank("dp")), steps, mean_over=dp)
    dist.destroy_process_group()
    return out


def pipelining(rank, n, how, tmp, backend, schedule, per_edge=False, steps=6):
    """Two blocks as two pipeline stages, 4 micro-batches per step, under GPipe or
    1F1B; the last stage returns the losses, every stage its parameters. ``per_edge``:
    each direction between the stages on a group of its own, split from the default
    one (torch's ``pipeline_per_edge_p2p``, which needs ``split_group``)."""
    from torch.distributed import config as dist_config
    from torch.distributed import pipelining as pp

    if per_edge:
        dist_config.pipeline_per_edge_p2p = True
    init(rank, n, how, tmp, backend=backend)
    torch.manual_seed(0)
    stages = [Block(), Block()]
    mod = stages[rank]
    stage = pp.PipelineStage(mod, rank, n, torch.device("cpu"))
    loss_fn = lambda out, target: (out - target).square().mean()
    kind = {"gpipe": pp.ScheduleGPipe, "1f1b": pp.Schedule1F1B}[schedule]
    sched = kind(stage, n_microbatches=4, loss_fn=loss_fn)
    opt = torch.optim.SGD(mod.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(8, SEQ, DIM, generator=g), torch.randn(8, SEQ, DIM, generator=g)
        if rank == 0:
            sched.step(x)
        else:
            mb = []
            sched.step(target=y, losses=mb)
            losses.append(torch.stack(mb).mean().item())
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()
    return losses, [p.detach() for p in mod.parameters()]


def monitored_barrier_is_open() -> bool:
    """Whether this torch lets a backend other than gloo serve monitored_barrier
    (2.11 and older refuse it before asking the backend)."""
    import inspect

    return "only implemented for GLOO" not in inspect.getsource(dist.monitored_barrier)


def mesh_facts(rank, n, how, tmp):
    """init_device_mesh, monitored_barrier and dcp.async_save over ferroccl."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    init(rank, n, how, tmp)
    mesh = init_device_mesh("cpu", (2, n // 2), mesh_dim_names=("a", "b"))
    t = torch.ones(1)
    dist.all_reduce(t, group=mesh.get_group("b"))
    out = {"b_sum": t.item(), "names": [mesh.get_group(d).group_name for d in "ab"]}
    if monitored_barrier_is_open():
        dist.monitored_barrier(timeout=timedelta(seconds=30))
    state = {"w": torch.arange(4.0) + rank}
    dcp.async_save(state, checkpoint_id=os.path.join(tmp, "ckpt")).result()
    back = {"w": torch.zeros(4)}
    dcp.load(back, checkpoint_id=os.path.join(tmp, "ckpt"))
    out["loaded"] = back["w"].tolist()
    dist.destroy_process_group()
    return out


def class_route(rank, n, how, tmp):
    """Which object torch calls: whether the default group is ferroccl's class (the
    ProcessGroup route) or torch's ProcessGroup over ferroccl's Backend; and one
    all-reduce and a monitored_barrier through it."""
    from ferroccl.torch import ProcessGroupFerroccl

    init(rank, n, how, tmp)
    pg = dist.distributed_c10d._get_default_group()
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t)
    if monitored_barrier_is_open():
        dist.monitored_barrier(timeout=timedelta(seconds=30))
    out = {"is_ours": isinstance(pg, ProcessGroupFerroccl), "sum": t.tolist()}
    dist.destroy_process_group()
    return out


def monitored_barrier_late(rank, n, how, tmp):
    """The last rank never reaches monitored_barrier: rank 0 names it within the
    barrier's timeout."""
    init(rank, n, how, tmp)
    start = time.monotonic()
    if rank == n - 1:
        time.sleep(8)
        return None
    try:
        dist.monitored_barrier(timeout=timedelta(seconds=2), wait_all_ranks=True)
    except RuntimeError as e:
        return {"type": type(e).__name__, "msg": str(e), "after": time.monotonic() - start}
    return {"type": None, "after": time.monotonic() - start}


def mesh_disagrees(rank, n, how, tmp):
    """Rank 0 lays the 2 x 2 mesh out by rows, the others by columns: the ranks whose
    groups' members disagree raise MismatchError at once, naming them."""
    from torch.distributed.device_mesh import DeviceMesh

    init(rank, n, how, tmp, timeout=60)
    dist.barrier()  # every rank past the rendezvous before the others fail and go
    layout = torch.arange(n).reshape(2, -1)
    if rank != 0:
        layout = layout.t().contiguous()
    start = time.monotonic()
    try:
        DeviceMesh("cpu", layout, mesh_dim_names=("x", "y"))
    except ferroccl.MismatchError as e:
        return {"type": "MismatchError", "msg": str(e), "after": time.monotonic() - start}
    except RuntimeError as e:
        return {"type": type(e).__name__, "msg": str(e), "after": time.monotonic() - start}
    return {"type": None, "after": time.monotonic() - start}


def compiled(rank, n, how, tmp, backend, steps=3):
    """``torch.compile`` (Dynamo, ``aot_eager``) over DDP: the reducer calls the
    backend from C++ inside the compiled forward, where Dynamo intercepts every Python
    frame; and a compiled function calling ``dist.all_reduce`` itself."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    init(rank, n, how, tmp, backend=backend)
    torch.manual_seed(1)
    model = DDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
    fast = torch.compile(model, backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(steps):
        loss = fast(torch.randn(4, 8, generator=g)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())

    def summed(x):
        y = x * 2
        dist.all_reduce(y)
        return y + 1

    out = torch.compile(summed, backend="aot_eager")(torch.ones(4) * (rank + 1))
    dist.destroy_process_group()
    return losses, [p.detach() for p in model.parameters()], out.tolist()


def split(rank, n, how, tmp, backend):
    """``dist.split_group`` of 4 ranks into [0, 2] and [3, 1] (rank 3 first: a split
    keeps the order given), then each child's all-reduce, its ranks, and a group
    split from a child."""
    init(rank, n, how, tmp, backend=backend)
    g = dist.split_group(split_ranks=[[0, 2], [3, 1]])
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t, group=g)
    x = torch.tensor([float(10 * rank)])
    dist.broadcast(x, group_src=0, group=g)
    solo = dist.split_group(parent_pg=g, split_ranks=[[1]])
    out = {
        "sum": t.item(),
        "from_first": x.item(),
        "rank": dist.get_rank(g),
        "size": dist.get_world_size(g),
        "ranks": dist.get_process_group_ranks(g),
        "named": isinstance(g.group_name, str) and g.group_name != "",
        "solo": None if solo is dist.GroupMember.NON_GROUP_MEMBER else dist.get_rank(solo),
    }
    dist.destroy_process_group()
    return out


def split_disagrees(rank, n, how, tmp):
    """Ranks 0 and 1 pass splits that no other rank passes; 2 and 3 agree on [2, 3]:
    the first two raise MismatchError at once, the others get their group."""
    init(rank, n, how, tmp, timeout=60)
    splits = {0: [[0, 1], [2, 3]], 1: [[0, 1, 2], [3]]}.get(rank, [[0], [2, 3]])
    start = time.monotonic()
    try:
        g = dist.split_group(split_ranks=splits)
    except ferroccl.MismatchError as e:
        return {"type": "MismatchError", "msg": str(e), "after": time.monotonic() - start}
    t = torch.ones(1)
    dist.all_reduce(t, group=g)
    return {"type": None, "sum": t.item(), "after": time.monotonic() - start}


def inference_mode(rank, n, how, tmp, backend):
    """Collectives under ``torch.inference_mode()``, their outputs inference tensors,
    as DTensor runs them in an inference-mode forward (upstream's
    test_tp_examples.py test_mlp_inference): waited on, so that the copies into the
    outputs may run on a thread of the communicator's."""
    import torch.distributed._functional_collectives as funcol

    init(rank, n, how, tmp, backend=backend)
    w = dist.group.WORLD
    out = {}
    with torch.inference_mode():
        x = torch.arange(6.0).reshape(2, 3) + rank
        out["funcol.all_gather"] = funcol.all_gather_tensor(x, 0, w).tolist()
        out["funcol.all_reduce"] = funcol.all_reduce(x, "sum", w).tolist()
        out["funcol.reduce_scatter"] = funcol.reduce_scatter_tensor(
            torch.cat([x] * n), "sum", 0, w
        ).tolist()
        g = torch.empty(2 * n, 3)
        dist.all_gather_into_tensor(g, x, async_op=True).wait()
        out["all_gather_into_tensor"] = g.tolist()
        y = (torch.arange(6.0).reshape(2, 3) + rank).t()  # not contiguous: copied back
        dist.all_reduce(y, async_op=True).wait()
        out["all_reduce (not contiguous)"] = y.tolist()
        # A model forward through DTensor: tensor parallel, all-gathers included.
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import parallelize_module

        mesh = init_device_mesh("cpu", (n,))
        model = parallelize_module(block(), mesh, tp_plan())
        out["tp forward"] = full(model(data(7)(0))).tolist()
    dist.destroy_process_group()
    return out


if __name__ == "__main__":
    main(globals())
