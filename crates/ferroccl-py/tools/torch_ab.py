"""A/B measurements of the torch.distributed backend, interleaved (see BENCHMARKS.md).

    python3 crates/ferroccl-py/tools/torch_ab.py binding [--ranks 2,4] [--reps 3] [--json F]
    python3 crates/ferroccl-py/tools/torch_ab.py ddp [--ranks 2] [--reps 3] [--steps 20]
    python3 crates/ferroccl-py/tools/torch_ab.py layers [--ranks 2] [--iters 300]
    python3 crates/ferroccl-py/tools/torch_ab.py floor [--reps 3]
    python3 crates/ferroccl-py/tools/torch_ab.py cache [--reps 3]

``binding``: the binding's cost. In-place all-reduce of float32 torch tensors through
``dist.all_reduce`` on the backend ``"ferroccl"``, against ``ferroccl bench``'s in-place
column (the same library from Rust, same sizes, warm-up and iterations), the two run
one after the other ``--reps`` times; per size the medians, torch/native busbw and the
difference in microseconds.

``layers``: where a ``dist.all_reduce`` spends its time, layer by layer, in one job: the
communicator torch's group runs on, called directly on the tensor
(``ferroccl.torch.communicator()``, the binding alone); the backend's ``allreduce``
method and its Work's ``wait()`` (ferroccl's Python layer); the ``ProcessGroup``'s
``allreduce`` and ``wait()`` (torch's dispatch into a Python backend; these two rows
on torch 2.x only, where a direct call can say it is synchronous); and
``dist.all_reduce`` (torch's Python function). Then the same non-blocking, each call
waited for at once (``async_op=True`` and ``wait()``, as FSDP2 and DTensor call): the
communicator, the backend's method, ``dist.all_reduce``. Each is the median of 5
timings of ``--iters`` calls, at 1 KiB and 512 KiB, on rank 0.

``floor``: what a C++ backend could save. At world size 1 (a file store, no peer),
``dist.all_reduce`` of 256 float32 on ``"ferroccl"`` against torch's
``FakeProcessGroup`` (``"fake"``: a C++ backend that does nothing, the least any
backend costs through ``dist.all_reduce``) and gloo, each in its own process,
``--reps`` times interleaved; medians of 7 timings of 20,000 calls. ferroccl's row less
the fake one is all that moving ferroccl's Python into C++ could remove (the
library's own work included).

``cache``: ``floor`` with cold caches, what the mid sizes of ``binding`` pay beyond the
per-call cost. The same three backends at world size 1; before each timed
``dist.all_reduce`` of 256 float32 a tensor copy of S bytes streams through the caches,
as a collective of S bytes does (1 MiB in place on two-shot reads and writes about
3 MiB), evicting the interpreter's and torch's state, which the call then fetches
again. Medians of 2,000 calls per S, ``--reps`` times interleaved; the copy itself is
not timed. A row's ``fake`` column is what any backend pays there through
``dist.all_reduce``; ``ferroccl - fake`` what a C++ backend could save at that size.

``ddp``: ``examples/ddp_resnet.py`` over ferroccl and over gloo, alternating; the medians
of communication time per step, images/s and the largest difference between the loss
curves. ``--hosts H`` runs it on ``tools/emulated-cluster`` (``up H RATE`` first).

Both need the ``ferroccl`` binary (``--ferroccl``, default ``target/release/ferroccl``)
for ``ferroccl launch`` and ``ferroccl bench``, and the package importable (installed,
or on ``PYTHONPATH``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", "..", ".."))


def rank_main(a) -> None:
    """One rank of the torch side of ``binding``."""
    import ferroccl.torch  # noqa: F401
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("ferroccl")
    rows = []
    size = a.minbytes
    while size <= a.maxbytes:
        t = torch.ones(size // 4, dtype=torch.float32)
        for _ in range(a.warmup):
            dist.all_reduce(t)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(a.iters):
            dist.all_reduce(t)
        us = (time.perf_counter() - start) / a.iters * 1e6
        rows.append({"bytes": size, "ip_time_us": us})
        size *= a.factor
    if dist.get_rank() == 0:
        with open(a.out, "w") as f:
            json.dump({"rows": rows}, f)
    dist.destroy_process_group()


def layers_rank(a) -> None:
    """One rank of ``layers``."""
    import ferroccl.torch
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("ferroccl")
    pg = dist.group.WORLD
    get = getattr(pg, "_get_backend", None)
    backend = get(torch.device("cpu")) if get is not None else pg
    comm = ferroccl.torch.communicator()
    opts = dist.AllreduceOptions()
    # torch 2.x says a call is synchronous in opts.asyncOp, as dist.all_reduce(t) does;
    # torch 1.13 only in the calling function's frame, which a direct call does not
    # have (it would run in the background): there, only the two ends are timed.
    sync = hasattr(opts, "asyncOp")
    if sync:
        opts.asyncOp = False
    # The same layers of a non-blocking call waited for at once (async_op=True, then
    # wait(): FSDP2's and DTensor's pattern); a direct call to the backend is
    # non-blocking on both torches here.
    aopts = dist.AllreduceOptions()
    if sync:
        aopts.asyncOp = True
    rows = []
    for size in (1024, 512 << 10):
        t = torch.ones(size // 4)
        layer = [("binding (communicator)", lambda t=t: comm.all_reduce(t))]
        if sync:
            layer.append(
                ("+ ferroccl's Python backend", lambda t=t: backend.allreduce([t], opts).wait())
            )
            layer.append(
                ("+ torch's ProcessGroup dispatch", lambda t=t: pg.allreduce([t], opts).wait())
            )
        layer.append(("+ dist.all_reduce", lambda t=t: dist.all_reduce(t)))
        layer += [
            ("async: binding", lambda t=t: comm.all_reduce(t, async_op=True).wait()),
            ("async: + Python backend", lambda t=t: backend.allreduce([t], aopts).wait()),
            ("async: + dist.all_reduce", lambda t=t: dist.all_reduce(t, async_op=True).wait()),
        ]
        for name, call in layer:
            for _ in range(a.warmup * 4):
                call()
            dist.barrier()
            times = []
            for _ in range(5):
                start = time.perf_counter()
                for _ in range(a.iters):
                    call()
                times.append((time.perf_counter() - start) / a.iters * 1e6)
            rows.append((size, name, statistics.median(times)))
    if dist.get_rank() == 0:
        print(f"# torch {torch.__version__}, {dist.get_world_size()} ranks, in-place float32")
        print(f"# {'size':>7} {'layer':32} {'us':>7} {'+us':>6}")
        last = {}
        for size, name, us in rows:
            chain = (size, name.startswith("async"))
            extra = us - last[chain] if chain in last else 0.0
            last[chain] = us
            print(f"  {size:>7} {name:32} {us:7.1f} {extra:6.1f}")
    dist.destroy_process_group()


def layers(a) -> None:
    for n in a.ranks:
        cmd = [a.ferroccl, "launch", "-n", str(n), "--", sys.executable, __file__]
        out = run([*cmd, "_layers", "--iters", str(a.iters), "--warmup", str(a.warmup)])
        print("\n".join(ln.split("] ", 1)[-1] for ln in out.splitlines() if ln.startswith("[0]")))


def run(cmd, env=None):
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r.stdout


def binding(a) -> None:
    span = [str(a.minbytes), str(a.maxbytes), str(a.factor)]
    sizes = ["-b", span[0], "-e", span[1], "-f", span[2], "-n", str(a.iters)]
    sizes += ["-w", str(a.warmup)]
    print(
        f"# in-place all-reduce, float32, {a.reps} interleaved repetitions: medians, and "
        "each side's min-max over the repetitions"
    )
    print(
        f"# {'n':>2} {'size':>9} {'native us':>10} {'torch us':>10} {'busbw x':>8} {'+us':>8}"
        f"   {'native min-max':>17} {'torch min-max':>17}"
    )
    table = []
    for n in a.ranks:
        native, ours = {}, {}
        with tempfile.TemporaryDirectory() as tmp:
            for _ in range(a.reps):
                nj, tj = (
                    os.path.join(tmp, "native.json"),
                    os.path.join(tmp, "torch.json"),
                )
                run([a.ferroccl, "bench", "--ranks", str(n), *sizes, "--json", nj])
                run(
                    [
                        a.ferroccl,
                        "launch",
                        "-n",
                        str(n),
                        "--",
                        sys.executable,
                        __file__,
                        "_rank",
                        "--out",
                        tj,
                        "--iters",
                        str(a.iters),
                        "--warmup",
                        str(a.warmup),
                        *("--minbytes", span[0], "--maxbytes", span[1], "--factor", span[2]),
                    ]
                )
                for src, dst in ((nj, native), (tj, ours)):
                    with open(src) as f:
                        rows = json.load(f)["rows"]
                    for row in rows:
                        dst.setdefault(row["bytes"], []).append(row["ip_time_us"])
        for size in sorted(set(native) & set(ours)):
            nt, tt = (
                statistics.median(native[size]),
                statistics.median(ours.get(size, [0])),
            )
            nr = f"{min(native[size]):.1f}-{max(native[size]):.1f}"
            tr = f"{min(ours[size]):.1f}-{max(ours[size]):.1f}"
            print(
                f"  {n:>2} {size:>9} {nt:>10.1f} {tt:>10.1f} {nt / tt:>8.2f} {tt - nt:>8.1f}"
                f"   {nr:>17} {tr:>17}"
            )
            table.append(
                {
                    "ranks": n,
                    "bytes": size,
                    "native_us": native[size],
                    "torch_us": ours[size],
                    "busbw_ratio": nt / tt,
                    "added_us": tt - nt,
                }
            )
    if a.json:
        import torch

        with open(a.json, "w") as f:
            json.dump(
                {
                    "torch": torch.__version__,
                    "cpus": os.cpu_count(),
                    "reps": a.reps,
                    "iters": a.iters,
                    "rows": table,
                },
                f,
                indent=1,
            )


def _init_alone(backend: str) -> None:
    """The default group at world size 1 on ``backend`` (ferroccl, gloo or fake)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if backend == "fake":
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    else:
        if backend == "ferroccl":
            import ferroccl.torch  # noqa: F401
        with tempfile.TemporaryDirectory() as tmp:
            store = f"file://{tmp}/store"
            dist.init_process_group(backend, init_method=store, rank=0, world_size=1)


def _floor_backends() -> list:
    """ferroccl, torch's fake backend where this torch has one, and gloo."""
    import importlib.util

    have_fake = importlib.util.find_spec("torch.testing._internal.distributed.fake_pg")
    return ["ferroccl", *(["fake"] if have_fake is not None else []), "gloo"]


def floor_rank(a) -> None:
    """One process of ``floor``: prints ``backend us``."""
    import torch
    import torch.distributed as dist

    _init_alone(a.backend)
    t = torch.ones(256)
    calls = 20_000 if a.backend != "gloo" else 2_000
    for _ in range(calls // 10):
        dist.all_reduce(t)
    times = []
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(calls):
            dist.all_reduce(t)
        times.append((time.perf_counter() - start) / calls * 1e6)
    print(a.backend, statistics.median(times))
    dist.destroy_process_group()


def floor(a) -> None:
    import torch

    res = {b: [] for b in _floor_backends()}
    if "fake" not in res:
        print(f"# torch {torch.__version__} has no FakeProcessGroup: no floor to measure")
    for _ in range(a.reps):
        for backend, times in res.items():
            out = run([sys.executable, __file__, "_floor", "--backend", backend])
            times.append(float(out.split()[-1]))
    print(
        f"# torch {torch.__version__}, world size 1, dist.all_reduce of 256 float32, "
        f"{a.reps} interleaved repetitions: medians (min-max)"
    )
    for backend, v in res.items():
        print(f"  {backend:9s} {statistics.median(v):7.2f} us  ({min(v):.2f}-{max(v):.2f})")
    if "fake" in res:
        gap = statistics.median(res["ferroccl"]) - statistics.median(res["fake"])
        print(f"  ferroccl - fake: {gap:.2f} us per call, the most a C++ backend could save")


CACHE_SIZES = (0, 64 << 10, 256 << 10, 1 << 20, 4 << 20)


def cache_rank(a) -> None:
    """One process of ``cache``: prints ``backend S:us ...``."""
    import torch
    import torch.distributed as dist

    _init_alone(a.backend)
    t = torch.ones(256)
    out = []
    for nbytes in CACHE_SIZES:
        src = torch.ones(max(nbytes // 4, 1))
        dst = torch.empty_like(src)
        times = []
        for i in range(2_200):
            if nbytes:
                dst.copy_(src)
            start = time.perf_counter_ns()
            dist.all_reduce(t)
            if i >= 200:
                times.append(time.perf_counter_ns() - start)
        out.append(f"{nbytes}:{statistics.median(times) / 1e3:.3f}")
    print(a.backend, " ".join(out))
    dist.destroy_process_group()


def cache(a) -> None:
    import torch

    res = {b: {s: [] for s in CACHE_SIZES} for b in _floor_backends()}
    for _ in range(a.reps):
        for backend, by_size in res.items():
            out = run([sys.executable, __file__, "_cache", "--backend", backend])
            for item in out.split()[1:]:
                s, us = item.split(":")
                by_size[int(s)].append(float(us))
    print(
        f"# torch {torch.__version__}, world size 1, dist.all_reduce of 256 float32 after a "
        f"copy of S bytes (S = 0: no copy), {a.reps} interleaved repetitions: medians of "
        "the repetitions' medians, us"
    )
    names = list(res)
    head = "".join(f"{b:>10}" for b in names)
    print(f"  {'S':>9}{head}" + ("  ferroccl - fake" if "fake" in res else ""))
    for s in CACHE_SIZES:
        med = {b: statistics.median(res[b][s]) for b in names}
        row = "".join(f"{med[b]:10.2f}" for b in names)
        gap = f"  {med['ferroccl'] - med['fake']:16.2f}" if "fake" in med else ""
        print(f"  {s:>9}{row}{gap}")


def ddp(a) -> None:
    ex = os.path.join(ROOT, "crates", "ferroccl-py", "examples", "ddp_resnet.py")
    res = {"ferroccl": [], "gloo": []}
    for _ in range(a.reps):
        for backend in ("ferroccl", "gloo"):
            launcher = (
                [
                    os.path.join(ROOT, "tools", "emulated-cluster"),
                    "run",
                    str(a.hosts),
                    "--ranks-per-host",
                    str(a.ranks[0] // a.hosts),
                    "--",
                ]
                if a.hosts
                else [a.ferroccl, "launch", "-n", str(a.ranks[0]), "--"]
            )
            # gloo binds the address its host name resolves to: in the emulated
            # cluster's namespaces that is loopback, so name the interface.
            env = dict(os.environ, GLOO_SOCKET_IFNAME="eth0") if a.hosts else None
            out = run(
                [
                    *launcher,
                    sys.executable,
                    ex,
                    "--backend",
                    backend,
                    "--steps",
                    str(a.steps),
                    "--log-every",
                    str(a.steps),
                ],
                env=env,
            )
            line = next(ln for ln in out.splitlines() if "summary " in ln)
            res[backend].append(json.loads(line.split("summary ", 1)[1]))
    med = {
        b: {
            k: statistics.median(r[k] for r in rs)
            for k in ("comm_ms_per_step", "comm_alone_ms", "images_per_s", "step_ms")
        }
        for b, rs in res.items()
    }
    loss_gap = max(
        abs(x - y) for x, y in zip(res["ferroccl"][0]["losses"], res["gloo"][0]["losses"])
    )
    print(
        f"# ddp_resnet.py, {a.ranks[0]} ranks, {a.steps} steps, {a.reps} interleaved "
        "repetitions, medians"
    )
    for b, m in med.items():
        print(
            f"  {b:9s} comm {m['comm_ms_per_step']:8.2f} ms/step in the step, "
            f"{m['comm_alone_ms']:8.2f} ms alone  {m['images_per_s']:7.1f} images/s  "
            f"step {m['step_ms']:7.1f} ms"
        )
    f, g = med["ferroccl"], med["gloo"]
    print(
        f"  ferroccl/gloo: comm in the step {f['comm_ms_per_step'] / g['comm_ms_per_step']:.2f}x, "
        f"alone {f['comm_alone_ms'] / g['comm_alone_ms']:.2f}x, "
        f"images/s {f['images_per_s'] / g['images_per_s']:.2f}x; "
        f"largest loss difference {loss_gap:.2e}"
    )


def size(v: str) -> int:
    """A byte count as bench takes one: ``4096``, ``64K``, ``32M``, ``1G``."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = v.strip().upper()
    try:
        return int(t[:-1]) * units[t[-1]] if t and t[-1] in units else int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{v!r} is not a size (4096, 64K, 32M)") from None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "mode",
        choices=[
            "binding",
            "ddp",
            "layers",
            "floor",
            "cache",
            "_rank",
            "_layers",
            "_floor",
            "_cache",
        ],
    )
    p.add_argument("--ranks", default="2,4")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--ferroccl", default=os.path.join(ROOT, "target", "release", "ferroccl"))
    p.add_argument(
        "--hosts",
        type=int,
        default=0,
        help="ddp: run on the first HOSTS hosts of tools/emulated-cluster (up already), "
        "--ranks spread over them",
    )
    p.add_argument("--out")
    p.add_argument("--json", help="binding: also write the rows (every repetition) here")
    p.add_argument("--backend", default="ferroccl")
    p.add_argument("--minbytes", type=size, default=1024)
    p.add_argument("--maxbytes", type=size, default=64 << 20)
    p.add_argument("--factor", type=int, default=8)
    p.add_argument("--warmup", type=int, default=5)
    a = p.parse_args()
    a.ranks = [int(x) for x in a.ranks.split(",")]
    modes = {"binding": binding, "ddp": ddp, "layers": layers, "floor": floor, "cache": cache}
    modes.update({"_rank": rank_main, "_layers": layers_rank, "_floor": floor_rank})
    modes["_cache"] = cache_rank
    modes[a.mode](a)


if __name__ == "__main__":
    main()
