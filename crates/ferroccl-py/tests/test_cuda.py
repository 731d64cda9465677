"""CUDA tensors in the torch backend, on a machine without a GPU: what can be checked
here. The typed errors where CUDA is missing (the extension, and the backend on 2
ranks), the checks of a call's devices by name, and how an operation on CUDA tensors
is ordered with torch's streams and kept from the caching allocator, with torch's CUDA
calls and the extension's device op replaced by recording stand-ins. What only a GPU
proves is ``tools/gpu-check torch`` (docs/book/src/python.md, "CUDA tensors")."""

import contextlib
import threading
import types

import ferroccl
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed")

import ferroccl._torchwork
import ranks
import torch.distributed as dist
from ferroccl import _native
from workers import FakeCuda


def no_gpu():
    return not torch.cuda.is_available()


def test_device_ops_without_cuda_are_typed_errors_never_a_crash():
    if not no_gpu():
        pytest.skip("this machine has a GPU")
    (c,) = _native.Communicator.local_group(1)
    with pytest.raises(ferroccl.UnsupportedError) as e:
        c.device_op(0, 0)
    if _native.has_cuda:
        assert "no CUDA driver (libcuda.so not found)" in str(e.value), e.value
    else:
        assert "no CUDA support" in str(e.value), e.value
    # The communicator is untouched by the refusal (nothing reached it).
    import numpy as np

    x = np.ones(3, dtype=np.float32)
    c.all_reduce((x.ctypes.data, 3, "float32"), "sum")
    c.close()


def test_the_backend_registers_for_cpu_and_cuda():
    import ferroccl.torch  # noqa: F401

    caps = getattr(dist.Backend, "backend_capability", None)
    if caps is None:
        pytest.skip("torch 1.x keeps no device capabilities")
    assert caps["ferroccl"] == ["cpu", "cuda"], caps


def test_a_calls_devices_are_checked_by_name():
    from ferroccl._torchcuda import CudaSide, device_of

    cpu = torch.zeros(2)
    assert device_of("x", [(cpu, "a"), (cpu, "b")]) is None
    assert device_of("x", [(FakeCuda(0), "a")]) == torch.device("cuda", 0)
    with pytest.raises(ferroccl.InvalidArgumentError, match="a is on cuda:0 but b on cpu"):
        device_of("allgather", [(FakeCuda(0), "a"), (cpu, "b")])
    with pytest.raises(ferroccl.InvalidArgumentError, match="a is on cuda:0 but b on cuda:1"):
        device_of("allgather", [(FakeCuda(0), "a"), (FakeCuda(1), "b")])
    with pytest.raises(ferroccl.UnsupportedError, match="b is a meta tensor"):
        device_of("x", [(cpu, "a"), (torch.empty(1, device="meta"), "b")])
    side = CudaSide(types.SimpleNamespace(), None, None)
    side.check("allreduce", torch.device("cuda", 0), "t")
    side.check("allreduce", torch.device("cuda", 0), "t")
    with pytest.raises(
        ferroccl.InvalidArgumentError, match="t is on cuda:1, but this rank's GPU in the group"
    ):
        side.check("allreduce", torch.device("cuda", 1), "t")
    bound = CudaSide(types.SimpleNamespace(bound_device_id=torch.device("cuda", 1)), None, None)
    with pytest.raises(ferroccl.InvalidArgumentError, match="is cuda:1"):
        bound.check("broadcast", torch.device("cuda", 0), "t")


def test_cuda_tensors_without_a_gpu_raise_typed_errors_on_every_rank():
    if not no_gpu():
        pytest.skip("this machine has a GPU")
    res = ranks.run(2, "cuda_without_a_gpu", timeout=120)
    for r, got in enumerate(res):
        kind, msg = got["allreduce"]
        assert kind == "UnsupportedError", (r, got)
        assert "CUDA" in msg, (r, got)
        assert got["mixed"][0] == "InvalidArgumentError", (r, got)
        assert "the input is on cuda:0 but output 0 on cpu" in got["mixed"][1], (r, got)
        assert got["other_gpu"][0] == "InvalidArgumentError", (r, got)
        assert "cuda:1" in got["other_gpu"][1] and "cuda:0" in got["other_gpu"][1], (r, got)
        assert got["meta"][0] == "UnsupportedError" and "meta" in got["meta"][1], (r, got)
        assert got["cpu_after"] == [2.0, 2.0, 2.0], (r, got)
        assert got["hosts"] == 1, (r, got)


# ---- the ordering, with torch's CUDA calls and the device op replaced ------------------

CALLER, OURS = 1234, 5678


class Stream:
    def __init__(self, ptr):
        self.cuda_stream = ptr


class Recorder:
    """What the backend asked of torch's CUDA and of the device op, in order."""

    def __init__(self):
        self.log = []
        self.current = CALLER
        self.lock = threading.Lock()

    def add(self, *what):
        with self.lock:
            self.log.append(what)


class DeviceOp:
    def __init__(self, rec, release_now):
        self.rec, self._release_now, self.stream = rec, release_now, OURS

    def wait_stream(self, s):
        self.rec.add("wait_stream", s)

    def after(self):
        self.rec.add("after", self.rec.current)

    def query(self):
        return self._release_now

    def release_now(self):
        self.rec.add("release_now")
        return self._release_now


class Ticket:
    def __init__(self):
        self.event = threading.Event()

    def done(self):
        return self.event.is_set()

    def wait(self, timeout=None):
        return self.event.wait(timeout)


class Native:
    """Stands for the extension's communicator: records the call and its device op;
    a queued one completes on another thread, as the worker's report does."""

    def __init__(self, rec, release_now, error=None):
        self.rec, self._release_now, self.error = rec, release_now, error

    def device_op(self, ordinal, stream):
        self.rec.add("device_op", ordinal, stream)
        return DeviceOp(self.rec, self._release_now)

    def all_reduce(self, buf, op, cb, d):
        self.rec.add("all_reduce", cb is None, d is not None)
        if cb is None:
            if self.error is not None:
                raise self.error
            return None
        t = Ticket()

        def report():
            cb(self.error)
            t.event.set()

        threading.Thread(target=report).start()
        return t


@pytest.fixture
def fake_cuda(monkeypatch):
    rec = Recorder()

    @contextlib.contextmanager
    def stream(s):
        before, rec.current = rec.current, s.cuda_stream
        try:
            yield
        finally:
            rec.current = before

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream(rec.current))
    monkeypatch.setattr(torch.cuda, "ExternalStream", lambda ptr, device=None: Stream(ptr))
    monkeypatch.setattr(torch.cuda, "stream", stream)
    # A CUDA future needs CUDA; its stream handling is torch's (the GPU check runs it).
    monkeypatch.setattr(ferroccl._torchwork, "_future", lambda devices: torch.futures.Future())
    return rec


def group(rec, release_now, error=None):
    from ferroccl.torch import ProcessGroupFerroccl

    (comm,) = ferroccl.Communicator.local_group(1)
    pg = ProcessGroupFerroccl(comm, 0, 1)
    pg._cuda._native = Native(rec, release_now, error)
    return pg


def opts(wait):
    return types.SimpleNamespace(reduceOp=dist.ReduceOp.SUM, asyncOp=not wait)


def test_a_blocking_call_runs_after_the_callers_stream_and_keeps_its_tensors(fake_cuda):
    rec = fake_cuda
    t = FakeCuda(0)
    w = group(rec, release_now=False).allreduce([t], opts(wait=True))
    assert rec.log[:2] == [("device_op", 0, CALLER), ("all_reduce", True, True)], rec.log
    # Ferroccl's stream may still have work on it: tied to that stream before release.
    assert ("record_stream", OURS) in t.log, t.log
    w.wait()
    assert rec.log[-1] == ("wait_stream", CALLER), rec.log


def test_a_queued_call_copies_back_on_ferroccls_stream_then_releases(fake_cuda):
    rec = fake_cuda
    t = FakeCuda(0, contiguous=False)  # copied in and out
    w = group(rec, release_now=False).allreduce([t], opts(wait=False))
    w.wait(timeout=None)
    assert w.is_completed() is False  # the device op says its work is not over
    i = rec.log.index(("after", CALLER))
    assert rec.log[0] == ("device_op", 0, CALLER), rec.log
    assert rec.log[1] == ("all_reduce", False, True), rec.log
    # The copy back ran on ferroccl's stream, before its end moved behind it ...
    assert t.log[0] == ("copy_", OURS), t.log
    assert i < rec.log.index(("release_now",)), rec.log
    # ... the tensor was tied to that stream before it was let go, and wait() made
    # the caller's stream wait for the end.
    assert ("record_stream", OURS) in t.log, t.log
    assert rec.log[-1] == ("wait_stream", CALLER), rec.log


def test_a_finished_call_releases_without_record_stream(fake_cuda):
    rec = fake_cuda
    t = FakeCuda(0)
    w = group(rec, release_now=True).allreduce([t], opts(wait=False))
    w.wait()
    assert w.is_completed()
    assert not any(e[0] == "record_stream" for e in t.log), t.log


def test_a_failed_call_keeps_its_tensors_from_the_allocator_and_raises(fake_cuda):
    rec = fake_cuda
    t = FakeCuda(0, contiguous=False)
    boom = ferroccl.PeerClosedError("rank 1 closed")
    w = group(rec, release_now=False, error=boom).allreduce([t], opts(wait=False))
    with pytest.raises(ferroccl.PeerClosedError):
        w.wait()
    assert ("copy_", OURS) not in t.log, "a failed call copied back"
    assert ("record_stream", OURS) in t.log, t.log
    with pytest.raises(ferroccl.PeerClosedError):
        group(rec, release_now=False, error=boom).allreduce([FakeCuda(0)], opts(wait=True))


# ---- the GPU check's own steps (tests/gpu.py) ------------------------------------------

CPU = {"FERROCCL_CHECK_DEVICE": "cpu"}
needs_gpu = pytest.mark.skipif(no_gpu(), reason="needs a GPU (tools/gpu-check torch)")


def test_the_gpu_checks_steps_rehearsed_on_cpu_tensors():
    """tools/gpu-check torch's steps on CPU tensors: the check itself works, so that a
    GPU run is spent on CUDA, not on the check."""
    assert ranks.run(2, "streams", 1, 2, module="gpu", env=CPU, timeout=120) == [0, 0]
    for r in ranks.run(2, "mismatch", module="gpu", env=CPU, timeout=120):
        assert r["type"] == "MismatchError" and "mismatched collective" in r["msg"], r
    for r in ranks.run(2, "hooks_and_groups", 3, module="gpu", env=CPU, timeout=180):
        for hook in ("none", "fp16"):
            ours, gloos = r[f"{hook}/ferroccl"], r[f"{hook}/gloo"]
            assert ours["digest"] == gloos["digest"], (hook, ours, gloos)
        assert r["group_sum"] == 3.0 and r["group_bcast"] == 1.0, r
    res = ranks.run(3, "killed", 15, module="gpu", env=CPU, allow_fail={2}, timeout=120)
    assert res[2] is None
    for r in res[:2]:
        assert r["type"] is not None and "rank 2" in r["msg"] and r["after"] < 25, r


def test_the_gpu_checks_ddp_step_rehearsed_on_cpu_tensors():
    pytest.importorskip("torchvision")
    res = ranks.run(2, "ddp_resnet", 3, 1, 2, 32, module="gpu", env=CPU, timeout=240)
    for b in ("ferroccl", "gloo"):
        assert res[0][b]["digest"] == res[1][b]["digest"], b
        assert res[0][b]["images_per_s"] > 0 and len(res[0][b]["losses"]) == 3
    assert res[0]["param_gap"] <= 1e-6, res[0]["param_gap"]


@needs_gpu
def test_every_collective_on_cuda_tensors_matches_its_definition():
    assert all(r > 0 for r in ranks.run(2, "collectives", "cuda", module="gpu", timeout=240))


@needs_gpu
def test_stream_order_on_a_gpu():
    assert ranks.run(2, "streams", module="gpu", timeout=240) == [0, 0]
