"""ResNet-18 trained with DistributedDataParallel, over ferroccl or gloo.

    torchrun --nproc_per_node 2 crates/ferroccl-py/examples/ddp_resnet.py --backend ferroccl
    torchrun --nproc_per_node 2 crates/ferroccl-py/examples/ddp_resnet.py --backend gloo

torchvision's ``resnet18(weights=None)`` on ``FakeData`` (random images, nothing to
download), the same data and seeds whatever the backend, so the loss curves of two runs
can be compared. Rank 0 prints, every ``--log-every`` steps, the loss, images per second
over all ranks, and communication time per step: from the first gradient bucket's
all-reduce starting to the last one finishing, less the gaps between buckets (a DDP
communication hook times them; the hook is DDP's default, so the arithmetic is the
backend's alone); at the end, the time one step's gradients take to all-reduce with
nothing else running. The last line is a summary for scripts
(``crates/ferroccl-py/tools/torch_ab.py ddp`` reads it).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torchvision

try:  # registers the backend "ferroccl"
    import ferroccl.torch  # noqa: F401
except ImportError:
    pass


class Timer:
    """A DDP communication hook (DDP's default: average, all-reduce) that records how
    long the backend was busy with each step's buckets: the buckets run one after
    another, so bucket i is busy from max(its launch, bucket i-1 done) to its end.
    ``group``: the DDP's process group (None: the default one)."""

    def __init__(self, group=None):
        self.group = group
        self.world = dist.get_world_size(group)
        self.busy = 0.0
        self.prev_done = 0.0

    def hook(self, state, bucket):
        launched = time.perf_counter()
        buf = bucket.buffer()
        buf.div_(self.world)
        fut = dist.all_reduce(buf, group=self.group, async_op=True).get_future()

        def done(f):
            now = time.perf_counter()
            self.busy += now - max(launched, self.prev_done)
            self.prev_done = now
            return f.value()[0]

        return fut.then(done)

    def take(self) -> float:
        busy, self.busy = self.busy, 0.0
        return busy


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", default="ferroccl", choices=["ferroccl", "gloo"])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=16, help="images per rank per step")
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the rates")
    a = p.parse_args()

    torch.set_num_threads(a.threads)
    dist.init_process_group(a.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None, num_classes=10)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    timer = Timer()
    ddp.register_comm_hook(None, timer.hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=a.lr, momentum=0.9)
    data = torchvision.datasets.FakeData(
        size=a.steps * a.batch * world,
        image_size=(3, a.image_size, a.image_size),
        num_classes=10,
        transform=torchvision.transforms.ToTensor(),
        random_offset=0,
    )
    sampler = torch.utils.data.distributed.DistributedSampler(data, shuffle=False)
    loader = torch.utils.data.DataLoader(data, batch_size=a.batch, sampler=sampler)

    comm, step_times, losses = [], [], []
    for step, (x, y) in enumerate(loader):
        t0 = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        step_times.append(time.perf_counter() - t0)
        comm.append(timer.take())
        # The mean loss over ranks (outside the timed step).
        lt = loss.detach().clone()
        dist.all_reduce(lt)
        losses.append(lt.item() / world)
        if rank == 0 and (step + 1) % a.log_every == 0:
            # The last log_every steps, past the warm-up where any are.
            w = slice(min(max(a.warmup, step + 1 - a.log_every), step), step + 1)
            st = sum(step_times[w]) / max(1, len(step_times[w]))
            cm = sum(comm[w]) / max(1, len(comm[w]))
            print(
                f"step {step + 1:4d}  loss {losses[-1]:.4f}  "
                f"{a.batch * world / st:7.1f} images/s  comm {cm * 1e3:7.2f} ms/step  "
                f"step {st * 1e3:7.1f} ms",
                flush=True,
            )
    # The same bytes alone: one step's gradients (every parameter) all-reduced with
    # nothing else running, as the backend's own cost of a step's communication.
    grads = torch.zeros(sum(p.numel() for p in model.parameters()))
    dist.all_reduce(grads)
    alone = []
    for _ in range(5):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(grads)
        alone.append(time.perf_counter() - t0)
    if rank == 0:
        w = slice(min(a.warmup, len(step_times) - 1), None)
        n = max(1, len(step_times[w]))
        summary = {
            "backend": a.backend,
            "world_size": world,
            "steps": len(step_times),
            "images_per_s": a.batch * world * n / sum(step_times[w]),
            "comm_ms_per_step": 1e3 * sum(comm[w]) / n,
            "step_ms": 1e3 * sum(step_times[w]) / n,
            "comm_alone_ms": 1e3 * sorted(alone)[len(alone) // 2],
            "grad_bytes": grads.numel() * grads.element_size(),
            "losses": losses,
            "host": os.uname().nodename,
        }
        print(
            f"alone: one step's gradients ({summary['grad_bytes'] / 2**20:.1f} MiB) "
            f"all-reduced with nothing else running: {summary['comm_alone_ms']:.2f} ms",
            flush=True,
        )
        print("summary " + json.dumps(summary), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
