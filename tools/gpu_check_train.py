"""`tools/gpu-check train`: `ferroccl train --device cuda` (candle's CUDA tensors) on a
GPU host, from a binary built elsewhere with `--features candle-cuda`.

    python3 tools/gpu_check_train.py --bin .gpu/ferroccl-candle-cuda \
        [--plain-bin .gpu/ferroccl] [--json OUT.json] [--budget SECONDS]

Every run is `ferroccl train` under its own launcher (`-n N`: N processes, each on GPU
local-rank modulo the GPUs, so with one GPU they share it) with a deadline:

- LeNet, data-parallel: 1 rank and 2 ranks with the same global batch. Targets: the
  2 ranks' replicas bitwise equal (the trainer's digest check) and their final weights
  within 1e-5 (relative, per tensor) of the 1 rank's. Beside them, 1 rank on the CPU:
  how far candle's CUDA kernels land from its CPU kernels (reported, no target).
- The 8-layer MLP: 1 rank (--mlp), 2 pipeline stages (--pipeline 2), 2 ZeRO-1
  replicas (--mlp --zero 1) and 2 tensor-parallel ranks (--tensor-parallel 2): within
  1e-5 of the 1 rank, replicas bitwise equal.
- LeNet on 2 ranks with bf16 compute (refused on the CPU, where candle has no bf16
  matmul), with bf16 gradients on the wire, and on the parameter server (--mode ssp).
- --scaling 1,2,4: images/s, speedup and efficiency per world size (one GPU: the ranks
  share it, so this measures sharing, not a cluster).
- With --plain-bin (the default build, which loads CUDA only when asked): --device
  cuda is refused at once with the typed error naming CUDA and candle-cuda.

Prints one table and writes JSON; exit status 1 when a check went wrong, 2 when the
binary could not run at all. Weights are read from `--save-weights` files (ferroccl's
checkpoint format: magic, header length, JSON header, f32 data, SHA-256).
"""

import argparse
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time

TOL = 1e-5
BASE = ["--synthetic", "4000", "-b", "64", "--max-steps", "30", "--log-every", "10"]


def load_weights(path):
    """{name: list of floats} from a ferroccl checkpoint file, its digest checked."""
    with open(path, "rb") as f:
        blob = f.read()
    if blob[:8] != b"FCCKPT\0\x01":
        raise ValueError(f"{path}: not a ferroccl checkpoint")
    if hashlib.sha256(blob[:-32]).digest() != blob[-32:]:
        raise ValueError(f"{path}: digest does not match")
    (hlen,) = struct.unpack_from("<Q", blob, 8)
    header = json.loads(blob[16 : 16 + hlen])
    base = 16 + hlen
    out = {}
    for t in header["tensors"]:
        at = base + 4 * t["offset"]
        out[t["name"]] = struct.unpack_from(f"<{t['len']}f", blob, at)
    return out


def distance(a, b):
    """Largest |a - b| over the largest |b|, per tensor, over the tensors."""
    if list(a) != list(b):
        raise ValueError(f"different tensors: {list(a)} / {list(b)}")
    worst = 0.0
    for name in a:
        x, y = a[name], b[name]
        d = max((abs(p - q) for p, q in zip(x, y)), default=0.0)
        worst = max(worst, d / max(max((abs(q) for q in y), default=0.0), 1e-6))
    return worst


class Check:
    def __init__(self, args):
        self.bin, self.plain = args.bin, args.plain_bin
        self.deadline = time.monotonic() + args.budget
        self.tmp = tempfile.mkdtemp(prefix="ferroccl-train-check-")
        self.rows = []

    def row(self, check, ranks, ok, detail, secs, **extra):
        r = {"check": check, "ranks": ranks, "ok": ok, "detail": detail, "secs": round(secs, 1)}
        r.update(extra)
        self.rows.append(r)
        mark = {True: "ok", False: "WRONG", None: "MISSED"}[ok]
        print(f"  {check:<34} {ranks!s:>5}  {mark:<7} {secs:6.1f} s  {detail}", flush=True)

    def train(self, name, extra, binary=None, weights=True):
        """Runs `train` with BASE + extra; (exit status, stdout, stderr, weights file,
        summary dict or None, seconds)."""
        left = self.deadline - time.monotonic()
        if left < 5:
            raise TimeoutError("out of budget")
        w = os.path.join(self.tmp, f"{name}.fcc")
        s = os.path.join(self.tmp, f"{name}.json")
        cmd = [binary or self.bin, "train", *BASE, *extra, "--summary", s]
        if weights:
            cmd += ["--save-weights", w]
        t = time.monotonic()
        p = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=min(150, left))
        secs = time.monotonic() - t
        summary = None
        if p.returncode == 0 and os.path.exists(s):
            with open(s) as f:
                summary = json.load(f)
        if p.returncode != 0:
            sys.stderr.write(f"$ {' '.join(cmd)}\n{p.stdout[-2000:]}{p.stderr[-4000:]}\n")
        return p.returncode, p.stdout, p.stderr, w, summary, secs

    def against(self, check, ranks, name, extra, one, one_name):
        """A run whose weights must be within TOL of `one` with its replicas equal."""
        rc, _, err, w, s, secs = self.train(name, extra)
        if rc != 0:
            self.row(check, ranks, False, f"exit {rc}: {err.strip().splitlines()[-1:]}", secs)
            return None
        d = distance(load_weights(w), one)
        equal = bool(s and s.get("replicas_equal"))
        ok = equal and d <= TOL
        detail = f"replicas {'bitwise equal' if equal else 'DIFFER'}; {d:.1e} from {one_name}"
        self.row(check, ranks, ok, detail, secs, distance=d, replicas_equal=equal, summary=s)
        return w

    def baseline(self, check, name, extra):
        rc, _, err, w, s, secs = self.train(name, extra)
        if rc != 0:
            self.row(check, 1, False, f"exit {rc}: {err.strip().splitlines()[-1:]}", secs)
            return None
        detail = f"{s['images_per_s']:.0f} images/s" if s and "images_per_s" in s else "ran"
        self.row(check, 1, True, detail, secs, summary=s)
        return load_weights(w)

    def scaling(self):
        left = self.deadline - time.monotonic()
        cmd = [
            self.bin,
            "train",
            "--device",
            "cuda",
            "--synthetic",
            "8000",
            "-b",
            "256",
            "--epochs",
            "1",
            "--log-every",
            "100",
            "--scaling",
            "1,2,4",
            "--plot",
            os.path.join(self.tmp, "scaling.svg"),
        ]
        t = time.monotonic()
        p = subprocess.run(
            cmd, check=False, capture_output=True, text=True, timeout=max(5, min(150, left))
        )
        secs = time.monotonic() - t
        if p.returncode != 0:
            sys.stderr.write(p.stdout[-2000:] + p.stderr[-4000:])
            self.row("--scaling 1,2,4", "1,2,4", False, f"exit {p.returncode}", secs)
            return
        table = []
        for line in p.stdout.splitlines():
            cells = line.split()
            if len(cells) == 7 and cells[0].isdigit():
                table.append(
                    {
                        "ranks": int(cells[0]),
                        "images_per_s": float(cells[1]),
                        "speedup": float(cells[2]),
                        "efficiency": cells[3],
                        "test_accuracy": cells[4],
                    }
                )
        detail = ", ".join(f"{r['ranks']}: {r['images_per_s']:.0f}/s" for r in table)
        self.row(
            "--scaling 1,2,4",
            "1,2,4",
            len(table) == 3,
            f"images/s {detail}",
            secs,
            table=table,
            output=p.stdout,
        )

    def refused(self):
        t = time.monotonic()
        p = subprocess.run(
            [self.plain, "train", "--device", "cuda", "-n", "2"],
            check=False,
            capture_output=True,
            text=True,
            timeout=60,
        )
        secs = time.monotonic() - t
        ok = p.returncode != 0 and "candle-cuda" in p.stderr and "CUDA" in p.stderr
        self.row(
            "default build refuses --device cuda",
            2,
            ok,
            p.stderr.strip().splitlines()[-1][:90] if p.stderr.strip() else "(no error)",
            secs,
        )

    def run(self):
        cuda = ["--device", "cuda"]
        one = self.baseline("LeNet DDP (CUDA)", "lenet1", [*cuda, "-n", "1"])
        if one is not None:
            self.against("LeNet DDP (CUDA)", 2, "lenet2", [*cuda, "-n", "2"], one, "1 rank")
            cpu = self.baseline("LeNet DDP (CPU), for comparison", "lenet-cpu", ["-n", "1"])
            if cpu is not None:
                d = distance(one, cpu)
                self.row(
                    "LeNet: CUDA against CPU, 1 rank",
                    1,
                    True,
                    f"{d:.1e} apart (candle's kernels, no target)",
                    0.0,
                    distance=d,
                )
        mlp1 = self.baseline("MLP (CUDA)", "mlp1", [*cuda, "-n", "1", "--mlp"])
        if mlp1 is not None:
            self.against(
                "MLP --pipeline 2 (CUDA)",
                2,
                "pipe2",
                [*cuda, "-n", "2", "--pipeline", "2", "--micro-batches", "2"],
                mlp1,
                "1 rank",
            )
            self.against(
                "MLP --zero 1 (CUDA)",
                2,
                "zero2",
                [*cuda, "-n", "2", "--mlp", "--zero", "1"],
                mlp1,
                "1 rank",
            )
            self.against(
                "MLP --tensor-parallel 2 (CUDA)",
                2,
                "tp2",
                [*cuda, "-n", "2", "--tensor-parallel", "2"],
                mlp1,
                "1 rank",
            )
        for check, name, extra in [
            ("LeNet DDP bf16 compute (CUDA)", "bf16", ["--precision", "bf16"]),
            ("LeNet DDP, bf16 gradients on the wire", "wire", ["--wire", "bf16"]),
        ]:
            rc, _, _, _, s, secs = self.train(name, [*cuda, "-n", "2", *extra])
            ok = rc == 0 and bool(s and s.get("replicas_equal"))
            detail = f"loss {s['step_loss']:.4f}, replicas bitwise equal" if ok else f"exit {rc}"
            self.row(check, 2, ok, detail, secs, summary=s)
        rc, _, _, _, s, secs = self.train("ssp", [*cuda, "-n", "2", "--mode", "ssp"], weights=False)
        ok = rc == 0 and s is not None
        self.row(
            "LeNet parameter server (--mode ssp)",
            2,
            ok,
            f"test accuracy {100 * s['test_accuracy']:.1f}%" if ok else f"exit {rc}",
            secs,
            summary=s,
        )
        self.scaling()
        if self.plain:
            self.refused()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin", required=True, help="ferroccl built with --features candle-cuda")
    ap.add_argument("--plain-bin", help="the default build, to check its refusal")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--budget", type=float, default=240.0, help="seconds for every run together")
    args = ap.parse_args()
    if not (os.path.isfile(args.bin) and os.access(args.bin, os.X_OK)):
        print(
            f"gpu-check train: no binary at {args.bin} (tools/gpu-check pack builds it)",
            file=sys.stderr,
        )
        return 2
    c = Check(args)
    print(f"# gpu-check train: {args.bin} (ferroccl train --device cuda), tolerance {TOL}")
    print(f"  {'check':<34} {'ranks':>5}  {'result':<7} {'time':>8}  detail")
    t = time.monotonic()
    try:
        c.run()
    except (TimeoutError, subprocess.TimeoutExpired) as e:
        c.row("budget", "-", False, f"stopped: {e}", 0.0)
    finally:
        shutil.rmtree(c.tmp, ignore_errors=True)
    wrong = sum(1 for r in c.rows if r["ok"] is False)
    print(f"# {len(c.rows)} rows, {wrong} wrong, {time.monotonic() - t:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"check": "train", "tolerance": TOL, "rows": c.rows, "wrong": wrong}, f, indent=1
            )
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
