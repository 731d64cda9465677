#!/usr/bin/env python3
"""Upstream PyTorch's FSDP2 / DTensor / tensor-parallel test files against "ferroccl".

The PyPI wheel ships the test helpers (``torch.testing._internal.common_fsdp``,
``...distributed._tensor.common_dtensor``, ``common_distributed``) but not the test
files that use them. Fetch those from the pytorch/pytorch repository, at the commit
of the installed torch (``python -c 'import torch; print(torch.version.git_version)'``)
or a release tag, into a folder outside this repository (upstream code is not
committed here), e.g.:

    git clone --filter=blob:none --no-checkout https://github.com/pytorch/pytorch /tmp/pt
    git -C /tmp/pt checkout "$(python -c 'import torch; print(torch.version.git_version)')" \\
        -- test/distributed
    mkdir -p /tmp/upstream-tests && cp \\
        /tmp/pt/test/distributed/_composable/fsdp/test_fully_shard_*.py \\
        /tmp/pt/test/distributed/tensor/parallel/test_tp_*.py \\
        /tmp/pt/test/distributed/tensor/parallel/test_parallelize_api.py \\
        /tmp/pt/test/distributed/tensor/test_dtensor*.py \\
        /tmp/pt/test/distributed/tensor/test_redistribute.py \\
        /tmp/pt/test/distributed/tensor/test_device_mesh.py /tmp/upstream-tests/

Then, with the ``ferroccl`` package importable (installed, or staged on PYTHONPATH):

    tools/torch_upstream_test.py --tests /tmp/upstream-tests                # every test_*.py
    tools/torch_upstream_test.py --tests /tmp/upstream-tests test_tp_style.py -k colwise
    tools/torch_upstream_test.py --tests /tmp/upstream-tests 'test_fully_shard_*' --timeout 300
    tools/torch_upstream_test.py --tests /tmp/upstream-tests --backend gloo   # to compare

A test file written for a newer torch than the installed one may use what the
installed torch lacks: run it over gloo too, and compare.

How the files are made to use the backend: the test bases pick gloo for CPU
(``FSDPTest`` through ``common_fsdp.DISTRIBUTED_BACKEND``, ``DTensorTestBase.backend``,
which also refuses any backend it does not know). Before a test file is imported, in
the runner and in every rank it spawns, ``dist.init_process_group`` and
``dist.new_group`` are wrapped so that a backend of "gloo" (or "cpu:gloo" within a
device map, or none given) becomes ``--backend``. Each rank records the backend its
default group really has (``dist.get_backend()``) and the summary prints what the
ranks saw, so a run that silently fell back to gloo shows. Test files that
instantiate their class only for accelerators (``instantiate_device_type_tests``
with ``except_for=["cpu"]``) get a CPU class too (``--no-cpu-classes`` turns that
off). Only the classes that spawn ranks (``MultiProcessTestCase``: ``FSDPTest``,
``DTensorTestBase``) run by default: the multi-threaded ones (``FSDPTestMultiThread``,
the ``...WithLocalTensor`` classes) use torch's in-process fake groups and never
reach a backend (``--all-classes`` runs them too). Where no accelerator is present,
``FSDPTest`` runs on CPU (torch 2.15's own run skips every test there:
``_fsdp_on_cpu``).

Each test fails (instead of blocking) once its ranks have run ``--timeout`` seconds.
The end prints, per file and in all, the passed / failed / skipped counts, the skip
reasons and the first error line of each failure (``--tracebacks``: the full texts),
as ``torch_distributed_test.py`` does. The exit status is 0 when nothing failed.
"""

from __future__ import annotations

import argparse
import glob
import importlib
import os
import sys
import time
import traceback
import unittest

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


def _import_tdt():
    """``torch_distributed_test`` for its result printer; without ``BACKEND`` in
    the environment it imports no suite."""
    saved = os.environ.pop("BACKEND", None)
    try:
        return importlib.import_module("torch_distributed_test")
    finally:
        if saved is not None:
            os.environ["BACKEND"] = saved


tdt = _import_tdt()

DEFAULT_TIMEOUT = 120
_ENV_BACKEND = "FERROCCL_UP_BACKEND"
_ENV_TESTS = "FERROCCL_UP_TESTS"
_ENV_SEEN = "FERROCCL_UP_SEEN"
_ENV_CPU = "FERROCCL_UP_CPU_CLASSES"


def _parse_args(argv):
    p = argparse.ArgumentParser(
        description="Runs upstream PyTorch distributed test files against a backend."
    )
    p.add_argument("--tests", required=True, metavar="DIR", help="the upstream test files")
    p.add_argument(
        "files",
        nargs="*",
        metavar="FILE",
        help="test files in DIR, or fnmatch patterns of them (default test_*.py)",
    )
    tdt.add_run_flags(p, "Class.test_name", DEFAULT_TIMEOUT)
    p.add_argument(
        "--all-classes",
        action="store_true",
        help="also the classes that spawn no ranks (multi-threaded, local-tensor, plain)",
    )
    p.add_argument(
        "--no-cpu-classes",
        action="store_true",
        help="keep instantiate_device_type_tests' except_for=['cpu'] as it is",
    )
    args = p.parse_args(argv)
    tdt.check_run_flags(p, args)
    if not os.path.isdir(args.tests):
        p.error(f"--tests {args.tests}: not a folder")
    return args


# -- what every process does before a test file is imported -------------------------


def _swap(backend, target: str):
    """``backend`` with gloo replaced by ``target`` ("gloo", "cpu:gloo",
    "cpu:gloo,cuda:nccl" and no backend at all); others ("fake", "nccl") as they are."""
    if backend is None:
        return target
    if not isinstance(backend, str):
        return backend
    parts = []
    for part in backend.split(","):
        device, sep, name = part.rpartition(":")
        if name.strip().lower() == "gloo":
            part = f"{device}{sep}{target}"
        parts.append(part)
    return ",".join(parts)


def _record_backend(dist) -> None:
    path = os.environ.get(_ENV_SEEN)
    if not path:
        return
    try:
        seen = dist.get_backend()
    except Exception as e:  # noqa: BLE001 - reported, not raised
        seen = f"? ({type(e).__name__})"
    with open(path, "a") as f:
        f.write(f"{seen}\n")


def _patch(target: str) -> None:
    """Makes this process's process groups use ``target`` where tests ask for gloo."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    if target != "gloo":
        importlib.import_module(f"{target}.torch")  # registers the backend
    init_pg, new_group = c10d.init_process_group, c10d.new_group

    def init_process_group(*args, **kwargs):
        if args:
            args = (_swap(args[0], target), *args[1:])
        else:
            kwargs["backend"] = _swap(kwargs.get("backend"), target)
        out = init_pg(*args, **kwargs)
        _record_backend(dist)
        return out

    def wrapped_new_group(*args, **kwargs):
        if len(args) >= 3:
            args = (*args[:2], _swap(args[2], target), *args[3:])
        elif kwargs.get("backend") is not None:
            kwargs["backend"] = _swap(kwargs["backend"], target)
        return new_group(*args, **kwargs)

    init_process_group.__wrapped__ = init_pg
    wrapped_new_group.__wrapped__ = new_group
    for module in (dist, c10d):
        module.init_process_group = init_process_group
        module.new_group = wrapped_new_group

    if os.environ.get(_ENV_CPU) == "1":
        cdt = importlib.import_module("torch.testing._internal.common_device_type")
        instantiate = cdt.instantiate_device_type_tests

        def instantiate_with_cpu(generic_test_class, scope, except_for=None, **kwargs):
            if except_for:
                except_for = [d for d in except_for if d != "cpu"] or None
            return instantiate(generic_test_class, scope, except_for=except_for, **kwargs)

        cdt.instantiate_device_type_tests = instantiate_with_cpu


def _fsdp_on_cpu() -> None:
    """On a machine without accelerators, ``FSDPTest`` runs its tests on CPU: torch
    2.15's ``FSDPTest._run`` skips every test when there are fewer accelerator devices
    than ranks ("Need at least N accelerator devices"), CPU or not, where the run of
    its mixin (``FSDPTestMixin._run``, otherwise the same) checks that only on an
    accelerator. The mixin's run takes its place."""
    import torch

    accel = getattr(torch, "accelerator", None)
    if accel is None or accel.is_available():
        return
    cf = importlib.import_module("torch.testing._internal.common_fsdp")
    mixin = getattr(cf, "FSDPTestMixin", None)
    test = getattr(cf, "FSDPTest", None)
    if mixin is not None and test is not None and "_run" in vars(mixin) and "_run" in vars(test):
        test._run = vars(mixin)["_run"]


def _prepare_process() -> None:
    """Runs at import, in the runner and in each rank (spawned ranks import the
    runner again as ``__mp_main__`` before they unpickle their test class)."""
    tests = os.environ.get(_ENV_TESTS)
    if tests and tests not in sys.path:
        sys.path.insert(0, tests)
    # torch's common_utils parses sys.argv when imported: hide ours from it.
    argv, sys.argv = sys.argv, sys.argv[:1]
    try:
        importlib.import_module("torch.testing._internal.common_utils")
        _patch(os.environ[_ENV_BACKEND])
        _fsdp_on_cpu()
    finally:
        sys.argv = argv


if __name__ == "__main__":
    ARGS = _parse_args(sys.argv[1:])
    os.environ[_ENV_BACKEND] = ARGS.backend
    os.environ[_ENV_TESTS] = os.path.abspath(ARGS.tests)
    os.environ[_ENV_CPU] = "0" if ARGS.no_cpu_classes else "1"
    os.environ.setdefault("TEMP_DIR", os.environ.get("TMPDIR", "/tmp"))

if os.environ.get(_ENV_BACKEND):
    _prepare_process()


# -- the runner ---------------------------------------------------------------------


class _Result(tdt._Result):
    """``torch_distributed_test``'s result, naming tests ``Class.test``."""

    @staticmethod
    def name(test) -> str:
        method = getattr(test, "_testMethodName", None)
        return f"{type(test).__name__}.{method}" if method else test.id()


def _files(args):
    patterns = args.files or ["test_*.py"]
    found = []
    for pattern in patterns:
        pattern = os.path.basename(pattern)
        if not pattern.endswith(".py") and "*" not in pattern:
            pattern += ".py"
        hits = sorted(glob.glob(os.path.join(args.tests, pattern)))
        if not hits:
            sys.exit(f"no test file {pattern} in {args.tests}")
        found += [h for h in hits if h not in found]
    return found


def _load(path: str):
    """Imports a test file as a top-level module (spawned ranks import it by name)."""
    name = os.path.splitext(os.path.basename(path))[0]
    argv, sys.argv = sys.argv, sys.argv[:1]
    try:
        return importlib.import_module(name)
    finally:
        sys.argv = argv


def _spawns_ranks(cls) -> bool:
    cd = importlib.import_module("torch.testing._internal.common_distributed")
    if cls.__name__.endswith("WithLocalTensor"):
        return False
    if issubclass(cls, cd.MultiThreadedTestCase):
        return False
    return issubclass(cls, cd.MultiProcessTestCase)


def _tests(module, args):
    loader = unittest.TestLoader()
    out = []
    for value in vars(module).values():
        if not (isinstance(value, type) and issubclass(value, unittest.TestCase)):
            continue
        if value.__module__ != module.__name__:
            continue  # an imported base class
        if not args.all_classes and not _spawns_ranks(value):
            continue
        for method in loader.getTestCaseNames(value):
            if tdt._matches(f"{value.__name__}.{method}", args.patterns):
                out.append(value(method))
    return out


def _backends_seen(path: str) -> str:
    try:
        with open(path) as f:
            seen = [line.strip() for line in f if line.strip()]
    except FileNotFoundError:
        return "no process group was made"
    counts = {}
    for b in seen:
        counts[b] = counts.get(b, 0) + 1
    return ", ".join(f"{b} x{n}" for b, n in sorted(counts.items()))


def _run_file(path: str, args, totals: list) -> bool:
    base = os.path.basename(path)
    try:
        module = _load(path)
    except Exception:  # noqa: BLE001 - an import error is that file's result
        text = traceback.format_exc()
        print(f"\n##### {base}: does not import: {tdt.first_error_line(text)}", flush=True)
        totals.append((base, None, tdt.first_error_line(text)))
        return False
    tests = _tests(module, args)
    if args.names:
        print("\n".join(f"{base}::{_Result.name(t)}" for t in tests))
        return True
    seen = os.path.join(os.environ.get("TEMP_DIR", "/tmp"), f"ferroccl_up_seen.{os.getpid()}")
    if os.path.exists(seen):
        os.remove(seen)
    os.environ[_ENV_SEEN] = seen
    print(f"\n##### {base}: {len(tests)} tests, backend {args.backend}", flush=True)
    result = _Result(len(tests))
    t0 = time.monotonic()
    tdt._watchdog(result, args.timeout + 120, t0, args.tracebacks)
    try:
        unittest.TestSuite(tests).run(result)
    except KeyboardInterrupt:
        traceback.print_exc()
        print("interrupted", flush=True)
    result.current = None
    tdt._summary(result, time.monotonic() - t0, args.tracebacks)
    backends = _backends_seen(seen)
    print(f"Process groups the ranks made (dist.get_backend()): {backends}", flush=True)
    totals.append((base, result, backends))
    return not result.failed


def main(args) -> int:
    cd = importlib.import_module("torch.testing._internal.common_distributed")
    cd.TIMEOUT_DEFAULT = args.timeout
    cd.TIMEOUT_OVERRIDE.clear()
    torch = importlib.import_module("torch")
    print(
        f"backend {args.backend}, torch {torch.__version__} ({torch.version.git_version}), "
        f"{args.timeout:g} s a test, tests from {os.path.abspath(args.tests)}",
        flush=True,
    )
    ok = True
    totals = []
    for path in _files(args):
        ok = _run_file(path, args, totals) and ok
    if args.names:
        return 0
    print("\n" + "=" * 78 + f"\nIn all (backend {args.backend}):")
    for base, result, note in totals:
        if result is None:
            print(f"  {base}: does not import: {note}")
        else:
            print(
                f"  {base}: {len(result.passed)} passed, {len(result.failed)} failed, "
                f"{len(result.skips)} skipped (groups: {note})"
            )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(ARGS))
