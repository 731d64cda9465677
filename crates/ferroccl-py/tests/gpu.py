"""What each rank of a CUDA check runs (``python -m gpu SPEC``, see ranks.py): the torch
backend on CUDA tensors, several ranks sharing GPU 0. Run by ``tools/gpu-check torch``
(and by test_cuda.py's GPU tests where a GPU is at hand); every function returns what
its rank saw, and the caller judges it. With ``FERROCCL_CHECK_DEVICE=cpu`` the same
code runs on CPU tensors (a rehearsal of the check where there is no GPU)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import sys
import time
from datetime import timedelta

import ferroccl
import ferroccl.torch  # registers the backend
import torch
import torch.distributed as dist
from workers import collectives, init, main

__all__ = ["collectives"]


def _gpu(rank):
    """The device the check runs on: GPU 0 for every rank (``FERROCCL_CHECK_DEVICE``
    names another, ``cpu`` for a rehearsal)."""
    dev = torch.device(os.environ.get("FERROCCL_CHECK_DEVICE", "cuda:0"))
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    return dev


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _stream(dev, side):
    """torch's stream to issue on: a side stream, or the default one (CUDA)."""
    if dev.type != "cuda":
        return contextlib.nullcontext()
    return torch.cuda.stream(side if side is not None else torch.cuda.default_stream(dev))


def streams(rank, n, how, tmp, mib=64, rounds=6):
    """Stream order, as a training loop meets it: an input still being written by
    kernels queued on torch's current stream (a side stream, then the default one)
    when the collective is issued, an async collective waited for with ``wait()``,
    results read at once on that stream, inputs freed and their memory reused at
    once; gathers into lists (copies back on ferroccl's stream). Returns the number
    of wrong elements seen."""
    dev = _gpu(rank)
    init(rank, n, how, tmp)
    count = (mib << 20) // 4
    wrong = 0
    side = torch.cuda.Stream(dev) if dev.type == "cuda" else None
    for k in range(rounds):
        with _stream(dev, side if k % 2 == 0 else None):
            x = torch.zeros(count, device=dev)
            for _ in range(8):  # a producer that is still running at issue
                x.add_(float(rank + 1))
            w = dist.all_reduce(x, async_op=True)
            garbage = torch.full((count,), -7.0, device=dev)  # later work meanwhile
            w.wait()
            want = 8.0 * n * (n + 1) / 2
            wrong += int((x != want).sum().item())
            del x  # released at once; the next allocation may take its memory
            y = torch.full((count,), 3.0, device=dev)
            wrong += int((y != 3.0).sum().item()) + int((garbage != -7.0).sum().item())
            outs = [torch.empty(1000, device=dev) for _ in range(n)]
            w = dist.all_gather(outs, torch.full((1000,), float(rank), device=dev), async_op=True)
            w.wait()
            wrong += sum(int((o != q).sum().item()) for q, o in enumerate(outs))
    _sync(dev)
    dist.destroy_process_group()
    return wrong


def hooks_and_groups(rank, n, how, tmp, steps=8):
    """DDP's fp16 and bf16 compression hooks on a small model on the GPU (replicas
    bitwise equal; the losses each hook gives, and those of no hook, over ferroccl and
    over gloo where gloo has the dtype), and a group of the ranks in reverse order made
    with ``new_group`` (its all-reduce and broadcast)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    dev = _gpu(rank)
    init(rank, n, how, tmp)
    gloo = dist.new_group(list(range(n)), backend="gloo")
    out = {}
    hooks = {"none": None, "fp16": default_hooks.fp16_compress_hook}
    if hasattr(default_hooks, "bf16_compress_hook"):
        hooks["bf16"] = default_hooks.bf16_compress_hook
    for name, hook in hooks.items():
        for backend, group in (("ferroccl", None), ("gloo", gloo)):
            if backend == "gloo" and name == "bf16":
                continue  # gloo has no bfloat16 arithmetic on every build
            torch.manual_seed(0)
            m = torch.nn.Sequential(
                torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8)
            ).to(dev)
            net = torch.nn.parallel.DistributedDataParallel(
                m, device_ids=_ids(dev), process_group=group
            )
            if hook is not None:
                try:
                    net.register_comm_hook(group, hook)
                except TypeError as e:  # torch's own condition (bf16: CUDA and NCCL 2.10+)
                    out[f"{name}/{backend}"] = {"refused": str(e)}
                    continue
            opt = torch.optim.SGD(net.parameters(), lr=0.05)
            g = torch.Generator().manual_seed(10 + rank)
            losses = []
            for _ in range(steps):
                loss = net(torch.randn(16, 64, generator=g).to(dev)).square().mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())
            params = torch.cat([p.detach().reshape(-1) for p in m.parameters()]).cpu()
            out[f"{name}/{backend}"] = {
                "losses": losses,
                "digest": hashlib.sha256(params.numpy().tobytes()).hexdigest(),
            }
    sub = dist.new_group(list(reversed(range(n))))
    t = torch.full((1000,), float(rank + 1), device=dev)
    dist.all_reduce(t, group=sub)
    b = torch.full((10,), float(rank), device=dev)
    dist.broadcast(b, src=n - 1, group=sub)
    _sync(dev)
    out["group_sum"] = t[0].item()
    out["group_bcast"] = b[0].item()
    dist.destroy_process_group()
    return out


def mismatch(rank, n, how, tmp):
    """Rank 0 all-reduces 4 elements, the others 8, on the GPU: every rank must raise
    MismatchError."""
    dev = _gpu(rank)
    init(rank, n, how, tmp, timeout=30)
    start = time.monotonic()
    t = torch.ones(4 if rank == 0 else 8, device=dev)
    try:
        dist.all_reduce(t)
        _sync(dev)
    except ferroccl.FerrocclError as e:
        return {"type": type(e).__name__, "msg": str(e), "after": time.monotonic() - start}
    except RuntimeError as e:
        return {"type": type(e).__name__, "msg": str(e), "after": time.monotonic() - start}
    return {"type": None, "msg": "no error", "after": time.monotonic() - start}


def killed(rank, n, how, tmp, timeout=15):
    """DDP on a small CUDA model; rank n-1 is killed (SIGKILL) at step 3: every other
    rank must raise, naming it, within the timeout."""
    dev = _gpu(rank)
    init(rank, n, how, tmp, timeout=timeout)
    torch.manual_seed(0)
    m = torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10)
    ).to(dev)
    net = torch.nn.parallel.DistributedDataParallel(m, device_ids=_ids(dev))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    start = time.monotonic()
    try:
        for step in range(10_000):
            if rank == n - 1 and step == 3:
                os.kill(os.getpid(), signal.SIGKILL)
            loss = net(torch.randn(32, 256, device=dev)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            _sync(dev)
    except RuntimeError as e:  # ferroccl's errors are RuntimeErrors too
        return {"type": type(e).__name__, "msg": str(e), "after": time.monotonic() - start}
    return {"type": None, "msg": "trained on", "after": time.monotonic() - start}


def _ids(dev):
    return [dev.index] if dev.type == "cuda" else None


def _train(group, rank, n, dev, steps, warmup, batch, image):
    import torchvision

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
    from ddp_resnet import Timer  # the example's timing hook, DDP's default arithmetic

    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None, num_classes=10).to(dev)
    ddp = torch.nn.parallel.DistributedDataParallel(
        model, device_ids=_ids(dev), process_group=group
    )
    timer = Timer(group)
    ddp.register_comm_hook(None, timer.hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(1000 + rank)
    data = [
        (
            torch.randn(batch, 3, image, image, generator=g),
            torch.randint(0, 10, (batch,), generator=g),
        )
        for _ in range(steps)
    ]
    losses, step_s, comm_s = [], [], []
    for x, y in data:
        x, y = x.to(dev), y.to(dev)
        _sync(dev)
        t0 = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        _sync(dev)
        step_s.append(time.perf_counter() - t0)
        comm_s.append(timer.take())
        losses.append(loss.item())
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()
    grads = torch.zeros(params.numel(), device=dev)
    dist.all_reduce(grads, group=group)
    alone = []
    for _ in range(5):
        dist.barrier(group=group)
        _sync(dev)
        t0 = time.perf_counter()
        dist.all_reduce(grads, group=group)
        _sync(dev)
        alone.append(time.perf_counter() - t0)
    w = slice(warmup, None)
    k = max(1, len(step_s[w]))
    return {
        "losses": losses,
        "params": params,
        "digest": hashlib.sha256(params.numpy().tobytes()).hexdigest(),
        "step_ms": 1e3 * sum(step_s[w]) / k,
        "comm_ms": 1e3 * sum(comm_s[w]) / k,
        "images_per_s": batch * n * k / sum(step_s[w]),
        "alone_ms": 1e3 * sorted(alone)[len(alone) // 2],
        "grad_mib": grads.numel() * 4 / 2**20,
    }


def ddp_resnet(rank, n, how, tmp, steps=23, warmup=3, batch=32, image=128):
    """ResNet-18 (torchvision, synthetic data) under DDP on the GPU, over ferroccl and
    over gloo (a second group): each one's losses, timings and parameters (compared
    here: the largest difference from gloo's; returned: digests for the replicas)."""
    dev = _gpu(rank)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.use_deterministic_algorithms(True)
    init(rank, n, how, tmp, timeout=120)
    gloo = dist.new_group(list(range(n)), backend="gloo", timeout=timedelta(seconds=120))
    out = {}
    for name, group in (("ferroccl", None), ("gloo", gloo)):
        out[name] = _train(group, rank, n, dev, steps, warmup, batch, image)
    p, q = out["ferroccl"].pop("params"), out["gloo"].pop("params")
    out["param_gap"] = (p - q).abs().max().item()
    dist.destroy_process_group()
    return out


if __name__ == "__main__":
    main(globals())
