"""The torch.distributed backend ``"ferroccl"`` (CPU tensors).

    import ferroccl.torch  # registers the backend
    dist.init_process_group("ferroccl")       # env:// (torchrun), tcp://, file://

Operations run on the communicator's worker thread in issue order and complete a
``torch.futures.Future`` (so DDP and its communication hooks overlap them with the
backward pass, and a hook's callback may itself issue collectives and wait for them);
``Work.wait()`` raises ferroccl's typed errors (``ferroccl.MismatchError``,
``ferroccl.PeerFailedError``, ...) with ferroccl's message. A future handed to torch
fails with a real error, which torch's C++ side (DDP's reducer) raises as a
``RuntimeError`` carrying ferroccl's class name and message. Contiguous tensors are
used in place; others are copied in and out. ``new_group`` (and ``DeviceMesh``) makes
a child of the default group's communicator through its links (no new store or
listener) when the default group is ferroccl's, and meets on the group's store
otherwise; the members check on the group's store that they agree on who is in it.

The backend is a ``torch.distributed.Backend`` under torch's own ``ProcessGroup``
where torch lets Python implement one (its ``PyBackend``); on older torch it is the
``ProcessGroup`` itself (with, on torch 2.x, a placeholder backend for the CPU so that
``group_name`` and ``_device_types`` are set). ``communicator(group)`` gives the
ferroccl :class:`~ferroccl.Communicator` of a group either way.

The ranks meet on the store torch hands the backend: rank 0 serves ferroccl's own store
on a free port and publishes its address, a fresh job token and the job's identity
there. The address published is ``FERROCCL_ADVERTISE_ADDR``, else ``MASTER_ADDR``, else
this host's name (set ``FERROCCL_ADVERTISE_ADDR`` on rank 0 when other hosts cannot
reach it by either). GPU tensors are refused: use NCCL for them.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import socket
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import ferroccl

from . import Communicator, InvalidArgumentError, MismatchError, UnsupportedError
from . import TimeoutError as FerrocclTimeout
from . import buffer as _buffer

BACKEND = "ferroccl"

_C10D = torch._C._distributed_c10d
_WorkBase = getattr(dist, "_Work", None) or dist.Work

# Works are Python objects that C++ (DDP's reducer, `_broadcast_coalesced`) holds by a
# C++ reference only: if the Python object were collected, C++ would fall back to the
# base class's wait, which never returns. Hold every Work until it is over, and the
# latest completed ones a while longer (C++ waits on them right after they return).
_LIVE: set = set()
_RECENT: collections.deque = collections.deque(maxlen=4096)
_LOCK = threading.Lock()


class Work(_WorkBase):
    """torch's ``Work`` for one ferroccl operation: a :class:`ferroccl.Work` (``op``)
    seen through torch's interface. In the background, held in ``_LIVE`` until over;
    run on the caller's thread (``op`` None), over before it is returned.

    When ``op`` is over it settles the *gate*, a Python future that only says "over".
    The future handed out, to DDP's reducer and to hooks, is ``gate.then(settle)``: it
    holds the tensors, or a real C++ error with ferroccl's class and message. (A future
    completed with ``Future.set_exception`` holds the exception as a *value* that only
    Python unwraps: DDP's reducer reads it as tensors, and crashes.)"""

    _op: ferroccl.Work | None = None
    _gate = None
    _fut = None

    def __init__(self, result: list[torch.Tensor], op: ferroccl.Work | None = None):
        super().__init__()
        self._result = result
        if op is not None:
            self._op = op
            self._gate = torch.futures.Future()
            op._on_done = self._over
            with _LOCK:
                _LIVE.add(self)

    def _over(self) -> None:
        with _LOCK:
            _LIVE.discard(self)
            _RECENT.append(self)
        self._gate.set_result(None)

    def _settle(self, _gate):
        e = self.exception()
        if e is not None:
            raise e.with_traceback(None)
        return self._result

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self._op is not None:
            secs = None
            if timeout is not None:
                secs = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
                if secs <= 0:
                    secs = None  # torch's kNoTimeout
            self._op.wait(secs)
        return True

    def is_completed(self) -> bool:
        return self._op is None or self._op.is_completed()

    def is_success(self) -> bool:
        return self.is_completed() and self.exception() is None

    def exception(self):
        return None if self._op is None else self._op.exception()

    def get_future(self):
        with _LOCK:
            if self._fut is None:
                if self._gate is None:  # ran on the caller's thread: over already
                    self._gate = torch.futures.Future()
                    self._gate.set_result(None)
                self._fut = self._gate.then(self._settle)
            return self._fut

    def result(self):
        self.wait()
        return self._result

    def synchronize(self) -> None:
        pass

    def source_rank(self) -> int:
        raise UnsupportedError("ferroccl has no receive from any source")


# The tag of monitored_barrier's messages (torch's own tags are small).
_MONITOR_TAG = 0xFFFF_FF00
_C10D_MODULE = "torch.distributed.distributed_c10d"


def _caller_waits(opts) -> bool:
    """Whether the operation's caller waits for it at once: torch 2.x says so in
    ``opts.asyncOp``; in 1.13, a ``torch.distributed`` function called with
    ``async_op=False`` (its next step is ``work.wait()``). Anything else (DDP's
    reducer, a caller that asked for async) runs in the background."""
    flag = getattr(opts, "asyncOp", None)
    if flag is not None:
        return not flag
    f = sys._getframe(2)
    while f is not None and f.f_globals.get("__name__") == __name__:
        f = f.f_back
    if f is None or f.f_globals.get("__name__") != _C10D_MODULE:
        return False
    # send and recv wait for their work; isend and irecv do not.
    return f.f_locals.get("async_op") is False or f.f_code.co_name in ("send", "recv")


# RedOpType's value -> ferroccl's name (a fast path; _op_name compares otherwise).
_OP_NAMES = {}
_KINDS = getattr(dist.ReduceOp, "RedOpType", None)
for _k, _v in (
    ("SUM", "sum"),
    ("PRODUCT", "prod"),
    ("MIN", "min"),
    ("MAX", "max"),
    ("AVG", "avg"),
):
    if _KINDS is not None and hasattr(_KINDS, _k):
        _OP_NAMES[getattr(_KINDS, _k).value] = _v


def _op_name(op) -> str:
    """ferroccl's name for a torch ``ReduceOp``."""
    kind = getattr(op, "op", op)  # a ReduceOp wraps its RedOpType in .op
    name = _OP_NAMES.get(getattr(kind, "value", None))
    if name is not None:
        return name
    R = dist.ReduceOp
    table = [(R.SUM, "sum"), (R.PRODUCT, "prod"), (R.MIN, "min"), (R.MAX, "max")]
    if hasattr(R, "AVG"):
        table.append((R.AVG, "avg"))
    for theirs, ours in table:
        if op == theirs:
            return ours
    name = next(
        (k for k in ("BAND", "BOR", "BXOR", "PREMUL_SUM") if hasattr(R, k) and op == getattr(R, k)),
        str(op),
    )
    raise UnsupportedError(
        f"ferroccl has no reduction ReduceOp.{name} (it has SUM, PRODUCT, MIN, MAX and AVG)"
    )


def _io(t: torch.Tensor, what: str):
    """A contiguous CPU tensor for ``t``: itself, or a copy to copy back."""
    if not t.is_cpu:
        raise UnsupportedError(
            f"{what} is a {t.device.type} tensor: the ferroccl backend moves CPU tensors "
            "only (use nccl for GPU tensors)"
        )
    if t.is_contiguous():
        return t, None
    c = t.contiguous()
    return c, (lambda: t.copy_(c))


# The 1-byte dtypes ferroccl has no arithmetic for: operations that only move data
# (broadcast, gathers, scatter, all-to-all, send/recv) carry them as their bytes.
_AS_BYTES = (torch.int8, torch.bool)


_NAMES = {
    torch.float32: "float32",
    torch.float64: "float64",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.uint8: "uint8",
}


def _raw(t: torch.Tensor):
    """ferroccl's ``(address, elements, dtype)`` of ``t``: at once for a contiguous CPU
    tensor of a supported dtype (the hot path), else through ``ferroccl.buffer``,
    which raises the typed error naming what is wrong."""
    name = _NAMES.get(t.dtype)
    if name is None or not t.is_cpu or not t.is_contiguous():
        return _buffer(t)
    return (t.data_ptr(), t.numel(), name)


def _data(t: torch.Tensor):
    """ferroccl's buffer for ``t`` in an operation without arithmetic: an int8 or bool
    tensor as its bytes (uint8). Reductions keep ``_raw``, which refuses them."""
    return _raw(t.view(torch.uint8) if t.dtype in _AS_BYTES else t)


def _flat(tensors: list[torch.Tensor], what: str) -> torch.Tensor:
    if not tensors:
        return torch.empty(0)
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1:
        raise InvalidArgumentError(f"{what}: tensors of several dtypes {sorted(map(str, dtypes))}")
    return torch.cat([t.reshape(-1) for t in tensors])


def _unflat(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    o = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[o : o + n].view_as(t))
        o += n


def _one(tensors, what: str) -> torch.Tensor:
    if len(tensors) != 1:
        raise InvalidArgumentError(
            f"{what}: the ferroccl backend takes one tensor per rank, not {len(tensors)}"
        )
    return tensors[0]


def _chain(*fs):
    fs = [f for f in fs if f is not None]
    if not fs:
        return None

    def run():
        for f in fs:
            f()

    return run


def _python_backends() -> bool:
    """Whether this torch calls a Python subclass of its c10d ``Backend`` (the
    ``PyBackend`` trampoline of recent torch 2.x): asked of a throw-away group."""
    base = getattr(_C10D, "Backend", None)
    if base is None:
        return False
    seen = []

    class Probe(base):
        def allreduce(self, tensors, opts=None):
            seen.append(True)
            f = torch.futures.Future()
            f.set_result(tensors)
            return _C10D._create_work_from_future(f)

        def getBackendName(self):
            return "probe"

    try:
        kind = dist.ProcessGroup.BackendType.CUSTOM
        pg = dist.ProcessGroup(dist.HashStore(), 0, 1)
        pg._set_default_backend(kind)
        pg._register_backend(torch.device("cpu"), kind, Probe(0, 1))
        pg.allreduce([torch.zeros(1)]).wait()
    except Exception:  # noqa: BLE001 - any failure means "no"
        return False
    return bool(seen)


# What the backend is: a c10d Backend under torch's ProcessGroup where torch calls
# Python ones; otherwise the ProcessGroup itself (torch 1.13 has nothing else).
_AS_BACKEND = _python_backends()
_Base = _C10D.Backend if _AS_BACKEND else dist.ProcessGroup


def _placeholder(rank: int, size: int):
    """A backend that only holds what torch 2.x keeps in backends (the group's name,
    its devices): torch's fake backend, told to raise on any collective, so that a
    call that reaches it instead of this group's methods fails rather than pretends."""
    opts = _C10D.FakeProcessGroup.Options()
    opts.error_on_collective = True
    return _C10D.FakeProcessGroup._create_internal(rank, size, opts)


class ProcessGroupFerroccl(_Base):
    """torch.distributed's backend over a ferroccl communicator (``comm``)."""

    def __init__(self, comm: Communicator, rank: int, size: int):
        super().__init__(rank, size)
        self.comm = comm
        self._n = comm.native
        if not _AS_BACKEND and hasattr(self, "_register_backend"):
            # torch 2.x keeps a group's name and device types in its backends: give
            # this group a placeholder for the CPU (every call reaches the methods
            # below, which this group overrides).
            kind = dist.ProcessGroup.BackendType.CUSTOM
            self._set_default_backend(kind)
            self._register_backend(torch.device("cpu"), kind, _placeholder(rank, size))

    # -- names ----------------------------------------------------------------------

    def getBackendName(self) -> str:
        return BACKEND

    def _get_backend_name(self) -> str:
        return BACKEND

    def name(self) -> str:
        return BACKEND

    # torch 2.x asks for the backend of a device (to learn, for example, whether it
    # coalesces point-to-point): as the group itself, this group is its own backend.
    supports_coalescing = False
    supports_splitting = False

    if not _AS_BACKEND:

        def _get_backend(self, device=None):
            return self

    # -- plumbing -------------------------------------------------------------------

    def _issue(self, what, result, keep, issue, then=None, opts=None) -> Work:
        if _caller_waits(opts):
            # Run here and now (the queue before it first), sparing the worker's
            # wake-up: the caller would only wait for it. Errors raise from here.
            issue(None)
            if then is not None:
                then()
            return Work(result)
        op = ferroccl.Work(what, keep, then)
        w = Work(result, op)
        try:
            op._ticket = issue(op._complete)
        except BaseException:
            with _LOCK:
                _LIVE.discard(w)
            raise
        return w

    # -- collectives ----------------------------------------------------------------

    def allreduce(self, tensors, opts=None):
        t = _one(tensors, "allreduce")
        op = _op_name(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        c, back = _io(t, "allreduce's tensor")
        b = _raw(c)
        return self._issue(
            "allreduce",
            tensors,
            [c],
            lambda cb: self._n.all_reduce(b, op, cb),
            back,
            opts=opts,
        )

    def allreduce_coalesced(self, tensors, opts=None):
        op = _op_name(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        flat = _flat(tensors, "allreduce_coalesced")
        b = _raw(flat)
        return self._issue(
            "allreduce_coalesced",
            tensors,
            [flat],
            lambda cb: self._n.all_reduce(b, op, cb),
            lambda: _unflat(flat, tensors),
            opts=opts,
        )

    def broadcast(self, tensors, opts=None):
        t = _one(tensors, "broadcast")
        root = opts.rootRank if opts is not None else 0
        c, back = _io(t, "broadcast's tensor")
        b = _data(c)
        return self._issue(
            "broadcast",
            tensors,
            [c],
            lambda cb: self._n.broadcast(b, root, cb),
            back,
            opts=opts,
        )

    def reduce(self, tensors, opts=None):
        t = _one(tensors, "reduce")
        root = opts.rootRank if opts is not None else 0
        op = _op_name(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        c, back = _io(t, "reduce's tensor")
        b = _raw(c)
        return self._issue(
            "reduce",
            tensors,
            [c],
            lambda cb: self._n.reduce(b, op, root, cb),
            back,
            opts=opts,
        )

    def allgather(self, output_tensors, input_tensors, opts=None):
        inp = _one(input_tensors, "allgather").contiguous()
        outs = _one(output_tensors, "allgather")
        n = self.size()
        if len(outs) != n or any(o.numel() != inp.numel() for o in outs):
            raise InvalidArgumentError(
                f"allgather: {len(outs)} outputs for {n} ranks, each of the input's "
                f"{inp.numel()} elements"
            )
        if any(o.dtype != inp.dtype for o in outs):
            raise InvalidArgumentError("allgather: outputs and input differ in dtype")
        flat = torch.empty(n * inp.numel(), dtype=inp.dtype)
        s, r = _data(inp), _data(flat)
        return self._issue(
            "allgather",
            output_tensors,
            [inp, flat],
            lambda cb: self._n.all_gather(s, r, cb),
            lambda: _unflat(flat, outs),
            opts=opts,
        )

    def _allgather_base(self, output, input, opts=None):
        if output.numel() != self.size() * input.numel():
            raise InvalidArgumentError(
                f"all_gather_into_tensor: output has {output.numel()} elements, not "
                f"{self.size()} × {input.numel()}"
            )
        inp = input.contiguous()
        c, back = _io(output, "all_gather_into_tensor's output")
        s, r = _data(inp), _data(c)
        return self._issue(
            "allgather_into_tensor",
            [output],
            [inp, c],
            lambda cb: self._n.all_gather(s, r, cb),
            back,
            opts=opts,
        )

    def all_gather_single_coalesced(self, outputs, inputs, opts=None, after=None):
        """``outputs[i]`` (world_size × ``inputs[i]``) gathers every rank's
        ``inputs[i]``: one all-gather of the inputs end to end (then ``after()``)."""
        n = self.size()
        if len(outputs) != len(inputs) or any(
            o.numel() != n * i.numel() for o, i in zip(outputs, inputs)
        ):
            raise InvalidArgumentError(
                "all_gather_into_tensor (coalesced): each output must hold world_size "
                "times its input"
            )
        send = _flat(list(inputs), "all_gather_into_tensor (coalesced)")
        recv = torch.empty(n * send.numel(), dtype=send.dtype)
        sizes = [i.numel() for i in inputs]

        def then():
            blocks = recv.view(n, -1).split(sizes, dim=1)
            for o, b in zip(outputs, blocks):
                o.copy_(b.reshape(o.shape))
            if after is not None:
                after()

        s, r = _data(send), _data(recv)
        return self._issue(
            "all_gather_into_tensor_coalesced",
            list(outputs),
            [send, recv],
            lambda cb: self._n.all_gather(s, r, cb),
            then,
            opts=opts,
        )

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        """``outputs[i]`` receives this rank's block of the reduction of every rank's
        ``inputs[i]`` (world_size × ``outputs[i]``): one reduce-scatter."""
        n = self.size()
        if len(outputs) != len(inputs) or any(
            i.numel() != n * o.numel() for o, i in zip(outputs, inputs)
        ):
            raise InvalidArgumentError(
                "reduce_scatter_tensor (coalesced): each input must hold world_size times "
                "its output"
            )
        op = _op_name(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        # Rank q's block of the send buffer is every input's block q, in order.
        send = torch.cat([i.reshape(n, -1) for i in inputs], dim=1).reshape(-1)
        recv = torch.empty(send.numel() // n, dtype=send.dtype)
        sizes = [o.numel() for o in outputs]

        def then():
            for o, b in zip(outputs, recv.split(sizes)):
                o.copy_(b.reshape(o.shape))

        s, r = _raw(send), _raw(recv)
        return self._issue(
            "reduce_scatter_tensor_coalesced",
            list(outputs),
            [send, recv],
            lambda cb: self._n.reduce_scatter(s, r, op, cb),
            then,
            opts=opts,
        )

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # torch 2.x's names for the single-tensor forms.

    def all_gather_single(self, output, input, opts=None):
        return self._allgather_base(output, input, opts)

    def reduce_scatter_single(self, output, input, opts=None):
        return self._reduce_scatter_base(output, input, opts)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        return self.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts)

    def gather_single(self, output, input, opts=None):
        """The root's ``output`` (world_size × ``input``) gathers every rank's input."""
        root = opts.rootRank if opts is not None else 0
        inp = input.contiguous()
        if self.rank() == root:
            if output.numel() != self.size() * inp.numel():
                raise InvalidArgumentError(
                    f"gather: the root's output has {output.numel()} elements, not "
                    f"{self.size()} × {inp.numel()}"
                )
            c, back = _io(output, "gather's output")
        else:
            c, back = torch.empty(0, dtype=inp.dtype), None
        s, r = _data(inp), _data(c)
        return self._issue(
            "gather",
            [output],
            [inp, c],
            lambda cb: self._n.gather(s, r, root, cb),
            back,
            opts=opts,
        )

    gather_into_tensor = gather_single

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        """``output_lists[q][i]`` receives rank q's ``input_list[i]`` (torch's
        ``all_gather_coalesced``): one all-gather of the inputs end to end."""
        n = self.size()
        if len(output_lists) != n or any(len(o) != len(input_list) for o in output_lists):
            raise InvalidArgumentError(
                f"all_gather_coalesced: {n} output lists (one per rank), each of one "
                f"tensor per input ({len(input_list)})"
            )
        send = _flat(list(input_list), "all_gather_coalesced")
        recv = torch.empty(n * send.numel(), dtype=send.dtype)
        m = send.numel()

        def then():
            for q, outs in enumerate(output_lists):
                _unflat(recv[q * m : (q + 1) * m], outs)

        s, r = _data(send), _data(recv)
        return self._issue(
            "all_gather_coalesced",
            [t for outs in output_lists for t in outs],
            [send, recv],
            lambda cb: self._n.all_gather(s, r, cb),
            then,
            opts=opts,
        )

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        out = _one(output_tensors, "reduce_scatter")
        ins = _one(input_tensors, "reduce_scatter")
        if len(ins) != self.size() or any(i.numel() != out.numel() for i in ins):
            raise InvalidArgumentError(
                f"reduce_scatter: {len(ins)} inputs for {self.size()} ranks, each of the "
                f"output's {out.numel()} elements"
            )
        op = _op_name(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        flat = _flat(ins, "reduce_scatter")
        c, back = _io(out, "reduce_scatter's output")
        s, r = _raw(flat), _raw(c)
        return self._issue(
            "reduce_scatter",
            output_tensors,
            [flat, c],
            lambda cb: self._n.reduce_scatter(s, r, op, cb),
            back,
            opts=opts,
        )

    def _reduce_scatter_base(self, output, input, opts=None):
        if input.numel() != self.size() * output.numel():
            raise InvalidArgumentError(
                f"reduce_scatter_tensor: input has {input.numel()} elements, not "
                f"{self.size()} × {output.numel()}"
            )
        op = _op_name(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        inp = input.contiguous()
        c, back = _io(output, "reduce_scatter_tensor's output")
        s, r = _raw(inp), _raw(c)
        return self._issue(
            "reduce_scatter_tensor",
            [output],
            [inp, c],
            lambda cb: self._n.reduce_scatter(s, r, op, cb),
            back,
            opts=opts,
        )

    def gather(self, output_tensors, input_tensors, opts=None):
        inp = _one(input_tensors, "gather").contiguous()
        root = opts.rootRank if opts is not None else 0
        n = self.size()
        if self.rank() == root:
            outs = _one(output_tensors, "gather")
            if len(outs) != n or any(o.numel() != inp.numel() for o in outs):
                raise InvalidArgumentError(f"gather: the root needs {n} outputs the input's size")
            flat = torch.empty(n * inp.numel(), dtype=inp.dtype)
            then = lambda: _unflat(flat, outs)
        else:
            flat = torch.empty(0, dtype=inp.dtype)
            then = None
        s, r = _data(inp), _data(flat)
        return self._issue(
            "gather",
            output_tensors,
            [inp, flat],
            lambda cb: self._n.gather(s, r, root, cb),
            then,
            opts=opts,
        )

    def scatter(self, output_tensors, input_tensors, opts=None):
        out = _one(output_tensors, "scatter")
        root = opts.rootRank if opts is not None else 0
        n = self.size()
        if self.rank() == root:
            ins = _one(input_tensors, "scatter")
            if len(ins) != n or any(i.numel() != out.numel() for i in ins):
                raise InvalidArgumentError(f"scatter: the root needs {n} inputs the output's size")
            flat = _flat(ins, "scatter")
        else:
            flat = torch.empty(0, dtype=out.dtype)
        c, back = _io(out, "scatter's output")
        s, r = _data(flat), _data(c)
        return self._issue(
            "scatter",
            output_tensors,
            [flat, c],
            lambda cb: self._n.scatter(s, r, root, cb),
            back,
            opts=opts,
        )

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        n = self.size()

        def counts(t, splits, what):
            if not splits:
                if t.numel() % n:
                    raise InvalidArgumentError(
                        f"all_to_all_single: {what} of {t.numel()} elements does not split "
                        f"into {n} equal blocks"
                    )
                return None
            if len(splits) != n:
                raise InvalidArgumentError(
                    f"all_to_all_single: {len(splits)} {what} splits for {n} ranks"
                )
            row = t.numel() // t.shape[0] if t.dim() > 0 and t.shape[0] else 1
            if sum(splits) != (t.shape[0] if t.dim() > 0 else 1):
                raise InvalidArgumentError(
                    f"all_to_all_single: {what} splits {list(splits)} do not sum to its first "
                    f"dimension {t.shape[0] if t.dim() else 1}"
                )
            return [int(s) * row for s in splits]

        rc, sc = (
            counts(output, output_split_sizes, "output"),
            counts(input, input_split_sizes, "input"),
        )
        if (rc is None) != (sc is None):
            rc = rc or [output.numel() // n] * n
            sc = sc or [input.numel() // n] * n
        inp = input.contiguous()
        c, back = _io(output, "all_to_all_single's output")
        s, r = _data(inp), _data(c)
        return self._issue(
            "alltoall_base",
            [output],
            [inp, c],
            lambda cb: self._n.all_to_all(s, r, sc, rc, cb),
            back,
            opts=opts,
        )

    def alltoall(self, output_tensors, input_tensors, opts=None):
        n = self.size()
        if len(output_tensors) != n or len(input_tensors) != n:
            raise InvalidArgumentError(f"all_to_all: needs {n} inputs and {n} outputs")
        sflat = _flat(input_tensors, "all_to_all")
        rflat = torch.empty(sum(t.numel() for t in output_tensors), dtype=sflat.dtype)
        sc = [t.numel() for t in input_tensors]
        rc = [t.numel() for t in output_tensors]
        s, r = _data(sflat), _data(rflat)
        return self._issue(
            "alltoall",
            output_tensors,
            [sflat, rflat],
            lambda cb: self._n.all_to_all(s, r, sc, rc, cb),
            lambda: _unflat(rflat, output_tensors),
            opts=opts,
        )

    def barrier(self, opts=None):
        return self._issue("barrier", [], [], lambda cb: self._n.barrier(cb), opts=opts)

    def monitored_barrier(self, opts=None, wait_all_ranks=False):
        """gloo's ``monitored_barrier``: every rank reports to rank 0, which waits at
        most the timeout for each and names the ranks that did not come (the first,
        or all with ``wait_all_ranks``), then releases the others."""
        timeout = getattr(opts, "timeout", None)
        secs = timeout.total_seconds() if isinstance(timeout, timedelta) else None
        me, n = self.rank(), self.size()
        c = self._n
        tok = torch.zeros(1, dtype=torch.uint8)
        tag = _MONITOR_TAG
        if me != 0:
            c.send(_data(tok), 0, tag)
            if not c.recv(_data(tok), 0, tag, lambda e: None).wait(secs):
                raise FerrocclTimeout(
                    f"rank {me}: monitored_barrier: rank 0 did not release it within {secs} s"
                )
            return
        deadline = None if secs is None else time.monotonic() + secs
        bufs = {q: torch.zeros(1, dtype=torch.uint8) for q in range(1, n)}
        tickets = {q: c.recv(_data(bufs[q]), q, tag, lambda e: None) for q in bufs}
        missing = []
        for q, t in tickets.items():
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not t.wait(left):
                missing.append(q)
                if not wait_all_ranks:
                    break
        if missing:
            ranks = ", ".join(map(str, missing))
            raise FerrocclTimeout(
                f"rank 0: monitored_barrier: rank{'s' if len(missing) > 1 else ''} "
                f"{ranks} did not reach it within {secs} s"
            )
        for q in bufs:
            c.send(_data(tok), q, tag)

    # -- point to point -------------------------------------------------------------

    def send(self, tensors, dstRank, tag=0):
        t = _one(tensors, "send").contiguous()
        b = _data(t)
        return self._issue("send", tensors, [t], lambda cb: self._n.send(b, dstRank, int(tag), cb))

    def recv(self, tensors, srcRank, tag=0):
        t = _one(tensors, "recv")
        c, back = _io(t, "recv's tensor")
        b = _data(c)
        return self._issue(
            "recv",
            tensors,
            [c],
            lambda cb: self._n.recv(b, srcRank, int(tag), cb),
            back,
        )

    def recv_anysource(self, tensors, tag=0):
        raise UnsupportedError(
            "ferroccl backend: recv from any source is not supported (name the source rank)"
        )


# -- the backend's creator ------------------------------------------------------------

# The default group's communicator, when the default group is ferroccl's: subgroups are
# its children.
_DEFAULT: Communicator | None = None
_NONCES: dict = collections.Counter()


def _advertise() -> str:
    for var in ("FERROCCL_ADVERTISE_ADDR", "MASTER_ADDR"):
        v = os.environ.get(var, "").strip()
        if v:
            return v
    return socket.gethostname()


def _get(store, key: str, timeout: timedelta) -> bytes:
    store.wait([key], timeout)
    return bytes(store.get(key))


def _meet(store, rank: int, size: int, timeout: timedelta) -> Communicator:
    """A fresh communicator meeting on ``store``: rank 0 publishes the job's token and
    identity there (``FERROCCL_TOKEN`` when set), and ferroccl's store address."""
    if rank == 0:
        token = os.environ.get("FERROCCL_TOKEN") or _native_token()
        job = os.environ.get("TORCHELASTIC_RUN_ID") or f"torch-{_native_token()[:12]}"
        store.set("ferroccl/token", token)
        store.set("ferroccl/job", job)
    else:
        token = _get(store, "ferroccl/token", timeout).decode()
        job = _get(store, "ferroccl/job", timeout).decode()
    local = os.environ.get("LOCAL_RANK")
    return Communicator.on_store(
        store,
        rank,
        size,
        _advertise(),
        token=token,
        job_id=job,
        timeout=timeout.total_seconds(),
        local_rank=int(local) if local and local.isdigit() else None,
    )


def _native_token() -> str:
    from . import new_token

    return new_token()


# Set on the default group's store by a member that found a new group's members
# disagree, so that the members of groups that agree among themselves do not wait for
# it (torch gives a new group a 30-minute timeout by default) but raise as well.
_BROKEN = "ferroccl/broken-group"


def _has(store, key: str) -> bool:
    """Whether ``key`` is on ``store``, without waiting (torch 1.13's stores have no
    ``check`` in Python: a wait of a millisecond stands in)."""
    if hasattr(store, "check"):
        return store.check([key])
    try:
        store.wait([key], timedelta(milliseconds=1))
    except RuntimeError:
        return False
    return True


def _agree(store, rank: int, ranks: list[int], timeout: timedelta) -> None:
    """Checks on the group's store that every member was given the same members (a
    mesh built differently on each rank): a member given others would otherwise wait
    to connect to a group nobody else makes until the timeout.

    Two rounds: each member publishes whom it was given and compares with the others';
    then each says whether it goes on, and connects only if every member does. A
    member waiting in the first round for one that will never come (it raised in
    another group, and said so on the default group's store) raises at once, and says
    "no" in the second round, so no member connects to it."""
    world = dist.distributed_c10d._get_default_store()
    deadline = time.monotonic() + timeout.total_seconds()
    me = ranks[rank]

    def read(key: str, q: int, give_up: bool) -> str:
        pause = 0.001
        while not _has(store, key):
            if give_up and _has(world, _BROKEN):
                raise MismatchError(bytes(world.get(_BROKEN)).decode())
            if time.monotonic() > deadline:
                raise FerrocclTimeout(
                    f"rank {me}: new group of {ranks}: rank {ranks[q]} did not join it "
                    f"within {timeout.total_seconds()} s"
                )
            time.sleep(pause)
            pause = min(2 * pause, 0.05)
        return bytes(store.get(key)).decode()

    store.set(f"ferroccl/members/{rank}", json.dumps([me, ranks]))
    try:
        for q in range(len(ranks)):
            if q == rank:
                continue
            who, theirs = json.loads(read(f"ferroccl/members/{q}", q, give_up=True))
            if theirs != ranks:
                msg = (
                    f"rank {me}: mismatched new group: this rank was given the members "
                    f"{ranks}, rank {who} (its rank {q} in the group) was given {theirs}"
                )
                world.set(_BROKEN, msg)
                raise MismatchError(msg)
    except BaseException:
        store.set(f"ferroccl/verdict/{rank}", "no")
        raise
    store.set(f"ferroccl/verdict/{rank}", "go")
    for q in range(len(ranks)):
        if q != rank and read(f"ferroccl/verdict/{q}", q, give_up=False) != "go":
            why = bytes(world.get(_BROKEN)).decode() if _has(world, _BROKEN) else ""
            raise MismatchError(
                f"rank {me}: new group of {ranks}: rank {ranks[q]} did not make it ({why})"
            )


def _nonce(ranks: list[int], name: str) -> int:
    """What tells apart the groups of one list of members: torch's name for the group
    (the same on every member), or, without one, how many groups of these members this
    rank made before."""
    if name:
        return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
    key = tuple(ranks)
    n = _NONCES[key]
    _NONCES[key] += 1
    return n


def create(opts, options=None) -> ProcessGroupFerroccl:
    """torch.distributed's creator for the backend ``"ferroccl"`` (its extended form:
    ``opts`` says the group's store, rank, size, timeout, name and the world's ranks
    of its members)."""
    global _DEFAULT
    store, rank, size = opts.store, opts.group_rank, opts.group_size
    timeout = opts.timeout
    if not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))
    ranks = list(getattr(opts, "global_ranks_in_group", None) or range(size))
    default_is_ours = (
        _DEFAULT is not None and dist.is_initialized() and dist.get_backend() == BACKEND
    )
    if default_is_ours:
        _agree(store, rank, ranks, timeout)
        nonce = _nonce(ranks, str(getattr(opts, "group_id", "") or ""))
        comm = _DEFAULT.group_of_members(ranks, nonce)
    else:
        comm = _meet(store, rank, size, timeout)
        if not dist.is_initialized():
            if _DEFAULT is not None:
                _DEFAULT.close()
            _DEFAULT = comm
            _NONCES.clear()
    return ProcessGroupFerroccl(comm, rank, size)


def communicator(group=None) -> Communicator:
    """The ferroccl :class:`~ferroccl.Communicator` under a torch.distributed group of
    the backend (the default group when ``group`` is None): for what torch does not
    reach, such as ``dump_trace``."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    ours = pg
    if not isinstance(ours, ProcessGroupFerroccl) and hasattr(pg, "_get_backend"):
        try:
            ours = pg._get_backend(torch.device("cpu"))
        except RuntimeError:
            ours = None
    if not isinstance(ours, ProcessGroupFerroccl):
        raise InvalidArgumentError(f"{pg!r} is not a group of the backend {BACKEND!r}")
    return ours.comm


def _register() -> None:
    if BACKEND.upper() in getattr(dist.Backend, "_plugins", {}):
        return
    try:
        dist.Backend.register_backend(BACKEND, create, extended_api=True, devices=["cpu"])
    except TypeError:  # torch 1.13: no devices=
        dist.Backend.register_backend(BACKEND, create, extended_api=True)


_register()
