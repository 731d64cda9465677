#!/usr/bin/env python3
"""The torch backend "ferroccl" on CUDA tensors, checked on a GPU host in one command:
the acceptance check of "CUDA tensors from PyTorch" (docs/book/src/python.md).

    tools/gpu-check torch [--json FILE]      (installs .gpu/wheel, then runs this)

Every rank is a process on GPU 0 (several ranks share it); every step has a deadline,
so nothing hangs the check. It prints one table, then the same rows as JSON (also
written to ``--json``):

1. every collective the backend has (all_reduce with every op, reduce, broadcast,
   all_gather and all_gather_into_tensor, reduce_scatter and reduce_scatter_tensor,
   gather, scatter, all_to_all_single even and uneven, all_to_all, isend/irecv,
   batch_isend_irecv, the coalesced forms, async with futures, a non-contiguous
   tensor) on CUDA tensors of every dtype, against its definition, at 2 and 4 ranks
   over CUDA IPC and at 2 ranks staged through host memory;
2. stream order: inputs still being written on torch's current stream (a side stream
   and the default one) at issue, results read at once after ``wait()``, memory
   released and reused at once; wrong elements counted;
3. DDP on torchvision's ResNet-18 (synthetic data, deterministic kernels) at 2 ranks,
   over ferroccl and over gloo: replicas bitwise equal, losses within 1e-5 of gloo's,
   and each backend's step time, communication per step, images/s and one step's
   gradients all-reduced alone; the issue's targets (communication <= 0.3x gloo's,
   images/s >= gloo's) are reported, not enforced;
4. DDP's fp16 and bf16 compression hooks (replicas bitwise equal; fp16 and no hook
   against gloo) and a ``new_group`` of the ranks in reverse order, on the GPU;
5. a mismatched call (2 and 3 ranks) raises MismatchError on every rank, and a rank
   killed with SIGKILL during DDP is named by every survivor within the timeout.

``--cpu`` rehearses the same steps on CPU tensors (a small DDP run) where there is no
GPU: it checks the check, not CUDA.

Exit status: 0 when every check is right, 1 when one is not, 2 when the check could
not run at all (no CUDA, no ferroccl).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.normpath(os.path.join(HERE, "..", "crates", "ferroccl-py", "tests"))
sys.path.insert(0, TESTS)

ROWS: list[dict] = []
# When the whole check must be over (set by --budget): each step's deadline is the
# lesser of its own and what is left.
DEADLINE = [float("inf")]
# "cuda", or "cpu" for a rehearsal (--cpu).
DEVICE = ["cuda"]


def left(limit: float) -> float:
    """A step's deadline in seconds: at most ``limit``, at most what is left."""
    return min(limit, DEADLINE[0] - time.monotonic())


def row(check, ranks, ok, detail, secs, **data):
    r = {
        "check": check,
        "ranks": ranks,
        "ok": ok,
        "detail": detail,
        "secs": round(secs, 1),
    }
    r.update(data)
    ROWS.append(r)
    status = "ok" if ok else ("MISSED" if ok is None else "WRONG")
    print(f"  {check:<28} {ranks:>5}  {status:<6} {secs:6.1f} s  {detail}", flush=True)


def attempt(check, ranks, fn):
    """Runs one check; a failure (a rank's error, a hang) is a WRONG row with the
    first lines of what the ranks said."""
    t0 = time.monotonic()
    if left(1e9) < 15:
        row(check, ranks, False, "not run: the check's time budget is spent", 0.0)
        return
    try:
        fn(t0)
    except Exception as e:  # noqa: BLE001 - every failure is a row
        text = str(e).strip().splitlines() or [type(e).__name__]
        detail = " | ".join(text[:3])[:300]
        row(check, ranks, False, detail, time.monotonic() - t0, error=str(e)[-4000:])


def collectives(n, staged=False):
    import ranks

    env = {"FERROCCL_CUDA_TRANSPORT": "staged"} if staged else {}

    def run(t0):
        res = ranks.run(n, "collectives", DEVICE[0], module="gpu", timeout=left(150), env=env)
        ok = all(isinstance(r, int) and r > 0 for r in res)
        detail = f"{res[0]} checks per rank, every dtype, 0 wrong"
        how = "staged" if staged else ("cuda-ipc" if DEVICE[0] == "cuda" else "cpu")
        row(
            f"collectives ({how})",
            n,
            ok,
            detail,
            time.monotonic() - t0,
            per_rank=res,
        )

    attempt("collectives", n, run)


def streams(n):
    import ranks

    def run(t0):
        res = ranks.run(n, "streams", module="gpu", timeout=left(150))
        wrong = sum(res)
        row(
            "stream order",
            n,
            wrong == 0,
            f"{wrong} wrong elements",
            time.monotonic() - t0,
            wrong=wrong,
        )

    attempt("stream order", n, run)


def ddp():
    import ranks

    def run(t0):
        small = (6, 2, 4, 32) if DEVICE[0] == "cpu" else ()  # steps, warm-up, batch, image
        res = ranks.run(2, "ddp_resnet", *small, module="gpu", timeout=left(300))
        for b in ("ferroccl", "gloo"):
            digests = {r[b]["digest"] for r in res}
            same = len(digests) == 1
            row(
                f"DDP replicas ({b})",
                2,
                same,
                "bitwise equal" if same else f"{len(digests)} different parameter sets",
                time.monotonic() - t0,
            )
        gap = max(
            abs(a - b) for r in res for a, b in zip(r["ferroccl"]["losses"], r["gloo"]["losses"])
        )
        pgap = max(r["param_gap"] for r in res)
        row(
            "DDP losses vs gloo",
            2,
            gap <= 1e-5,
            f"largest loss difference {gap:.2e} (parameters {pgap:.2e})",
            time.monotonic() - t0,
            loss_gap=gap,
            param_gap=pgap,
        )
        f, g = res[0]["ferroccl"], res[0]["gloo"]
        for name, m in (("ferroccl", f), ("gloo", g)):
            row(
                f"DDP ResNet-18 {name}",
                2,
                True,
                f"step {m['step_ms']:.1f} ms, comm {m['comm_ms']:.2f} ms/step, "
                f"{m['images_per_s']:.0f} images/s, {m['grad_mib']:.1f} MiB alone "
                f"{m['alone_ms']:.2f} ms",
                0.0,
                **{k: v for k, v in m.items() if k != "losses"},
            )
        ratio = f["comm_ms"] / max(g["comm_ms"], 1e-9)
        row(
            "target: comm <= 0.3x gloo",
            2,
            True if ratio <= 0.3 else None,
            f"{ratio:.3f}x",
            0.0,
            ratio=ratio,
        )
        speed = f["images_per_s"] / max(g["images_per_s"], 1e-9)
        row(
            "target: images/s >= gloo",
            2,
            True if speed >= 1.0 else None,
            f"{speed:.3f}x",
            0.0,
            ratio=speed,
        )

    attempt("DDP ResNet-18", 2, run)


def hooks_and_groups(n):
    import ranks

    def run(t0):
        res = ranks.run(n, "hooks_and_groups", module="gpu", timeout=left(150))
        keys = [k for k in res[0] if "/" in k and "digest" in res[0][k]]
        same = all(len({r[k]["digest"] for r in res}) == 1 for k in keys)
        gap = {}
        for name in ("none", "fp16"):
            a, b = res[0][f"{name}/ferroccl"]["losses"], res[0][f"{name}/gloo"]["losses"]
            gap[name] = max(abs(x - y) for x, y in zip(a, b))
        ref = res[0]["none/ferroccl"]["losses"]
        bf16 = res[0].get("bf16/ferroccl", {})
        gap["bf16 vs none"] = max(
            (abs(x - y) for x, y in zip(bf16.get("losses", ref), ref)), default=0.0
        )
        want = n * (n + 1) / 2
        grp = all(r["group_sum"] == want and r["group_bcast"] == n - 1 for r in res)
        ok = same and grp and gap["none"] <= 1e-5 and gap["fp16"] <= 1e-3
        ok = ok and gap["bf16 vs none"] <= 5e-2
        detail = (
            f"replicas {'bitwise equal' if same else 'DIFFER'}; loss gaps to gloo: none "
            f"{gap['none']:.1e}, fp16 {gap['fp16']:.1e}; bf16 to no hook "
            f"{gap['bf16 vs none']:.1e}; new_group {'right' if grp else 'WRONG'}"
        )
        if "refused" in bf16:
            detail += f"; bf16 hook refused by torch: {bf16['refused'][:60]}"
        row("DDP hooks, new_group", n, ok, detail, time.monotonic() - t0, gaps=gap)

    attempt("DDP hooks, new_group", n, run)


def mismatch(n):
    import ranks

    def run(t0):
        res = ranks.run(n, "mismatch", module="gpu", timeout=left(90))
        ok = all(r["type"] == "MismatchError" or "MismatchError" in r["msg"] for r in res)
        ok = ok and all("mismatched collective" in r["msg"] for r in res)
        worst = max(r["after"] for r in res)
        detail = ", ".join(f"rank {q}: {r['type']}" for q, r in enumerate(res))
        row(
            "mismatch raises everywhere",
            n,
            ok,
            f"{detail} (within {worst:.1f} s)",
            time.monotonic() - t0,
            results=res,
        )

    attempt("mismatch raises everywhere", n, run)


def killed(n, timeout=15):
    import ranks

    def run(t0):
        res = ranks.run(n, "killed", timeout, module="gpu", allow_fail={n - 1}, timeout=left(120))
        survivors = res[: n - 1]
        ok = res[n - 1] is None and all(
            r["type"] is not None and f"rank {n - 1}" in r["msg"] and r["after"] < timeout + 10
            for r in survivors
        )
        worst = max(r["after"] for r in survivors)
        detail = (
            f"every survivor named rank {n - 1} within {worst:.1f} s"
            if ok
            else str([(r["type"], r["msg"][:120]) for r in survivors])
        )
        row(
            "kill -9 named by survivors",
            n,
            ok,
            detail,
            time.monotonic() - t0,
            results=res,
        )

    attempt("kill -9 named by survivors", n, run)


def environment():
    import ferroccl
    import torch

    if DEVICE[0] == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu-check torch: torch sees no CUDA device")
    import ferroccl.torch
    import torch.distributed as dist

    caps = getattr(dist.Backend, "backend_capability", {}).get("ferroccl")
    info = {
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if DEVICE[0] == "cuda" else "none (--cpu)",
        "gpus": torch.cuda.device_count() if DEVICE[0] == "cuda" else 0,
        "ferroccl": ferroccl.__version__,
        "ferroccl_has_cuda": ferroccl._native.has_cuda,
        "capability": caps,
        "python": sys.version.split()[0],
    }
    print(
        f"# gpu-check torch: {info['gpu']} ({info['gpus']} GPU(s)), torch {info['torch']}, "
        f"Python {info['python']}, ferroccl {info['ferroccl']} (CUDA build: "
        f"{info['ferroccl_has_cuda']}), backend devices {caps}",
        flush=True,
    )
    print(f"  {'check':<28} {'ranks':>5}  {'result':<6} {'time':>8}  detail", flush=True)
    ok = info["ferroccl_has_cuda"] and (caps is None or "cuda" in caps)
    row("backend registered for cuda", "-", ok, f"{caps}", 0.0)
    return info


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--json",
        default=os.path.join(os.environ.get("OUT", "."), "gpu-check-torch.json"),
    )
    p.add_argument("--quick", action="store_true", help="collectives at 2 ranks only, no DDP")
    p.add_argument("--budget", type=float, default=330, help="seconds for the whole check")
    p.add_argument("--cpu", action="store_true", help="rehearse on CPU tensors (no GPU)")
    a = p.parse_args()
    if a.cpu:
        DEVICE[0] = "cpu"
        os.environ["FERROCCL_CHECK_DEVICE"] = "cpu"
    start = time.monotonic()
    DEADLINE[0] = start + a.budget
    try:
        info = environment()
    except (ImportError, SystemExit) as e:
        print(f"gpu-check torch: cannot run: {e}", file=sys.stderr)
        traceback.print_exc()
        return 2
    collectives(2)
    if not a.quick:
        collectives(4)
        collectives(2, staged=True)
    streams(2)
    if not a.quick:
        streams(4)
        hooks_and_groups(2)
        ddp()
    mismatch(2)
    mismatch(3)
    killed(3)
    wrong = [r for r in ROWS if r["ok"] is False]
    missed = [r for r in ROWS if r["ok"] is None]
    secs = time.monotonic() - start
    print(
        f"# {len(ROWS)} rows, {len(wrong)} wrong, {len(missed)} targets missed, {secs:.0f} s",
        flush=True,
    )
    doc = {
        "info": info,
        "rows": ROWS,
        "wrong": len(wrong),
        "missed": len(missed),
        "secs": secs,
    }
    with open(a.json, "w") as f:
        json.dump(doc, f, indent=1, default=str)
    print(json.dumps(doc, default=str))
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
