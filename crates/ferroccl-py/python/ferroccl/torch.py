"""The torch.distributed backend ``"ferroccl"``, for CPU and CUDA tensors.

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
``split_group`` (and pipelining's per-edge groups) is ferroccl's ``split`` of the
parent group, every rank of it taking part; ranks given different splits raise
``MismatchError``.

CUDA tensors (``_torchcuda``) are moved in place too, ordered with torch's current
stream as ProcessGroupNCCL orders them: over CUDA IPC when the group's ranks share a
host (several ranks per GPU allowed), staged through pinned host memory otherwise.
One call's tensors are on one device, and CUDA ones on this rank's GPU in the group.

The backend is a ``torch.distributed.Backend`` under torch's own ``ProcessGroup``
where torch lets Python implement one (its ``PyBackend``); on older torch it is the
``ProcessGroup`` itself (with, on torch 2.x, a placeholder backend per device type so
that ``group_name`` and ``_device_types`` are set). ``communicator(group)`` gives the
ferroccl :class:`~ferroccl.Communicator` of a group either way. ``Work`` is
``_torchwork``'s; how the ranks meet is ``_torchmeet``'s.

The ranks meet on the store torch hands the backend: rank 0 serves ferroccl's own store
on a free port and publishes its address, a fresh job token and the job's identity
there. The address published is ``FERROCCL_ADVERTISE_ADDR``, else ``MASTER_ADDR``, else
this host's name (set ``FERROCCL_ADVERTISE_ADDR`` on rank 0 when other hosts cannot
reach it by either).
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import ferroccl

from . import Communicator, InvalidArgumentError, UnsupportedError, _torchmeet
from . import TimeoutError as FerrocclTimeout
from ._torchcuda import CudaSide, device_of
from ._torchmeet import _agree, _attempt, _meet, _nonce, _split
from ._torchtensors import (
    _cpu_raw,
    _data,
    _flat,
    _io,
    _one,
    _op_name,
    _raw,
    _unflat,
)
from ._torchwork import _LIVE, _LOCK, Work, _caller_waits, _none_ok

BACKEND = "ferroccl"
# The device types the backend moves tensors of (CUDA: see ``_torchcuda``).
DEVICES = ["cpu", "cuda"]

_C10D = torch._C._distributed_c10d

# The tag of monitored_barrier's messages (torch's own tags are small).
_MONITOR_TAG = 0xFFFF_FF00


def _over(result, caller):
    """What a blocking call that is over returns to ``caller`` (the frame that called
    the group's method): None to torch.distributed's own functions that take None for
    "over" (no Work to make; on the ProcessGroup route only, where nothing in C++ sits
    between them and this group), a Work to anything else."""
    return None if not _AS_BACKEND and _none_ok(caller) else Work(result)


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


def _as_backend() -> bool:
    """What the backend is (``FERROCCL_TORCH_CLASS``): by default the ProcessGroup
    itself, on every torch (1.13 has nothing else), its methods called by
    torch.distributed directly; ``backend`` makes it a c10d Backend under torch's own
    ProcessGroup where torch calls Python ones (2.15's PyBackend), as gloo's is. Both
    run every test; torch's dispatch through PyBackend cost 5.5-7 us per call on 2.15
    (the book's binding section), more than all of ferroccl's Python."""
    choice = os.environ.get("FERROCCL_TORCH_CLASS", "").strip() or "process-group"
    if choice not in ("process-group", "backend"):
        raise InvalidArgumentError(
            f"FERROCCL_TORCH_CLASS={choice!r}: expected process-group or backend"
        )
    return choice == "backend" and _python_backends()


_AS_BACKEND = _as_backend()
_Base = _C10D.Backend if _AS_BACKEND else dist.ProcessGroup


def _placeholder(rank: int, size: int):
    """A backend that only holds what torch 2.x keeps in backends (the group's name,
    its devices): torch's fake backend, told to raise on any collective, so that a
    call that reaches it instead of this group's methods fails rather than pretends."""
    opts = _C10D.FakeProcessGroup.Options()
    opts.error_on_collective = True
    return _C10D.FakeProcessGroup._create_internal(rank, size, opts)


class _Options:
    """A backend's options as torch reads them (``backend``, ``_timeout``)."""

    def __init__(self, backend: str, timeout: timedelta):
        self.backend = backend
        self._timeout = timeout


def _as_caller(then):
    """``then`` (the copies into the caller's tensors once an operation is over) as
    the caller would run it. It may run on a thread of the communicator's, where
    torch's thread-local modes are their defaults: a tensor made under
    ``torch.inference_mode()`` (DTensor's collectives in an inference-mode forward)
    then refuses the in-place copy ("Inplace update to inference tensor outside
    InferenceMode"). torch's own backends write such tensors without a word, so the
    copies run under the caller's inference mode, and outside autograd, as theirs do."""
    if torch.is_inference_mode_enabled():

        def run():
            with torch.inference_mode():
                then()

    else:

        def run():
            with torch.no_grad():
                then()

    return run


class ProcessGroupFerroccl(_Base):
    """torch.distributed's backend over a ferroccl communicator (``comm``)."""

    def __init__(self, comm: Communicator, rank: int, size: int, store=None, timeout=None):
        super().__init__(rank, size)
        self.comm = comm
        self._n = comm.native
        self._store = store
        self._timeout = timeout or timedelta(minutes=30)
        # CUDA tensors: this rank's GPU in the group, and the communicator that moves
        # them (made at the group's first CUDA call, on the group's store).
        self._cuda = CudaSide(self, store, self._timeout)
        if not _AS_BACKEND and hasattr(self, "_register_backend"):
            # torch 2.x keeps a group's name and device types in its backends: give
            # this group a placeholder for each device type (every call reaches the
            # methods below, which this group overrides).
            kind = dist.ProcessGroup.BackendType.CUSTOM
            self._set_default_backend(kind)
            for device in DEVICES:
                self._register_backend(torch.device(device), kind, _placeholder(rank, size))

    # -- names ----------------------------------------------------------------------

    def getBackendName(self) -> str:
        return BACKEND

    def _get_backend_name(self) -> str:
        return BACKEND

    def name(self) -> str:
        return BACKEND

    # torch 2.x asks for the backend of a device (to learn, for example, whether it
    # coalesces point-to-point): as the group itself, this group is its own backend.
    # It splits (``split_group`` below) where it is the ProcessGroup. As a Backend
    # under torch's ProcessGroup it would be torch's C++ that splits, through
    # ``Backend.split``, which this class does not implement: there torch refuses.
    supports_coalescing = False
    supports_splitting = not _AS_BACKEND

    if not _AS_BACKEND:

        def _get_backend(self, device=None):
            return self

        @property
        def options(self):
            """What torch reads of a backend's options (pipelining's per-edge groups
            take ``_timeout`` for their children)."""
            return _Options(BACKEND, self._timeout)

        def split_group(
            self,
            ranks,
            timeout=None,
            opts=None,
            group_name=None,
            group_desc=None,
            device_types=None,
        ):
            """torch's ``ProcessGroup.split_group`` (``dist.split_group``, and what
            builds on it: ``DeviceMesh`` on a group bound to a device, pipelining's
            per-edge groups): the child of ``ranks`` (ranks of this group, in the
            child's order), made by every rank of this group at once, each passing
            its own child's ranks; None on a rank in none. See ``_split``."""
            child = _split(self, [int(r) for r in ranks], group_name or "")
            if child is None:
                return None
            # The child's own keys on the parent's store (its CUDA side meets there):
            # under its communicator's id, the same on every member.
            store = self._store
            if store is not None:
                store = dist.PrefixStore(f"ferroccl-split-{child.id:x}/", store)
            pg = ProcessGroupFerroccl(
                child, child.rank, child.world_size, store=store, timeout=timeout or self._timeout
            )
            if group_name:
                pg._set_group_name(group_name)
            if group_desc:
                pg._set_group_desc(group_desc)
            return pg

        def perform_nocolor_split(self, device=None) -> None:
            """``new_group`` on a group bound to a device asks each non-member of the
            new group to take part in splitting this one (NCCL's ``ncclCommSplit``
            needs every rank). ferroccl's ``new_group`` is made by its members
            alone: nothing to do."""

        def eager_connect_single_device(self, device=None) -> None:
            """``init_process_group(device_id=...)`` asks a backend that splits to
            connect at once. This group is connected; its CUDA side connects at its
            first CUDA call, on every rank at the same point."""

        def get_group_store(self):
            return self._store

    # -- plumbing -------------------------------------------------------------------

    def _where(self, what: str, *named) -> torch.device | None:
        """The device of a call's tensors (``(tensor, its name)`` pairs): None for the
        CPU (at once), else this rank's GPU in the group; typed errors otherwise."""
        for t, _ in named:
            if not t.is_cpu:
                break
        else:
            return None
        dev = device_of(what, named)
        if dev is not None:
            self._cuda.check(what, dev, named[0][1])
        return dev

    def _issue(self, what, result, keep, issue, then=None, opts=None, dev=None) -> Work:
        """Issues an operation: ``issue(native, callback, device_op)`` hands it to the
        communicator (CPU tensors: ``device_op`` None; CUDA tensors of ``dev``: see
        ``_torchcuda``)."""
        if dev is not None:
            then = then and _as_caller(then)
            return self._cuda.issue(what, result, keep, issue, then, opts, dev)
        if _caller_waits(opts):
            # Run here and now (the queue before it first), sparing the worker's
            # wake-up: the caller would only wait for it. Errors raise from here.
            # ``then`` runs on the caller's thread, in the caller's modes (outside
            # autograd, as ``_as_caller`` says why).
            issue(self._n, None, None)
            if then is None:
                pass
            elif torch.is_grad_enabled():
                with torch.no_grad():
                    then()
            else:
                then()
            return _over(result, sys._getframe(2))
        # ``then`` may run on the communicator's thread: in the caller's modes there.
        op = ferroccl.Work(what, keep, then and _as_caller(then))
        w = Work(result, op)
        try:
            op._ticket = issue(self._n, op._complete, None)
        except BaseException:
            with _LOCK:
                _LIVE.discard(w)
            raise
        return w

    # -- collectives ----------------------------------------------------------------

    def allreduce(self, tensors, opts=None):
        t = _one(tensors, "allreduce")
        op = _op_name(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        b = _cpu_raw(t)
        if b is not None and _caller_waits(opts):
            # The common blocking call on a CPU tensor: _issue's path without its steps.
            self._n.all_reduce(b, op, None, None)
            return _over(tensors, sys._getframe(1))
        if b is not None:
            dev, c, back = None, t, None
        else:
            dev = self._where("allreduce", (t, "allreduce's tensor"))
            c, back = _io(t, "allreduce's tensor")
            b = _raw(c)
        return self._issue(
            "allreduce",
            tensors,
            [c],
            lambda n, cb, d: n.all_reduce(b, op, cb, d),
            back,
            opts=opts,
            dev=dev,
        )

    def allreduce_coalesced(self, tensors, opts=None):
        op = _op_name(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        what = "allreduce_coalesced"
        dev = self._where(what, *((t, f"tensor {i}") for i, t in enumerate(tensors)))
        flat = _flat(tensors, what)
        b = _raw(flat)
        return self._issue(
            what,
            tensors,
            [flat],
            lambda n, cb, d: n.all_reduce(b, op, cb, d),
            lambda: _unflat(flat, tensors),
            opts=opts,
            dev=dev,
        )

    def broadcast(self, tensors, opts=None):
        t = _one(tensors, "broadcast")
        root = opts.rootRank if opts is not None else 0
        dev = self._where("broadcast", (t, "broadcast's tensor"))
        c, back = _io(t, "broadcast's tensor")
        b = _data(c)
        return self._issue(
            "broadcast",
            tensors,
            [c],
            lambda n, cb, d: n.broadcast(b, root, cb, d),
            back,
            opts=opts,
            dev=dev,
        )

    def reduce(self, tensors, opts=None):
        t = _one(tensors, "reduce")
        root = opts.rootRank if opts is not None else 0
        op = _op_name(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        dev = self._where("reduce", (t, "reduce's tensor"))
        c, back = _io(t, "reduce's tensor")
        b = _raw(c)
        return self._issue(
            "reduce",
            tensors,
            [c],
            lambda n, cb, d: n.reduce(b, op, root, cb, d),
            back,
            opts=opts,
            dev=dev,
        )

    def allgather(self, output_tensors, input_tensors, opts=None):
        inp = _one(input_tensors, "allgather")
        outs = _one(output_tensors, "allgather")
        dev = self._where(
            "allgather", (inp, "the input"), *((o, f"output {q}") for q, o in enumerate(outs))
        )
        inp = inp.contiguous()
        n = self.size()
        if len(outs) != n or any(o.numel() != inp.numel() for o in outs):
            raise InvalidArgumentError(
                f"allgather: {len(outs)} outputs for {n} ranks, each of the input's "
                f"{inp.numel()} elements"
            )
        if any(o.dtype != inp.dtype for o in outs):
            raise InvalidArgumentError("allgather: outputs and input differ in dtype")
        flat = torch.empty(n * inp.numel(), dtype=inp.dtype, device=inp.device)
        s, r = _data(inp), _data(flat)
        return self._issue(
            "allgather",
            output_tensors,
            [inp, flat],
            lambda n, cb, d: n.all_gather(s, r, cb, d),
            lambda: _unflat(flat, outs),
            opts=opts,
            dev=dev,
        )

    def _allgather_base(self, output, input, opts=None):
        if output.numel() != self.size() * input.numel():
            raise InvalidArgumentError(
                f"all_gather_into_tensor: output has {output.numel()} elements, not "
                f"{self.size()} × {input.numel()}"
            )
        dev = self._where("all_gather_into_tensor", (input, "the input"), (output, "the output"))
        inp = input.contiguous()
        c, back = _io(output, "all_gather_into_tensor's output")
        s, r = _data(inp), _data(c)
        return self._issue(
            "allgather_into_tensor",
            [output],
            [inp, c],
            lambda n, cb, d: n.all_gather(s, r, cb, d),
            back,
            opts=opts,
            dev=dev,
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
        dev = self._where(
            "all_gather_into_tensor (coalesced)",
            *((t, f"input {i}") for i, t in enumerate(inputs)),
            *((t, f"output {i}") for i, t in enumerate(outputs)),
        )
        send = _flat(list(inputs), "all_gather_into_tensor (coalesced)")
        recv = torch.empty(n * send.numel(), dtype=send.dtype, device=send.device)
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
            lambda n, cb, d: n.all_gather(s, r, cb, d),
            then,
            opts=opts,
            dev=dev,
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
        dev = self._where(
            "reduce_scatter_tensor (coalesced)",
            *((t, f"input {i}") for i, t in enumerate(inputs)),
            *((t, f"output {i}") for i, t in enumerate(outputs)),
        )
        # Rank q's block of the send buffer is every input's block q, in order.
        send = torch.cat([i.reshape(n, -1) for i in inputs], dim=1).reshape(-1)
        recv = torch.empty(send.numel() // n, dtype=send.dtype, device=send.device)
        sizes = [o.numel() for o in outputs]

        def then():
            for o, b in zip(outputs, recv.split(sizes)):
                o.copy_(b.reshape(o.shape))

        s, r = _raw(send), _raw(recv)
        return self._issue(
            "reduce_scatter_tensor_coalesced",
            list(outputs),
            [send, recv],
            lambda n, cb, d: n.reduce_scatter(s, r, op, cb, d),
            then,
            opts=opts,
            dev=dev,
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
        mine = self.rank() == root
        dev = self._where(
            "gather", (input, "the input"), *([(output, "the output")] if mine else [])
        )
        inp = input.contiguous()
        if mine:
            if output.numel() != self.size() * inp.numel():
                raise InvalidArgumentError(
                    f"gather: the root's output has {output.numel()} elements, not "
                    f"{self.size()} × {inp.numel()}"
                )
            c, back = _io(output, "gather's output")
        else:
            c, back = torch.empty(0, dtype=inp.dtype, device=inp.device), None
        s, r = _data(inp), _data(c)
        return self._issue(
            "gather",
            [output],
            [inp, c],
            lambda n, cb, d: n.gather(s, r, root, cb, d),
            back,
            opts=opts,
            dev=dev,
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
        dev = self._where(
            "all_gather_coalesced",
            *((t, f"input {i}") for i, t in enumerate(input_list)),
            *(
                (t, f"output [{q}][{i}]")
                for q, o in enumerate(output_lists)
                for i, t in enumerate(o)
            ),
        )
        send = _flat(list(input_list), "all_gather_coalesced")
        recv = torch.empty(n * send.numel(), dtype=send.dtype, device=send.device)
        m = send.numel()

        def then():
            for q, outs in enumerate(output_lists):
                _unflat(recv[q * m : (q + 1) * m], outs)

        s, r = _data(send), _data(recv)
        return self._issue(
            "all_gather_coalesced",
            [t for outs in output_lists for t in outs],
            [send, recv],
            lambda n, cb, d: n.all_gather(s, r, cb, d),
            then,
            opts=opts,
            dev=dev,
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
        dev = self._where(
            "reduce_scatter",
            (out, "the output"),
            *((t, f"input {i}") for i, t in enumerate(ins)),
        )
        flat = _flat(ins, "reduce_scatter")
        c, back = _io(out, "reduce_scatter's output")
        s, r = _raw(flat), _raw(c)
        return self._issue(
            "reduce_scatter",
            output_tensors,
            [flat, c],
            lambda n, cb, d: n.reduce_scatter(s, r, op, cb, d),
            back,
            opts=opts,
            dev=dev,
        )

    def _reduce_scatter_base(self, output, input, opts=None):
        if input.numel() != self.size() * output.numel():
            raise InvalidArgumentError(
                f"reduce_scatter_tensor: input has {input.numel()} elements, not "
                f"{self.size()} × {output.numel()}"
            )
        op = _op_name(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        dev = self._where("reduce_scatter_tensor", (input, "the input"), (output, "the output"))
        inp = input.contiguous()
        c, back = _io(output, "reduce_scatter_tensor's output")
        s, r = _raw(inp), _raw(c)
        return self._issue(
            "reduce_scatter_tensor",
            [output],
            [inp, c],
            lambda n, cb, d: n.reduce_scatter(s, r, op, cb, d),
            back,
            opts=opts,
            dev=dev,
        )

    def gather(self, output_tensors, input_tensors, opts=None):
        inp = _one(input_tensors, "gather")
        root = opts.rootRank if opts is not None else 0
        n = self.size()
        mine = self.rank() == root
        outs = _one(output_tensors, "gather") if mine else []
        dev = self._where(
            "gather", (inp, "the input"), *((o, f"output {q}") for q, o in enumerate(outs))
        )
        inp = inp.contiguous()
        if mine:
            if len(outs) != n or any(o.numel() != inp.numel() for o in outs):
                raise InvalidArgumentError(f"gather: the root needs {n} outputs the input's size")
            flat = torch.empty(n * inp.numel(), dtype=inp.dtype, device=inp.device)
            then = lambda: _unflat(flat, outs)
        else:
            flat = torch.empty(0, dtype=inp.dtype, device=inp.device)
            then = None
        s, r = _data(inp), _data(flat)
        return self._issue(
            "gather",
            output_tensors,
            [inp, flat],
            lambda n, cb, d: n.gather(s, r, root, cb, d),
            then,
            opts=opts,
            dev=dev,
        )

    def scatter(self, output_tensors, input_tensors, opts=None):
        out = _one(output_tensors, "scatter")
        root = opts.rootRank if opts is not None else 0
        n = self.size()
        mine = self.rank() == root
        ins = _one(input_tensors, "scatter") if mine else []
        dev = self._where(
            "scatter", (out, "the output"), *((t, f"input {q}") for q, t in enumerate(ins))
        )
        if mine:
            if len(ins) != n or any(i.numel() != out.numel() for i in ins):
                raise InvalidArgumentError(f"scatter: the root needs {n} inputs the output's size")
            flat = _flat(ins, "scatter")
        else:
            flat = torch.empty(0, dtype=out.dtype, device=out.device)
        c, back = _io(out, "scatter's output")
        s, r = _data(flat), _data(c)
        return self._issue(
            "scatter",
            output_tensors,
            [flat, c],
            lambda n, cb, d: n.scatter(s, r, root, cb, d),
            back,
            opts=opts,
            dev=dev,
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
        dev = self._where("all_to_all_single", (input, "the input"), (output, "the output"))
        inp = input.contiguous()
        c, back = _io(output, "all_to_all_single's output")
        s, r = _data(inp), _data(c)
        return self._issue(
            "alltoall_base",
            [output],
            [inp, c],
            lambda n, cb, d: n.all_to_all(s, r, sc, rc, cb, d),
            back,
            opts=opts,
            dev=dev,
        )

    def alltoall(self, output_tensors, input_tensors, opts=None):
        n = self.size()
        if len(output_tensors) != n or len(input_tensors) != n:
            raise InvalidArgumentError(f"all_to_all: needs {n} inputs and {n} outputs")
        dev = self._where(
            "all_to_all",
            *((t, f"input {q}") for q, t in enumerate(input_tensors)),
            *((t, f"output {q}") for q, t in enumerate(output_tensors)),
        )
        sflat = _flat(input_tensors, "all_to_all")
        rflat = torch.empty(
            sum(t.numel() for t in output_tensors), dtype=sflat.dtype, device=sflat.device
        )
        sc = [t.numel() for t in input_tensors]
        rc = [t.numel() for t in output_tensors]
        s, r = _data(sflat), _data(rflat)
        return self._issue(
            "alltoall",
            output_tensors,
            [sflat, rflat],
            lambda n, cb, d: n.all_to_all(s, r, sc, rc, cb, d),
            lambda: _unflat(rflat, output_tensors),
            opts=opts,
            dev=dev,
        )

    def barrier(self, opts=None):
        return self._issue("barrier", [], [], lambda n, cb, d: n.barrier(cb), opts=opts)

    def monitored_barrier(self, opts=None, wait_all_ranks=False):
        """gloo's ``monitored_barrier``: every rank reports to rank 0, which waits at
        most the timeout for each and names the ranks that did not come (the first,
        or all with ``wait_all_ranks``), then releases the others. ``opts`` is torch's
        ``BarrierOptions`` when torch calls a backend, the timeout itself when it
        calls the group (``dist.monitored_barrier`` on torch 2.x)."""
        timeout = opts if isinstance(opts, timedelta) else getattr(opts, "timeout", None)
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
        t = _one(tensors, "send")
        dev = self._where("send", (t, "send's tensor"))
        t = t.contiguous()
        b = _data(t)
        return self._issue(
            "send",
            tensors,
            [t],
            lambda n, cb, d: n.send(b, dstRank, int(tag), cb, d),
            dev=dev,
        )

    def recv(self, tensors, srcRank, tag=0):
        t = _one(tensors, "recv")
        dev = self._where("recv", (t, "recv's tensor"))
        c, back = _io(t, "recv's tensor")
        b = _data(c)
        return self._issue(
            "recv",
            tensors,
            [c],
            lambda n, cb, d: n.recv(b, srcRank, int(tag), cb, d),
            back,
            dev=dev,
        )

    def recv_anysource(self, tensors, tag=0):
        raise UnsupportedError(
            "ferroccl backend: recv from any source is not supported (name the source rank)"
        )


# -- the backend's creator ------------------------------------------------------------

# The default group's communicator, when the default group is ferroccl's: subgroups are
# its children.
_DEFAULT: Communicator | None = None


def create(opts, options=None) -> ProcessGroupFerroccl:
    """torch.distributed's creator for the backend ``"ferroccl"`` (its extended form:
    ``opts`` says the group's store, rank, size, timeout, name and the world's ranks
    of its members)."""
    global _DEFAULT
    store, rank, size = _attempt(opts.store), opts.group_rank, opts.group_size
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
            _torchmeet._NONCES.clear()
    return ProcessGroupFerroccl(comm, rank, size, store=store, timeout=timeout)


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
        dist.Backend.register_backend(BACKEND, create, extended_api=True, devices=DEVICES)
    except TypeError:  # torch 1.13: no devices=
        dist.Backend.register_backend(BACKEND, create, extended_api=True)


def _eager_under_compile(*classes) -> None:
    """Marks the methods of ``classes`` to run as they are under ``torch.compile``.

    While a compiled region runs, Dynamo intercepts every Python frame entered, those
    torch's C++ enters too (DDP's reducer broadcasting its bucket order from a
    compiled forward): it would trace this backend's methods, where a
    ``ProcessGroup`` is an opaque object it refuses to look into (a hard error,
    "unregistered member on an OpaqueObject"); gloo's methods are C++ and never
    traced. The mark is Dynamo's own ``skip_code`` strategy, made recursive (what the
    methods call runs as it is too), set through ``torch._C`` so that importing
    ``torch._dynamo`` (about a second) is not paid by every job. A torch without that
    interface (1.13) has nothing to mark."""
    try:
        from torch._C._dynamo import eval_frame as ef

        strategy = ef._FrameExecStrategy(ef._FrameAction.SKIP, ef._FrameAction.SKIP)
        mark = ef.set_code_exec_strategy
    except (ImportError, AttributeError, TypeError):
        return
    for cls in classes:
        for attr in vars(cls).values():
            for fn in (attr, getattr(attr, "fget", None)):
                code = getattr(fn, "__code__", None)
                if code is not None:
                    mark(code, strategy)


_eager_under_compile(ProcessGroupFerroccl, Work)
_register()
