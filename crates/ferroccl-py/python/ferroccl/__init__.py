"""ferroccl for Python: collective communication between processes (or threads).

    import ferroccl, numpy as np
    comm = ferroccl.Communicator.from_env()      # under torchrun, srun, mpirun, ferroccl launch
    x = np.ones(1 << 20, dtype=np.float32)
    comm.all_reduce(x)                           # in place, the same bits on every rank
    work = comm.all_reduce(x, op="max", async_op=True)
    work.wait()

Buffers are NumPy arrays and torch CPU tensors (contiguous; a torch tensor of any
supported dtype, bfloat16 included), written in place. Element types: float32, float64,
float16, bfloat16, int32, int64, uint8. Operations run on the communicator's worker
thread, in the order they were issued, with the GIL released; ``async_op=True`` returns a
:class:`Work` at once. Failures raise a :class:`FerrocclError` subclass carrying
ferroccl's message (which rank, which operation, what it expected and what arrived).

``import ferroccl.torch`` registers the torch.distributed backend ``"ferroccl"``.
"""

from __future__ import annotations

import atexit
from collections.abc import Sequence
from typing import Any

from . import _native
from ._native import (
    AbortedError,
    ConfigError,
    CudaError,
    FerrocclError,
    InvalidArgumentError,
    IoError,
    MismatchError,
    PeerClosedError,
    PeerFailedError,
    PoisonedError,
    ProtocolError,
    RendezvousError,
    TimeoutError,
    UnsupportedError,
    new_token,
)

__version__ = _native.__version__
__all__ = [
    "AbortedError",
    "Communicator",
    "ConfigError",
    "CudaError",
    "FerrocclError",
    "InvalidArgumentError",
    "IoError",
    "MismatchError",
    "PeerClosedError",
    "PeerFailedError",
    "PoisonedError",
    "ProtocolError",
    "RendezvousError",
    "TimeoutError",
    "UnsupportedError",
    "Work",
    "new_token",
]

# Every communicator's worker ends before the interpreter finalises.
atexit.register(_native.shutdown)

DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64", "uint8")
_OPS = ("sum", "prod", "min", "max", "avg")


# A NumPy dtype's name by its one-letter code, for the dtypes ferroccl has: asking
# ``dtype.name`` took 1.5 us, a third of a small blocking call's whole cost here.
_NP_NAMES: dict = {}


def buffer(obj: Any, what: str = "buffer") -> tuple:
    """``(address, elements, dtype)`` of a contiguous CPU buffer: a torch tensor or a
    NumPy array (anything else NumPy can view without a copy). The caller keeps ``obj``
    alive until the operation is over."""
    mod = type(obj).__module__
    if mod.startswith("torch"):
        if obj.device.type != "cpu":
            raise UnsupportedError(
                f"{what} is a {obj.device.type} tensor: ferroccl.Communicator moves CPU "
                "buffers (CUDA tensors go through the torch.distributed backend: import "
                "ferroccl.torch and use dist.* with backend 'ferroccl')"
            )
        if not obj.is_contiguous():
            raise InvalidArgumentError(f"{what} is not contiguous (call .contiguous())")
        dtype = str(obj.dtype).removeprefix("torch.")
        if dtype not in DTYPES:
            raise UnsupportedError(
                f"{what} has dtype {obj.dtype}, which ferroccl does not support "
                f"(it has {', '.join(DTYPES)})"
            )
        return (obj.data_ptr(), obj.numel(), dtype)
    import numpy as np

    arr = obj if isinstance(obj, np.ndarray) else np.asarray(memoryview(obj))
    if not arr.flags["C_CONTIGUOUS"]:
        raise InvalidArgumentError(f"{what} is not C-contiguous (use np.ascontiguousarray)")
    dt = arr.dtype
    if dt.byteorder not in "=|":
        raise UnsupportedError(
            f"{what} has dtype {dt}, in byte order {dt.byteorder!r}, not this machine's "
            "(use arr.astype(arr.dtype.newbyteorder('=')))"
        )
    name = _NP_NAMES.get(dt.char)
    if name is None:
        name = dt.name
        if name in DTYPES:
            _NP_NAMES[dt.char] = name
    if name not in DTYPES:
        raise UnsupportedError(
            f"{what} has dtype {arr.dtype}, which ferroccl does not support "
            f"(it has {', '.join(DTYPES)})"
        )
    return (arr.__array_interface__["data"][0], arr.size, name)


def _writable(obj: Any, what: str) -> tuple:
    b = buffer(obj, what)
    flags = getattr(obj, "flags", None)
    if flags is not None and not flags["WRITEABLE"]:
        raise InvalidArgumentError(f"{what} is read-only")
    return b


def _op(op: str) -> str:
    o = str(op).lower()
    o = {"product": "prod", "mean": "avg"}.get(o, o)
    if o not in _OPS:
        raise UnsupportedError(f"ferroccl has no reduction {op!r} (it has {', '.join(_OPS)})")
    return o


class Work:
    """A non-blocking operation in flight: the one object for it on the Python side
    (``ferroccl.torch`` wraps it in torch's ``Work``). Holds its buffers until it is
    over; ``then`` runs when it succeeded (a copy back, say), ``release(buffers)``
    just before it lets go of its buffers (the torch backend ties CUDA tensors to
    ferroccl's stream there when that stream may still use them), ``on_done`` once it
    is over either way."""

    def __init__(self, what: str, keep: Sequence[Any] = (), then=None, on_done=None, release=None):
        self._what = what
        self._keep = keep
        self._then = then
        self._on_done = on_done
        self._release = release
        self._error: BaseException | None = None
        self._ticket = None

    # Called once, under the GIL, by a thread of the communicator's (or the caller's,
    # when it ran the operation itself); the ticket says "done" once this returned.
    def _complete(self, error: BaseException | None) -> None:
        # What the callbacks hold (temporaries of copies back) goes with them.
        then, self._then = self._then, None
        if error is None and then is not None:
            try:
                then()
            except BaseException as e:  # noqa: BLE001 - reported on wait()
                error = e
        self._error = error
        release, self._release = self._release, None
        if release is not None:
            try:
                release(self._keep)
            except BaseException as e:  # noqa: BLE001 - reported on wait()
                self._error = self._error or e
        self._keep = ()
        if self._on_done is not None:
            self._on_done()

    def is_completed(self) -> bool:
        """True once the operation is over (successfully or not)."""
        return self._ticket is not None and self._ticket.done()

    def exception(self) -> BaseException | None:
        """The operation's error, once it failed; else None."""
        return self._error

    def wait(self, timeout: float | None = None) -> None:
        """Blocks until the operation is over (at most ``timeout`` seconds: then
        :class:`TimeoutError`, and the operation goes on); raises its error."""
        # Without a timeout, this thread runs the operations queued before this one
        # itself rather than sleep while the worker wakes (see _native.Ticket.wait).
        if not self._ticket.wait(timeout):
            raise TimeoutError(f"{self._what} was not done after {timeout} s")
        if self._error is not None:
            raise self._error


def _run(issue, what: str, keep: Sequence[Any], async_op: bool, then=None):
    """Issues an operation: blocking, or returning a Work."""
    if not async_op:
        issue(None)
        if then is not None:
            then()
        return None
    w = Work(what, keep, then)
    w._ticket = issue(w._complete)
    return w


class Communicator:
    """A group of ranks running collectives together (ferroccl's ``Communicator``)."""

    def __init__(self, native: _native.Communicator):
        self._c = native

    @staticmethod
    def from_env() -> Communicator:
        """Joins the job the launcher describes (torchrun, Slurm, mpirun, ``ferroccl
        launch``); ``FERROCCL_*`` variables tune it."""
        return Communicator(_native.Communicator.from_env())

    @staticmethod
    def local_group(world_size: int) -> list[Communicator]:
        """``world_size`` communicators linked in-process, for ranks run as threads."""
        return [Communicator(c) for c in _native.Communicator.local_group(world_size)]

    @staticmethod
    def on_store(
        store,
        rank: int,
        world_size: int,
        advertise: str,
        *,
        token=None,
        job_id: str = "python",
        timeout: float | None = None,
        local_rank: int | None = None,
        transport: str | None = None,
    ) -> Communicator:
        """Rank ``rank`` of ``world_size`` meeting on a key-value ``store`` (a
        ``torch.distributed.Store``): rank 0 serves ferroccl's store and publishes
        ``advertise:port`` there. ``token`` and ``job_id`` must match on every rank.
        ``transport`` (``"cuda-ipc"``, ...) overrides ``FERROCCL_TRANSPORT``."""
        return Communicator(
            _native.Communicator.on_store(
                store,
                rank,
                world_size,
                advertise,
                token or "",
                job_id,
                timeout,
                local_rank,
                transport,
            )
        )

    @property
    def native(self) -> _native.Communicator:
        """The extension's communicator under this one: it takes buffers as
        ``(address, elements, dtype)`` and reports through callbacks (see
        ``_native.pyi``), for framework backends that describe their tensors
        themselves (``ferroccl.torch``)."""
        return self._c

    rank = property(lambda self: self._c.rank)
    world_size = property(lambda self: self._c.world_size)
    local_rank = property(lambda self: self._c.local_rank)
    id = property(lambda self: self._c.id)
    job_ranks = property(lambda self: self._c.job_ranks)
    transport = property(lambda self: self._c.transport)
    hosts = property(lambda self: self._c.hosts)

    def __repr__(self) -> str:
        return (
            f"<ferroccl.Communicator rank {self.rank} of {self.world_size}, id {self.id:#x}, "
            f"{self.transport}>"
        )

    def abort(self) -> None:
        """Fails every operation in flight with :class:`AbortedError` (any thread)."""
        self._c.abort()

    def close(self) -> None:
        """Finishes the operations issued, then drops the communicator."""
        self._c.close()

    def poisoned(self) -> str | None:
        """The first failure's text once the communicator failed; else None."""
        return self._c.poisoned()

    def dump_trace(self, directory: str) -> str:
        """Writes the flight recorder under ``directory``; returns the file."""
        return self._c.dump_trace(str(directory))

    # Collectives. Each writes its output in place and returns None, or a Work with
    # async_op=True.

    def all_reduce(self, buf, op: str = "sum", async_op: bool = False):
        b = _writable(buf, "buf")
        return _run(lambda cb: self._c.all_reduce(b, _op(op), cb), "all_reduce", [buf], async_op)

    def broadcast(self, buf, root: int = 0, async_op: bool = False):
        b = _writable(buf, "buf")
        return _run(lambda cb: self._c.broadcast(b, root, cb), "broadcast", [buf], async_op)

    def reduce(self, buf, op: str = "sum", root: int = 0, async_op: bool = False):
        b = _writable(buf, "buf")
        return _run(lambda cb: self._c.reduce(b, _op(op), root, cb), "reduce", [buf], async_op)

    def all_gather(self, send, recv, async_op: bool = False):
        s, r = buffer(send, "send"), _writable(recv, "recv")
        return _run(
            lambda cb: self._c.all_gather(s, r, cb),
            "all_gather",
            [send, recv],
            async_op,
        )

    def reduce_scatter(self, send, recv, op: str = "sum", async_op: bool = False):
        s, r = buffer(send, "send"), _writable(recv, "recv")
        return _run(
            lambda cb: self._c.reduce_scatter(s, r, _op(op), cb),
            "reduce_scatter",
            [send, recv],
            async_op,
        )

    def all_to_all(self, send, recv, send_counts=None, recv_counts=None, async_op: bool = False):
        s, r = buffer(send, "send"), _writable(recv, "recv")
        sc = None if send_counts is None else [int(x) for x in send_counts]
        rc = None if recv_counts is None else [int(x) for x in recv_counts]
        return _run(
            lambda cb: self._c.all_to_all(s, r, sc, rc, cb),
            "all_to_all",
            [send, recv],
            async_op,
        )

    def gather(self, send, recv=None, root: int = 0, async_op: bool = False):
        s = buffer(send, "send")
        r = _writable(recv, "recv") if recv is not None else (0, 0, s[2])
        return _run(lambda cb: self._c.gather(s, r, root, cb), "gather", [send, recv], async_op)

    def scatter(self, send, recv, root: int = 0, async_op: bool = False):
        r = _writable(recv, "recv")
        s = buffer(send, "send") if send is not None else (0, 0, r[2])
        return _run(
            lambda cb: self._c.scatter(s, r, root, cb),
            "scatter",
            [send, recv],
            async_op,
        )

    def barrier(self, async_op: bool = False):
        return _run(lambda cb: self._c.barrier(cb), "barrier", [], async_op)

    def send(self, buf, peer: int, tag: int = 0, async_op: bool = False):
        b = buffer(buf, "buf")
        return _run(lambda cb: self._c.send(b, peer, tag, cb), "send", [buf], async_op)

    def recv(self, buf, peer: int, tag: int = 0, async_op: bool = False):
        b = _writable(buf, "buf")
        return _run(lambda cb: self._c.recv(b, peer, tag, cb), "recv", [buf], async_op)

    # Sub-communicators.

    def split(self, color: int | None, key: int = 0) -> Communicator | None:
        """MPI's ``comm_split``: ranks passing the same color form a child, ranked by
        ``(key, rank)``; ``None`` joins none and gets None. Collective."""
        c = self._c.split(color, key)
        return None if c is None else Communicator(c)

    def group(self, ranks: Sequence[int]) -> Communicator | None:
        """The child of ``ranks`` in that order (None elsewhere). Collective: every
        rank passes the same list, or every rank raises :class:`MismatchError`."""
        c = self._c.group(list(ranks))
        return None if c is None else Communicator(c)

    def group_of_members(self, ranks: Sequence[int], nonce: int = 0) -> Communicator:
        """The child of ``ranks``, made by its members alone (same list and nonce)."""
        return Communicator(self._c.group_of_members(list(ranks), nonce))

    def split_by_host(self) -> Communicator:
        """The child of this host's ranks. Collective."""
        return Communicator(self._c.split_by_host())
