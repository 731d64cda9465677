"""The staging table of `tools/gpu-check all`: `ferroccl bench` JSON of device buffers
staged over shared memory and of host buffers over shared memory (2 ranks, the same
sizes, interleaved repetitions), side by side.

    python3 tools/gpu_check_staging.py DIR OUT.json

DIR holds device-<rep>.json and host-<rep>.json. Prints one table (each side's best
in-place busbw over the repetitions, every repetition's beside it, and the ratio; the
target is >= 0.8 from 4 MiB) and writes it as JSON. Exit status 1 when a result was
wrong; the target is reported, not enforced.
"""

import glob
import json
import os
import sys

TARGET = 0.8


def load(d, side):
    reps = []
    for path in sorted(glob.glob(os.path.join(d, f"{side}-*.json"))):
        with open(path) as f:
            reps.append({r["bytes"]: r for r in json.load(f)["rows"]})
    return reps


def main():
    d, out = sys.argv[1], sys.argv[2]
    dev, host = load(d, "device"), load(d, "host")
    if not dev or not host:
        print(f"gpu-check staging: no bench output in {d}", file=sys.stderr)
        return 2
    print("# staging: device buffers over shm against host buffers over shm, 2 ranks, in place")
    print(
        f"#{'size (B)':>11} {'device GB/s':>12} {'host GB/s':>10} {'ratio':>6} {'target':>7} {'#wrong':>7}  reps (device / host)"
    )
    rows, wrong = [], 0
    for b in sorted(dev[0]):
        dv = [r[b]["ip_busbw_gbs"] for r in dev if b in r]
        hv = [r[b]["ip_busbw_gbs"] for r in host if b in r]
        w = sum(r[b]["ip_wrong"] for r in dev if b in r) + sum(
            r[b]["ip_wrong"] for r in host if b in r
        )
        wrong += w
        ratio = max(dv) / max(max(hv), 1e-12)
        miss = "" if ratio >= TARGET else "  MISSED"
        reps = " ".join(f"{x:.2f}" for x in dv) + " / " + " ".join(f"{x:.2f}" for x in hv)
        print(
            f"{b:>12} {max(dv):>12.2f} {max(hv):>10.2f} {ratio:>6.2f} {'>=0.80':>7} {w:>7}  {reps}{miss}"
        )
        rows.append(
            {
                "bytes": b,
                "device_busbw_gbs": dv,
                "host_busbw_gbs": hv,
                "ratio": ratio,
                "wrong": w,
            }
        )
    with open(out, "w") as f:
        json.dump(
            {
                "check": "staging",
                "ranks": 2,
                "transport": "shm",
                "target": TARGET,
                "rows": rows,
            },
            f,
            indent=1,
        )
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
