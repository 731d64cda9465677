"""CUDA tensors in ``ferroccl.torch``'s backend: which device a call's tensors are on,
which communicator moves them, and how an operation on them is ordered with torch's
streams and kept from the caching allocator.

- **Devices.** A call's tensors are on one device: the CPU, or this rank's GPU in the
  group (the ``device_id`` the group was bound to, else the device of its first CUDA
  call). Mixed devices, another GPU, or a device type other than ``cpu`` and ``cuda``
  are typed errors naming the tensor and the device.
- **Transport.** ``FERROCCL_CUDA_TRANSPORT``: ``auto`` (the default) moves a group's
  CUDA tensors over CUDA IPC when all of its ranks are on one host (a communicator of
  its own, made at the group's first CUDA call on the group's store; several ranks per
  GPU are fine), and stages them through pinned host memory over the group's own
  links otherwise; ``cuda-ipc`` and ``staged`` force one.
- **Order** (ProcessGroupNCCL's model, ``ferroccl::order`` in the library): at issue a
  ``DeviceOp`` records an event on torch's current stream (cheap, on the caller's
  thread); the executor makes ferroccl's stream wait for it before touching the
  tensors, runs the collective and records its end on ferroccl's stream. Copies into
  outputs after it run on ferroccl's stream too (``after``). ``Work.wait()`` makes
  torch's current stream wait for the end. The transports are driven from the host, so
  the end is known once ferroccl's executor has run the operation: ``wait()`` blocks
  the host until then, then only queues a stream wait.
- **Lifetimes.** The tensors are held until the operation reported; when ferroccl's
  stream may still use them then (copies after the collective, or a failure that left
  work queued), each is tied to that stream (``record_stream``) before it is let go,
  so the caching allocator does not hand its memory out early.
"""

from __future__ import annotations

import os
import threading

import torch
import torch.distributed as dist

import ferroccl

from . import ConfigError, InvalidArgumentError, UnsupportedError
from ._torchmeet import _meet
from ._torchwork import _LIVE, _LOCK, Work, _caller_waits

TRANSPORTS = ("auto", "cuda-ipc", "staged")


def device_of(what: str, named) -> torch.device | None:
    """The one device of a call's tensors (``named``: ``(tensor, its name)`` pairs):
    None for the CPU; typed errors for mixed devices and device types ferroccl does
    not move."""
    first = None
    for t, name in named:
        dev = t.device
        if dev.type not in ("cpu", "cuda"):
            raise UnsupportedError(
                f"{what}: {name} is a {dev.type} tensor: the ferroccl backend moves CPU "
                "and CUDA tensors"
            )
        if first is None:
            first = (dev, name)
        elif dev != first[0]:
            raise InvalidArgumentError(
                f"{what}: {first[1]} is on {first[0]} but {name} on {dev}: the tensors "
                "of one call must be on one device"
            )
    if first is None or first[0].type == "cpu":
        return None
    return first[0]


def _tensors(xs):
    """The tensors in ``xs``, lists of lists included."""
    for x in xs:
        if isinstance(x, (list, tuple)):
            yield from _tensors(x)
        elif hasattr(x, "record_stream"):
            yield x


class CudaSide:
    """One group's CUDA side (module docs): its GPU, the communicator its CUDA tensors
    travel on, and ferroccl's stream as torch sees it."""

    def __init__(self, pg, store, timeout):
        self._pg = pg
        self._store = store
        self._timeout = timeout
        self.gpu: torch.device | None = None
        self.comm: ferroccl.Communicator | None = None
        self._native = None
        self._lock = threading.Lock()
        self._streams: dict = {}

    def check(self, what: str, dev: torch.device, name: str) -> None:
        """Refuses a tensor on a GPU other than this rank's in the group."""
        if self.gpu is None:
            bound = getattr(self._pg, "bound_device_id", None)
            self.gpu = bound if bound is not None and bound.type == "cuda" else dev
        if dev != self.gpu:
            raise InvalidArgumentError(
                f"{what}: {name} is on {dev}, but this rank's GPU in the group is "
                f"{self.gpu} (the device it was bound to, else that of its first CUDA "
                "call)"
            )

    def native(self):
        """The extension's communicator for this group's CUDA tensors (made at the
        first call: every rank makes its first CUDA call on a group at the same
        point)."""
        with self._lock:
            if self._native is None:
                self._native = self._make()
            return self._native

    def _make(self):
        choice = os.environ.get("FERROCCL_CUDA_TRANSPORT", "").strip() or "auto"
        if choice not in TRANSPORTS:
            raise ConfigError(
                f"FERROCCL_CUDA_TRANSPORT={choice!r}: expected one of {', '.join(TRANSPORTS)}"
            )
        pg = self._pg
        one_host = pg.comm.hosts == 1
        if choice == "staged" or pg.size() == 1 or (choice == "auto" and not one_host):
            return pg.comm.native
        if self._store is None:
            raise ConfigError("the group has no store to meet on for CUDA IPC")
        store = dist.PrefixStore("ferroccl-cuda/", self._store)
        self.comm = _meet(store, pg.rank(), pg.size(), self._timeout, transport="cuda-ipc")
        return self.comm.native

    def stream(self, d, dev: torch.device):
        """ferroccl's stream on ``dev`` as a torch stream."""
        s = self._streams.get(dev.index)
        if s is None:
            s = torch.cuda.ExternalStream(d.stream, device=dev)
            self._streams[dev.index] = s
        return s

    def release(self, tensors, d, dev: torch.device) -> None:
        """Before the tensors are let go: tied to ferroccl's stream when it may still
        use them (module docs)."""
        if d.release_now():
            return
        s = self.stream(d, dev)
        for t in _tensors(tensors):
            if t.is_cuda:
                t.record_stream(s)

    def _on_ours(self, then, d, dev: torch.device):
        """``then`` (copies into the outputs) queued on ferroccl's stream, after the
        collective; the operation's end moves behind it."""

        def run():
            with torch.cuda.stream(self.stream(d, dev)):
                then()
            d.after()

        return run

    def issue(self, what, result, keep, issue, then, opts, dev: torch.device) -> Work:
        """Issues an operation on CUDA tensors of ``dev``: ``issue(native, callback,
        device_op)`` hands it to the communicator (module docs)."""
        n = self.native()
        if not torch.cuda.is_available():
            raise UnsupportedError(
                f"{what}: a tensor on {dev}, but torch cannot use CUDA in this process "
                "(torch.cuda.is_available() is False)"
            )
        d = n.device_op(dev.index, torch.cuda.current_stream(dev).cuda_stream)
        if _caller_waits(opts):
            # Here and now: the native call makes torch's current stream wait for the
            # end before it returns; copies into the outputs follow on that stream.
            try:
                issue(n, None, d)
                if then is not None:
                    then()
            finally:
                self.release([keep, result], d, dev)
            return Work(result, cuda=(d, dev))
        op = ferroccl.Work(
            what,
            keep,
            None if then is None else self._on_ours(then, d, dev),
            release=lambda kept: self.release([kept, result], d, dev),
        )
        w = Work(result, op, cuda=(d, dev))
        try:
            op._ticket = issue(n, op._complete, d)
        except BaseException:
            with _LOCK:
                _LIVE.discard(w)
            raise
        return w
