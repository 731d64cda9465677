#!/usr/bin/env python3
"""PyTorch's own distributed test suite against the torch.distributed backend "ferroccl".

Runs ``torch.testing._internal.distributed.distributed_test`` (the suite behind
upstream's ``test/distributed/test_distributed_spawn.py``): every test spawns
``--world-size`` processes that each join a process group of the backend on a
``file://`` store, run the test's body and exit.

    tools/torch_distributed_test.py --curated               # the list known to pass
    tools/torch_distributed_test.py --all --timeout 60      # the whole suite
    tools/torch_distributed_test.py --all -k all_reduce -k 'test_barrier*'
    tools/torch_distributed_test.py --list names.txt --world-size 3
    tools/torch_distributed_test.py --all --backend gloo -k scatter   # gloo, to compare

Each test fails (instead of blocking) once its processes have run ``--timeout``
seconds. The end prints the passed / failed / skipped counts, the skip reasons
and, for every failure, the test and the first line of its error (``--tracebacks``
adds the full texts). The exit status is 0 when nothing failed.

The runner declares the backend to the suite before importing it, as upstream does
for its own backends: ``DistTestCases.backend_feature`` "plugin", "ddp" and
"subgroup" (``--feature`` adds more), and ``skip_collective["sendrecv anysource"]``
(ferroccl has no receive from any source). Where torch 1.13's
``torch.distributed._shard`` cannot be imported (Python 3.11), the ranks run DDP
without the suite's ReplicatedTensor mode, which would otherwise fail every DDP test
on that import.

The ``ferroccl`` package must be importable (installed, or staged on PYTHONPATH).
Under pytest, name the backend in the environment (the module collects nothing
without it, so a repository-wide pytest does not start the suite):

    BACKEND=ferroccl WORLD_SIZE=2 python3 -m pytest tools/torch_distributed_test.py -k broadcast
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib
import logging
import os
import re
import sys
import tempfile
import threading
import time
import traceback
import unittest

# Tests known to pass with the ferroccl backend on 2 ranks (``--curated``; about 95 s
# on 2 cores). The suite has no CPU all_to_all or reduce_scatter test for a backend
# other than MPI or NCCL, and its subgroup tests need GPUs.
CURATED = [
    # all_reduce
    "test_all_reduce_sum",
    "test_all_reduce_sum_async",
    "test_all_reduce_max",
    "test_all_reduce_product",
    "test_all_reduce_sum_complex",
    "test_all_reduce_full_group_sum",
    # broadcast (float, double, int8, uint8, int32, int64 from every source)
    "test_broadcast",
    # reduce
    "test_reduce_sum",
    "test_reduce_full_group_min",
    # all_gather
    "test_all_gather",
    "test_all_gather_coalesced_with_empty",
    # gather, scatter
    "test_gather",
    "test_scatter",
    # barrier
    "test_barrier",
    "test_barrier_full_group",
    # send / recv
    "test_send_recv",
    "test_send_recv_with_tag",
    "test_isend",
    "test_irecv",
    # new_group
    "test_get_rank_size_full_group",
    "test_destroy_full_group",
    "test_get_backend",
    # DDP
    "test_DistributedDataParallelCPU",
    "test_DistributedDataParallel_requires_grad",
    "test_ddp_create_graph",
    "test_static_graph_api_cpu",
]

# What the backend declares to the suite (``DistTestCases.backend_feature``); the
# suite reads these sets when it defines its tests, so they are set before its import.
FEATURES = ("plugin", "ddp", "subgroup")
# What ferroccl lacks (``DistTestCases.skip_collective``): the suite skips its tests,
# as it does for NCCL's.
UNSUPPORTED = ("sendrecv anysource",)
DEFAULT_TIMEOUT = 60


def _parse_args(argv):
    p = argparse.ArgumentParser(
        description="Runs PyTorch's distributed_test suite against the ferroccl backend."
    )
    which = p.add_mutually_exclusive_group()
    which.add_argument("--all", action="store_true", help="every test of the suite")
    which.add_argument(
        "--curated", action="store_true", help="the tests known to pass (the default)"
    )
    which.add_argument("--list", metavar="FILE", help="the tests named in FILE, one a line")
    p.add_argument("--world-size", type=int, default=2, help="ranks per test (default 2)")
    p.add_argument(
        "--feature",
        dest="features",
        action="append",
        default=[],
        metavar="NAME",
        help="declare one more DistTestCases.backend_feature for the backend (e.g. gpu: "
        "the CPU tests the suite gates on gloo/nccl); repeatable",
    )
    p.add_argument(
        "--child-logs",
        metavar="DIR",
        help="write each rank's output to DIR/<test>.rank<N>.log, not to this terminal",
    )
    add_run_flags(p, "name", DEFAULT_TIMEOUT)
    args = p.parse_args(argv)
    if args.world_size < 1:
        p.error("--world-size must be at least 1")
    check_run_flags(p, args)
    return args


def add_run_flags(p, named: str, timeout: float) -> None:
    """The flags every runner of PyTorch's tests here takes: which tests (``-k``, on
    their ``named``), the backend, the per-test deadline and what is printed."""
    p.add_argument(
        "-k",
        dest="patterns",
        action="append",
        default=[],
        metavar="PATTERN",
        help=f"only tests whose {named} holds PATTERN (fnmatch when it has a *); repeatable",
    )
    p.add_argument("--backend", default="ferroccl", help="the backend to test (default ferroccl)")
    p.add_argument(
        "--timeout",
        type=float,
        default=timeout,
        help=f"seconds a test may run before it fails (default {timeout:g})",
    )
    p.add_argument("--tracebacks", action="store_true", help="print every failure's full text")
    p.add_argument("--names", action="store_true", help="print the selected tests and exit")


def check_run_flags(p, args) -> None:
    """Refuses what :func:`add_run_flags` took and cannot be (through ``p.error``)."""
    if args.timeout <= 0:
        p.error("--timeout must be positive")


if __name__ == "__main__":
    ARGS = _parse_args(sys.argv[1:])
    os.environ["BACKEND"] = ARGS.backend
    os.environ["WORLD_SIZE"] = str(ARGS.world_size)
    os.environ["FERROCCL_DT_FEATURES"] = ",".join(ARGS.features)
    if ARGS.child_logs:
        os.makedirs(ARGS.child_logs, exist_ok=True)
        os.environ["FERROCCL_DT_CHILD_LOGS"] = os.path.abspath(ARGS.child_logs)
    else:
        os.environ.pop("FERROCCL_DT_CHILD_LOGS", None)

BACKEND = os.environ.get("BACKEND")


def _load_suite():
    """Imports the suite for ``BACKEND`` and returns its module.

    Spawned ranks import this file again (as ``__mp_main__``, or by its module name
    under pytest) and get here with the parent's environment."""
    os.environ.setdefault("WORLD_SIZE", "2")
    # The suite reads these when it is imported (a decorator skips the tests that
    # re-initialise unless INIT_METHOD is file://); each test sets its own.
    scratch = tempfile.gettempdir()
    os.environ.setdefault("TEMP_DIR", scratch)
    os.environ.setdefault("INIT_METHOD", "file://" + os.path.join(scratch, "ferroccl_dt_init"))
    os.environ.setdefault("DISTRIBUTED_TESTS_DEFAULT_TIMEOUT", str(DEFAULT_TIMEOUT))
    if BACKEND == "ferroccl":
        importlib.import_module("ferroccl.torch")  # registers the backend
    # torch's common_utils parses sys.argv when imported: hide ours from it.
    argv, sys.argv = sys.argv, sys.argv[:1]
    try:
        cd = importlib.import_module("torch.testing._internal.common_distributed")
        if BACKEND not in ("gloo", "nccl", "mpi", "ucc"):
            extra = os.environ.get("FERROCCL_DT_FEATURES", "").split(",")
            for feature in [*FEATURES, *filter(None, extra)]:
                cd.DistTestCases.backend_feature.setdefault(feature, set()).add(BACKEND)
        if BACKEND == "ferroccl":
            for collective in UNSUPPORTED:
                cd.DistTestCases.skip_collective[collective].add(BACKEND)
        dt = importlib.import_module("torch.testing._internal.distributed.distributed_test")
    finally:
        sys.argv = argv
    # Keep the ranks' errors, drop the suite's and torch's INFO chatter.
    logging.getLogger().setLevel(logging.WARNING)
    return cd, dt


if BACKEND:
    _cd, _dt = _load_suite()

    class TestDistBackendWithSpawn(_dt.TestDistBackend, _dt.DistributedTest._DistTestBase):
        """Upstream's ``test_distributed_spawn.py`` class: a test spawns its ranks."""

        def setUp(self):
            super().setUp()
            self._spawn_processes()

        @classmethod
        def _run(cls, rank, test_name, file_name, pipe, **kwargs):
            logs = os.environ.get("FERROCCL_DT_CHILD_LOGS")
            if logs:
                path = os.path.join(logs, f"{test_name}.rank{rank}.log")
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                sys.stdout.flush()
                sys.stderr.flush()
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                os.close(fd)
            if not _shard_imports():
                # torch 1.13's torch.distributed._shard fails to import on Python 3.11
                # (a dataclass with a mutable default), and the suite turns on DDP's
                # ReplicatedTensor mode, which imports it: every DDP test would fail
                # on that. Run DDP in its ordinary mode instead.
                rt = importlib.import_module("torch.nn.parallel._replicated_tensor_ddp_utils")
                rt._set_ddp_with_replicated_tensor = lambda value: None
            super()._run(rank, test_name, file_name, pipe, **kwargs)


def _shard_imports() -> bool:
    """Whether ``torch.distributed._shard`` (DDP's ReplicatedTensor mode) imports."""
    try:
        importlib.import_module("torch.distributed._shard")
    except Exception:  # noqa: BLE001 - any failure to import
        return False
    return True


# -- the runner ---------------------------------------------------------------------

_CHILD_SPLIT = re.compile(r"Process (\d+) exited with error code \d+ and exception:\n")


def _exception_line(text: str) -> str:
    """The exception line of the last traceback in ``text`` (else its first line)."""
    lines = text.splitlines()
    start = 0
    for i, line in enumerate(lines):
        if line.startswith("Traceback (most recent call last):"):
            start = i + 1
    for line in lines[start:]:
        if line.strip() and not line.startswith((" ", "\t")):
            return line.strip()
    for line in lines:
        if line.strip():
            return line.strip()
    return "(no message)"


def first_error_line(text: str) -> str:
    """The first line of a failure's error: a rank's exception when a rank raised,
    else the exception the parent raised (a timeout, a mismatch of exit codes)."""
    parts = _CHILD_SPLIT.split(text)
    if len(parts) >= 3:
        return f"rank {parts[1]}: {_exception_line(parts[2])}"
    return _exception_line(text)


class _Result(unittest.TestResult):
    """Prints a line per test as it ends, and keeps what the summary needs."""

    def __init__(self, total: int, stream=None):
        super().__init__()
        self.total = total
        self.stream = stream or sys.stdout
        self.index = 0
        self.started = 0.0
        self.current = None
        self.passed = []
        self.failed = []  # (name, text)
        self.skips = []  # (name, reason)

    @staticmethod
    def name(test) -> str:
        return getattr(test, "_testMethodName", None) or test.id()

    def _line(self, test, status: str) -> None:
        secs = time.monotonic() - self.started
        self.stream.write(
            f"[{self.index}/{self.total}] {self.name(test)} ... {status} ({secs:.1f} s)\n"
        )
        self.stream.flush()

    def startTest(self, test):
        super().startTest(test)
        self.index += 1
        self.started = time.monotonic()
        self.current = test

    def addSuccess(self, test):
        super().addSuccess(test)
        self.passed.append(self.name(test))
        self._line(test, "ok")

    def _fail(self, test, err):
        text = self._exc_info_to_string(err, test)
        self.failed.append((self.name(test), text))
        self._line(test, "FAIL: " + first_error_line(text))

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._fail(test, err)

    def addError(self, test, err):
        super().addError(test, err)
        self._fail(test, err)

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self.skips.append((self.name(test), reason))
        self._line(test, f"skipped: {reason}")

    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err)
        self.passed.append(self.name(test))
        self._line(test, "ok (expected failure)")

    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test)
        self.failed.append((self.name(test), "unexpected success"))
        self._line(test, "FAIL: unexpected success")


def _summary(result: _Result, elapsed: float, tracebacks: bool, out=sys.stdout) -> None:
    w = out.write
    if tracebacks and result.failed:
        w("\n" + "=" * 78 + "\nFailures in full\n")
        for name, text in result.failed:
            w("=" * 78 + f"\n{name}\n" + "-" * 78 + f"\n{text}\n")
    w("\n" + "=" * 78 + "\n")
    w(
        f"{result.index} tests in {elapsed:.0f} s: {len(result.passed)} passed, "
        f"{len(result.failed)} failed, {len(result.skips)} skipped\n"
    )
    if result.skips:
        reasons = {}
        for _, reason in result.skips:
            reasons[reason] = reasons.get(reason, 0) + 1
        w("\nSkipped, by reason:\n")
        for reason, n in sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0])):
            w(f"  {n:4d}  {reason}\n")
    if result.failed:
        w("\nFailed:\n")
        for name, text in result.failed:
            w(f"  {name}: {first_error_line(text)}\n")
    out.flush()


def _all_names():
    loader = unittest.TestLoader()
    return list(loader.getTestCaseNames(TestDistBackendWithSpawn))


def _read_list(path: str):
    names = []
    with open(path) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line:
                names.append(line.rsplit(".", 1)[-1])
    return names


def _matches(name: str, patterns) -> bool:
    if not patterns:
        return True
    for p in patterns:
        if ("*" in p and fnmatch.fnmatchcase(name, p)) or ("*" not in p and p in name):
            return True
    return False


def _select(args):
    known = _all_names()
    if args.all:
        names = known
    else:
        names = _read_list(args.list) if args.list else list(CURATED)
        unknown = [n for n in names if n not in set(known)]
        if unknown:
            sys.exit(f"not tests of the suite: {', '.join(unknown)}")
    return [n for n in names if _matches(n, args.patterns)]


def _watchdog(result: _Result, limit: float, t0: float, tracebacks: bool):
    """A last resort: when a test's parent itself hangs past its timeout (the suite's
    own timeout should have failed it), end the run with what it has."""

    def watch():
        while True:
            time.sleep(5)
            if result.current is None or time.monotonic() - result.started < limit:
                continue
            sys.stdout.write(
                f"\nWATCHDOG: {result.name(result.current)} still running after "
                f"{limit:.0f} s; ending the run\n"
            )
            result.failed.append((result.name(result.current), "watchdog: hung"))
            _summary(result, time.monotonic() - t0, tracebacks)
            import multiprocessing

            for child in multiprocessing.active_children():
                child.kill()
            os._exit(3)

    threading.Thread(target=watch, daemon=True).start()


def main(args) -> int:
    names = _select(args)
    if args.names:
        print("\n".join(names))
        return 0
    if not names:
        sys.exit("no test selected")
    _cd.TIMEOUT_DEFAULT = args.timeout
    _cd.TIMEOUT_OVERRIDE.clear()
    suite = unittest.TestSuite(TestDistBackendWithSpawn(n) for n in names)
    print(
        f"{len(names)} tests, backend {BACKEND} "
        f"(features {', '.join([*FEATURES, *args.features])}), "
        f"world size {os.environ['WORLD_SIZE']}, "
        f"{args.timeout:g} s a test, torch {_dt.torch.__version__}",
        flush=True,
    )
    if not _shard_imports():
        print(
            "torch.distributed._shard does not import here: DDP runs without the "
            "suite's ReplicatedTensor mode",
            flush=True,
        )
    result = _Result(len(names))
    t0 = time.monotonic()
    _watchdog(result, args.timeout + 120, t0, args.tracebacks)
    try:
        suite.run(result)
    except KeyboardInterrupt:
        traceback.print_exc()
        print("interrupted", flush=True)
    result.current = None
    _summary(result, time.monotonic() - t0, args.tracebacks)
    return 1 if result.failed else 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
