"""Runs a function of ``workers.py`` on N ranks, each a process, and returns what each
returned. A rank that fails or hangs fails the test, with every rank's output."""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(
    n: int,
    fn: str,
    *args,
    init: str = "file",
    timeout: float = 90.0,
    env=None,
    allow_fail=(),
    module: str = "workers",
):
    """Runs ``<module>.<fn>(rank, n, *args)`` (``workers`` by default) on ranks 0..n.
    Returns the results by rank (a rank in ``allow_fail`` may die: its result is
    None)."""
    with tempfile.TemporaryDirectory(prefix="ferroccl-pytest-") as tmp:
        port = free_port()
        procs = []
        for r in range(n):
            e = dict(os.environ)
            e.update(env or {})
            e["PYTHONPATH"] = os.pathsep.join([HERE, e.get("PYTHONPATH", "")])
            if init == "env":
                e.update(
                    MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(port),
                    RANK=str(r),
                    WORLD_SIZE=str(n),
                    LOCAL_RANK=str(r),
                )
            spec = pickle.dumps((fn, r, n, init, tmp, args)).hex()
            out = open(os.path.join(tmp, f"out.{r}"), "w+")  # noqa: SIM115 - closed below
            procs.append(
                (
                    subprocess.Popen(
                        [sys.executable, "-m", module, spec],
                        env=e,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                    ),
                    out,
                )
            )
        deadline = time.monotonic() + timeout
        hung = False
        for p, _ in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                hung = True
        for p, _ in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        logs = []
        for r, (p, out) in enumerate(procs):
            out.seek(0)
            logs.append(f"--- rank {r} (exit {p.returncode}) ---\n{out.read()[-4000:]}")
            out.close()
        log = "\n".join(logs)
        if hung:
            raise AssertionError(f"{fn} on {n} ranks did not finish in {timeout} s:\n{log}")
        results = []
        for r, (p, _) in enumerate(procs):
            if p.returncode != 0:
                if r in allow_fail:
                    results.append(None)
                    continue
                raise AssertionError(f"{fn}: rank {r} failed:\n{log}")
            with open(os.path.join(tmp, f"result.{r}"), "rb") as f:
                results.append(pickle.load(f))
        return results
