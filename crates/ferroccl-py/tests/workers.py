"""What each rank of a test runs (``python -m workers SPEC``; see ranks.py)."""

from __future__ import annotations

import os
import pickle
import signal
import sys
import time
from datetime import timedelta

import ferroccl
import ferroccl.torch
import torch
import torch.distributed as dist

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int32,
    torch.int64,
    torch.uint8,
]
FLOATS = {torch.float32, torch.float64, torch.float16, torch.bfloat16}


def init(rank, n, how, tmp, backend="ferroccl", timeout=60):
    if how == "file":
        method = f"file://{tmp}/store"
    elif how == "tcp":
        method = f"tcp://127.0.0.1:{os.environ['TEST_PORT']}"
    else:
        method = "env://"
    kw = {} if how == "env" else {"rank": rank, "world_size": n}
    dist.init_process_group(backend, init_method=method, timeout=timedelta(seconds=timeout), **kw)


def data(rank, count, dtype, salt=0, device="cpu"):
    """Small integers, exact in every dtype, different per rank."""
    v = (torch.arange(count, dtype=torch.int64) * 7 + rank * 3 + salt) % 5 + 1
    return v.to(dtype).to(device)


def check(got, want, what):
    got, want = got.cpu(), want.cpu()
    if not torch.equal(got, want):
        raise AssertionError(f"{what}: got {got.tolist()[:16]}, want {want.tolist()[:16]}")


def collectives(rank, n, how, tmp, device="cpu"):
    """Every collective, every dtype, against its definition, on tensors of ``device``
    (``"cuda"``: this rank's GPU, ``cuda:0`` when the ranks share one)."""
    init(rank, n, how, tmp)
    assert dist.get_backend() == "ferroccl"
    dev = torch.device(device)
    count = 6
    done = 0
    for dt in DTYPES:
        alls = [data(q, count, dt, device=dev) for q in range(n)]
        wide = [a.to(torch.float64) for a in alls]
        ops = [
            (dist.ReduceOp.SUM, lambda xs: sum(xs)),
            (dist.ReduceOp.MIN, lambda xs: torch.stack(xs).min(0).values),
            (dist.ReduceOp.MAX, lambda xs: torch.stack(xs).max(0).values),
        ]
        if dt not in (torch.uint8,) or n <= 2:
            ops.append((dist.ReduceOp.PRODUCT, lambda xs: torch.stack(xs).prod(0)))
        for op, f in ops:
            t = alls[rank].clone()
            dist.all_reduce(t, op=op)
            check(t, f(wide).to(dt), f"all_reduce {op} {dt}")
            t = alls[rank].clone()
            dist.reduce(t, dst=n - 1, op=op)
            if rank == n - 1:
                check(t, f(wide).to(dt), f"reduce {op} {dt}")
            done += 2
        if dt in FLOATS and hasattr(dist.ReduceOp, "AVG"):
            t = alls[rank].clone()
            dist.all_reduce(t, op=dist.ReduceOp.AVG)
            check(t, (sum(wide) / n).to(dt), f"all_reduce AVG {dt}")
        # Non-contiguous: a column of a matrix.
        m = torch.stack([alls[rank], alls[rank]], 1)
        col = m[:, 1]
        assert not col.is_contiguous()
        dist.all_reduce(col)
        check(m[:, 1], sum(wide).to(dt), f"all_reduce non-contiguous {dt}")
        check(m[:, 0], alls[rank], f"all_reduce non-contiguous left the rest {dt}")
        t = alls[rank].clone()
        dist.broadcast(t, src=n - 1)
        check(t, alls[n - 1], f"broadcast {dt}")
        outs = [torch.zeros(count, dtype=dt, device=dev) for _ in range(n)]
        dist.all_gather(outs, alls[rank])
        for q in range(n):
            check(outs[q], alls[q], f"all_gather {dt} block {q}")
        flat = torch.zeros(n * count, dtype=dt, device=dev)
        dist.all_gather_into_tensor(flat, alls[rank]) if hasattr(
            dist, "all_gather_into_tensor"
        ) else dist._all_gather_base(flat, alls[rank])
        check(flat, torch.cat(alls), f"all_gather_into_tensor {dt}")
        big = [data(q, n * count, dt, salt=1, device=dev) for q in range(n)]
        out = torch.zeros(count, dtype=dt, device=dev)
        dist.reduce_scatter(out, list(big[rank].chunk(n)))
        want = sum(b.to(torch.float64) for b in big).to(dt).chunk(n)[rank]
        check(out, want, f"reduce_scatter {dt}")
        out = torch.zeros(count, dtype=dt, device=dev)
        rs = getattr(dist, "reduce_scatter_tensor", None) or dist._reduce_scatter_base
        rs(out, big[rank])
        check(out, want, f"reduce_scatter_tensor {dt}")
        gl = [torch.zeros(count, dtype=dt, device=dev) for _ in range(n)] if rank == 0 else None
        dist.gather(alls[rank], gl, dst=0)
        if rank == 0:
            for q in range(n):
                check(gl[q], alls[q], f"gather {dt} block {q}")
        out = torch.zeros(count, dtype=dt, device=dev)
        dist.scatter(out, list(big[0].chunk(n)) if rank == 0 else None, src=0)
        check(out, big[0].chunk(n)[rank], f"scatter {dt}")
        out = torch.zeros(n * count, dtype=dt, device=dev)
        dist.all_to_all_single(out, big[rank])
        want = torch.cat([big[q].chunk(n)[rank] for q in range(n)])
        check(out, want, f"all_to_all_single {dt}")
        # Uneven splits: rank q sends q+1+p rows to rank p.
        rows = lambda src, dst: src + 1 + dst
        send = torch.cat(
            [torch.full((rows(rank, p), 2), rank * 10 + p, dtype=dt, device=dev) for p in range(n)]
        )
        recv = torch.zeros(sum(rows(q, rank) for q in range(n)), 2, dtype=dt, device=dev)
        dist.all_to_all_single(
            recv,
            send,
            [rows(q, rank) for q in range(n)],
            [rows(rank, p) for p in range(n)],
        )
        want = torch.cat(
            [torch.full((rows(q, rank), 2), q * 10 + rank, dtype=dt, device=dev) for q in range(n)]
        )
        check(recv, want, f"all_to_all_single with splits {dt}")
        outs = [torch.zeros(q + 1, dtype=dt, device=dev) for q in range(n)]
        dist.all_to_all(
            outs, [torch.full((rank + 1,), p + rank, dtype=dt, device=dev) for p in range(n)]
        )
        for q in range(n):
            check(
                outs[q],
                torch.full((q + 1,), q + rank, dtype=dt, device=dev),
                f"all_to_all {dt} from {q}",
            )
        if n > 1:
            right, left = (rank + 1) % n, (rank - 1) % n
            r = torch.zeros(count, dtype=dt, device=dev)
            reqs = [dist.isend(alls[rank], right), dist.irecv(r, left)]
            for q in reqs:
                q.wait()
            check(r, alls[left], f"isend/irecv ring {dt}")
            ops = [
                dist.P2POp(dist.isend, alls[rank], right),
                dist.P2POp(dist.irecv, r, left),
            ]
            r.zero_()
            for q in dist.batch_isend_irecv(ops):
                q.wait()
            check(r, alls[left], f"batch_isend_irecv {dt}")
        done += 12
    # Coalesced, async, barrier.
    ts = [data(rank, 3, torch.float32, device=dev), data(rank, 5, torch.float32, device=dev)]
    dist.all_reduce_coalesced(ts)
    check(
        ts[1],
        sum(data(q, 5, torch.float64, device=dev) for q in range(n)).float(),
        "all_reduce_coalesced",
    )
    t = data(rank, 1000, torch.float32, device=dev)
    w = dist.all_reduce(t, async_op=True)
    fut = w.get_future()
    w.wait()
    assert fut.done()
    check(
        fut.value()[0],
        sum(data(q, 1000, torch.float64, device=dev) for q in range(n)).float(),
        "future",
    )
    # The coalesced forms (torch 2.x's coalescing manager calls them on the group).
    pg = dist.distributed_c10d._get_default_group()
    ins = [
        data(rank, 3, torch.float32, device=dev),
        data(rank, 5, torch.float32, salt=2, device=dev),
    ]
    outs = [torch.zeros(n * 3, device=dev), torch.zeros(n * 5, device=dev)]
    pg.all_gather_single_coalesced(outs, ins).wait()
    check(
        outs[0],
        torch.cat([data(q, 3, torch.float32, device=dev) for q in range(n)]),
        "ag coalesced 0",
    )
    check(
        outs[1],
        torch.cat([data(q, 5, torch.float32, 2, device=dev) for q in range(n)]),
        "ag coalesced 1",
    )
    ins = [
        data(rank, 2 * n, torch.float64, device=dev),
        data(rank, 3 * n, torch.float64, salt=4, device=dev),
    ]
    outs = [
        torch.zeros(2, dtype=torch.float64, device=dev),
        torch.zeros(3, dtype=torch.float64, device=dev),
    ]
    pg.reduce_scatter_single_coalesced(outs, ins).wait()
    for i, (k, salt) in enumerate(((2, 0), (3, 4))):
        total = sum(data(q, k * n, torch.float64, salt, device=dev) for q in range(n))
        check(outs[i], total.chunk(n)[rank], f"rs coalesced {i}")
    # torch's layout: output_lists[q][i] is rank q's input i.
    lists = [[torch.zeros(2, device=dev), torch.zeros(4, device=dev)] for _ in range(n)]
    dist.all_gather_coalesced(
        lists,
        [torch.full((2,), float(rank), device=dev), torch.full((4,), -1.0 * rank, device=dev)],
    )
    for q in range(n):
        check(lists[q][0], torch.full((2,), float(q)), "all_gather_coalesced 0")
        check(lists[q][1], torch.full((4,), -1.0 * q), "all_gather_coalesced 1")
    # int8 and bool move as bytes (broadcast), and are refused where arithmetic is.
    b = torch.tensor([rank - 5, 7], dtype=torch.int8, device=dev)
    dist.broadcast(b, src=n - 1)
    check(b, torch.tensor([n - 1 - 5, 7], dtype=torch.int8), "broadcast int8")
    dist.barrier()
    dist.destroy_process_group()
    return done


def plain_numpy(rank, n, how, tmp):
    """The package without torch.distributed: numpy arrays through from_env."""
    import numpy as np

    c = ferroccl.Communicator.from_env()
    assert (c.rank, c.world_size) == (rank, n)
    x = np.full(1000, rank + 1, dtype=np.float64)
    c.all_reduce(x)
    assert (x == n * (n + 1) / 2).all()
    g = np.zeros(2 * n, dtype=np.int32)
    c.all_gather(np.array([rank, -rank], dtype=np.int32), g)
    assert g.tolist() == [v for q in range(n) for v in (q, -q)]
    half = c.split(rank % 2)
    y = np.array([1], dtype=np.uint8)
    half.all_reduce(y)
    assert y[0] == half.world_size
    c.close()
    return "ok"


def model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(),
        torch.nn.Conv2d(8, 8, 3, padding=1),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(2),
        torch.nn.Flatten(),
        torch.nn.Linear(32, 10),
    )


def train(ddp, rank, steps, die_at=None):
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(1000 + rank)
    losses = []
    for step in range(steps):
        if die_at is not None and step == die_at:
            os.kill(os.getpid(), signal.SIGKILL)
        x = torch.randn(8, 3, 12, 12, generator=g)
        y = torch.randint(0, 10, (8,), generator=g)
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    params = torch.cat([p.detach().reshape(-1) for p in ddp.module.parameters()])
    buffers = torch.cat([b.detach().reshape(-1).double() for b in ddp.module.buffers()])
    return losses, params, buffers


def ddp(rank, n, how, tmp, steps=20):
    """DDP on a conv + BatchNorm model, over ferroccl and over gloo (a second group)."""
    init(rank, n, how, tmp)
    gloo = dist.new_group(list(range(n)), backend="gloo")
    DDP = torch.nn.parallel.DistributedDataParallel
    ours = train(DDP(model()), rank, steps)
    theirs = train(DDP(model(), process_group=gloo), rank, steps)
    dist.destroy_process_group()
    return {"ferroccl": ours, "gloo": theirs}


def subgroups(rank, n, how, tmp):
    init(rank, n, how, tmp)
    odd = dist.new_group([3, 1])
    even = dist.new_group([0, 2])
    every = dist.new_group(list(range(n)))
    mine = odd if rank % 2 else even
    # A child of the default group's communicator (its links, no new store), ranked
    # as torch ranks a new group (sorted).
    comm = ferroccl.torch.communicator(mine)
    assert comm.id != 0, "new_group made a communicator of its own"
    assert comm.job_ranks == ([1, 3] if rank % 2 else [0, 2]), comm.job_ranks
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=mine)
    want = 4.0 if rank % 2 else 2.0
    assert t.item() == want, (t, want)
    assert dist.get_world_size(mine) == 2
    # The broadcast's source is named by its global rank (3: group rank 1).
    b = torch.tensor([float(rank)])
    dist.broadcast(b, src=3 if rank % 2 else 0, group=mine)
    assert b.item() == (3.0 if rank % 2 else 0.0)
    t = torch.tensor([1.0])
    dist.all_reduce(t, group=every)
    assert t.item() == n
    # The other group works while this one is used; the default group still works.
    dist.all_reduce(t)
    assert t.item() == n * n
    dist.barrier()
    dist.destroy_process_group()
    return "ok"


def mismatch(rank, n, how, tmp):
    """Rank 0 all-reduces 4 elements, the others 8: every rank raises MismatchError."""
    init(rank, n, how, tmp, timeout=30)
    t = torch.ones(4 if rank == 0 else 8)
    try:
        dist.all_reduce(t)
    except ferroccl.MismatchError as e:
        # A rank told of another's mismatch carries it typed: its root cause's kind.
        root = getattr(e, "cause_kind", None) or e.kind
        return {"type": type(e).__name__, "msg": str(e), "root": root}
    except BaseException as e:  # noqa: BLE001
        return {"type": type(e).__name__, "msg": str(e)}
    return {"type": None, "msg": "no error"}


def killed(rank, n, how, tmp):
    """Rank n-1 is killed (SIGKILL) at step 3 of DDP training; the others must raise a
    ferroccl error naming it, within the timeout."""
    init(rank, n, how, tmp, timeout=20)
    net = torch.nn.parallel.DistributedDataParallel(model())
    start = time.monotonic()
    try:
        train(net, rank, 1000, die_at=3 if rank == n - 1 else None)
    except ferroccl.FerrocclError as e:
        return {
            "type": type(e).__name__,
            "msg": str(e),
            "after": time.monotonic() - start,
        }
    except RuntimeError as e:
        return {
            "type": type(e).__name__,
            "msg": str(e),
            "after": time.monotonic() - start,
        }
    return {"type": None, "msg": "trained on", "after": time.monotonic() - start}


def ddp_peer_exits(rank, n, how, tmp):
    """The last rank os._exit()s at step 5 of DDP training on a plain MLP (one bucket
    or several, ``bucket_mb``): every other rank must raise naming it, not crash."""
    init(rank, n, how, tmp, timeout=20)
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    net = torch.nn.parallel.DistributedDataParallel(m, bucket_cap_mb=0.01)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    start = time.monotonic()
    try:
        for step in range(1000):
            if rank == n - 1 and step == 5:
                sys.stdout.flush()
                os._exit(3)
            loss = net(torch.randn(8, 64)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    except RuntimeError as e:  # ferroccl's errors are RuntimeErrors too
        return {"type": type(e).__name__, "msg": str(e), "after": time.monotonic() - start}
    return {"type": None, "msg": "trained on", "after": time.monotonic() - start}


def ddp_mismatch(rank, n, how, tmp):
    """At step 3 the last rank broadcasts where the others all-reduce DDP's buckets:
    every rank must raise a mismatch (the others from inside backward)."""
    init(rank, n, how, tmp, timeout=20)
    torch.manual_seed(0)
    net = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 4))
    try:
        for step in range(10):
            if rank == n - 1 and step == 3:
                dist.broadcast(torch.zeros(7), src=0)
            else:
                net(torch.randn(2, 16)).sum().backward()
    except RuntimeError as e:
        return {"type": type(e).__name__, "msg": str(e)}
    return {"type": None, "msg": "no error"}


def power_sgd(rank, n, how, tmp, steps=20):
    """DDP with PowerSGD's hook (whose callbacks issue all-reduces and wait for them)
    over ferroccl and over gloo: the losses and parameters of each."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    init(rank, n, how, tmp, timeout=30)
    gloo = dist.new_group(list(range(n)), backend="gloo")

    def run(pg):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
        net = torch.nn.parallel.DistributedDataParallel(m, process_group=pg)
        state = psgd.PowerSGDState(
            process_group=pg,
            matrix_approximation_rank=2,
            start_powerSGD_iter=3,
            use_error_feedback=True,
            warm_start=True,
        )
        net.register_comm_hook(state, psgd.powerSGD_hook)
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(10 + rank)
        losses = []
        for _ in range(steps):
            loss = net(torch.randn(8, 32, generator=g)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses, torch.cat([p.detach().reshape(-1) for p in m.parameters()])

    out = {"ferroccl": run(None), "gloo": run(gloo)}
    # No destroy_process_group: on torch 1.13, the gloo group's last reference can go
    # on one of gloo's own threads (a hook's callback), whose destructor then joins
    # itself ("Resource deadlock avoided", seen once in 4 runs). The process ends
    # with os._exit.
    return out


def torch_facts(rank, n, how, tmp):
    """What torch's own code reads from a group: the same for ferroccl as for gloo."""
    init(rank, n, how, tmp)
    gloo = dist.new_group(list(range(n)), backend="gloo")
    sub = dist.new_group(list(range(n)))
    out = {}
    for name, pg in (("ferroccl", dist.group.WORLD), ("gloo", gloo), ("sub", sub)):
        out[name] = {
            "backend": dist.get_backend(pg),
            "cpu": torch.device("cpu") in getattr(pg, "_device_types", [torch.device("cpu")]),
            "name": getattr(pg, "group_name", None),  # torch 1.13 has none
        }
    t = torch.ones(3)
    dist.all_reduce(t, group=sub)
    out["sub_sum"] = t.tolist()
    dist.destroy_process_group()
    return out


def sync_calls(rank, n, how, tmp):
    """Blocking calls through torch.distributed's functions, the sum checked, counting
    the Works the backend makes: torch 2.x's functions take None for a call that is
    over (no Work), anything else that calls the group's method gets one."""
    import ferroccl.torch as ft
    from ferroccl._torchwork import _guarded_codes

    init(rank, n, how, tmp)
    made = []

    class Counted(ft.Work):
        def __init__(self, *a, **k):
            made.append(1)
            super().__init__(*a, **k)

    ft.Work = Counted
    out = {"guarded": sorted(c.co_name for c in _guarded_codes())}
    t = torch.full((256,), float(rank + 1))
    for _ in range(10):
        dist.all_reduce(t)
    dist.barrier()
    out["sum"], out["by_dist"] = t[0].item(), len(made)
    opts = dist.AllreduceOptions()
    if hasattr(opts, "asyncOp"):
        opts.asyncOp = False
    w = dist.group.WORLD.allreduce([t], opts)
    out["direct"] = (len(made) - out["by_dist"], w.wait(), w.result()[0] is t, t[0].item())
    dist.destroy_process_group()
    return out


def wait_timeout(rank, n, how, tmp):
    """Work.wait(timeout) raises ferroccl.TimeoutError while its peer has not joined,
    and the operation goes on: a later wait() completes it. Rank 1 joins only once
    rank 0's wait has timed out (told through torch's store)."""
    init(rank, n, how, tmp)
    store = dist.distributed_c10d._get_default_store()
    t = torch.ones(4)
    out = {}
    if rank == 0:
        w = dist.all_reduce(t, async_op=True)
        try:
            w.wait(timeout=timedelta(milliseconds=200))
            out["early"] = None
        except ferroccl.TimeoutError as e:
            out["early"] = str(e)
        store.set("test/go", "1")
        w.wait()
    else:
        store.wait(["test/go"], timedelta(seconds=60))
        dist.all_reduce(t)
    out["value"] = t.tolist()
    dist.destroy_process_group()
    return out


def misuse(rank, n, how, tmp):
    init(rank, n, how, tmp)
    out = {}
    for name, call in [
        ("int8", lambda: dist.all_reduce(torch.ones(3, dtype=torch.int8))),
        ("bool", lambda: dist.all_reduce(torch.ones(3, dtype=torch.bool))),
        (
            "band",
            lambda: dist.all_reduce(torch.ones(3, dtype=torch.int32), op=dist.ReduceOp.BAND),
        ),
        (
            "avg_int",
            lambda: dist.all_reduce(torch.ones(3, dtype=torch.int32), op=dist.ReduceOp.AVG),
        ),
    ]:
        try:
            call()
            out[name] = None
        except ferroccl.FerrocclError as e:
            out[name] = (type(e).__name__, str(e))
    dist.destroy_process_group()
    return out


class FakeCuda:
    """Stands for a CUDA tensor where none can be made (no GPU): what the backend reads
    of a tensor before it reaches CUDA."""

    is_cpu = False
    is_cuda = True

    def __init__(self, index=0, count=4, dtype=torch.float32, contiguous=True):
        self.device = torch.device("cuda", index)
        self.dtype = dtype
        self._count = count
        self._contiguous = contiguous
        self.log = []

    def is_contiguous(self):
        return self._contiguous

    def contiguous(self):
        return self if self._contiguous else FakeCuda(self.device.index, self._count, self.dtype)

    def data_ptr(self):
        return 0x7F00_0000_0000

    def numel(self):
        return self._count

    def copy_(self, other):
        self.log.append(("copy_", torch.cuda.current_stream(self.device).cuda_stream))

    def record_stream(self, s):
        self.log.append(("record_stream", s.cuda_stream))


def backend_of(pg):
    """ferroccl's backend object of a group: the group itself, or (torch with Python
    backends) the backend torch's group holds for the CPU."""
    from ferroccl.torch import ProcessGroupFerroccl

    if isinstance(pg, ProcessGroupFerroccl):
        return pg
    return pg._get_backend(torch.device("cpu"))


def cuda_without_a_gpu(rank, n, how, tmp):
    """CUDA tensors where there is no GPU: typed errors on every rank, never a crash
    or a hang, and the CPU path goes on; mixed devices and another GPU are refused by
    name first."""
    init(rank, n, how, tmp, timeout=30)
    ours = backend_of(dist.distributed_c10d._get_default_group())
    out = {}

    def attempt(name, call):
        try:
            call()
            out[name] = None
        except ferroccl.FerrocclError as e:
            out[name] = (type(e).__name__, str(e))

    opts = dist.AllreduceOptions()
    attempt("allreduce", lambda: ours.allreduce([FakeCuda(0)], opts))
    cpu = torch.zeros(4)
    attempt("mixed", lambda: ours.allgather([[cpu] * n], [FakeCuda(0)]))
    attempt("other_gpu", lambda: ours.allreduce([FakeCuda(1)], opts))
    attempt("meta", lambda: ours.allreduce([torch.empty(4, device="meta")], opts))
    t = torch.ones(3)
    dist.all_reduce(t)
    out["cpu_after"] = t.tolist()
    out["hosts"] = ours.comm.hosts  # 1: CUDA tensors would go over CUDA IPC
    dist.destroy_process_group()
    return out


def main(fns: dict) -> None:
    """Runs the function a spec names (``python -m MODULE SPEC``, see ranks.py), writes
    its result for ranks.py and ends the process at once."""
    fn, rank, n, how, tmp, args = pickle.loads(bytes.fromhex(sys.argv[1]))
    result = fns[fn](rank, n, how, tmp, *args)
    with open(os.path.join(tmp, f"result.{rank}"), "wb") as f:
        pickle.dump(result, f)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(globals())
