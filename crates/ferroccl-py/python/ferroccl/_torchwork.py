"""torch's ``Work`` for ferroccl's operations (``ferroccl.torch``'s backend returns
these), and whether a caller waits for its operation at once."""

from __future__ import annotations

import collections
import inspect
import re
import sys
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

import ferroccl

from . import UnsupportedError

_WorkBase = getattr(dist, "_Work", None) or dist.Work

# Works are Python objects that C++ (DDP's reducer, `_broadcast_coalesced`) holds by a
# C++ reference only: if the Python object were collected, C++ would fall back to the
# base class's wait, which never returns. Hold every Work until it is over, and, on a
# torch older than 2.7, the latest completed ones a while longer (C++ waits on them
# right after they return). From 2.7 on, torch's C++ holds the Python object of a Work
# a Python backend returns as long as it holds the Work (its ``PyWorkHolder``), and
# keeping 4,096 finished Works only fed Python's collector: 5-8 us of a 30 us
# ``async_op=True`` call and its ``wait()`` (world size 1, 3 interleaved runs).
_LIVE: set = set()
_RECENT: collections.deque = collections.deque(maxlen=0 if torch.__version__ >= "2.7" else 4096)
_LOCK = threading.Lock()


def _current_stream(device) -> int:
    """The raw handle of torch's current stream on a CUDA ``device``."""
    return torch.cuda.current_stream(device).cuda_stream


def _future(devices):
    """A torch future; one whose value may hold CUDA tensors of ``devices`` is a CUDA
    future (its callbacks run on streams that wait for it)."""
    return torch.futures.Future() if devices is None else torch.futures.Future(devices=devices)


class Work(_WorkBase):
    """torch's ``Work`` for one ferroccl operation: a :class:`ferroccl.Work` (``op``)
    seen through torch's interface. In the background, held in ``_LIVE`` until over;
    run on the caller's thread (``op`` None), over before it is returned.

    When ``op`` is over it settles the *gate*, a Python future that only says "over".
    The future handed out, to DDP's reducer and to hooks, is ``gate.then(settle)``: it
    holds the tensors, or a real C++ error with ferroccl's class and message. (A future
    completed with ``Future.set_exception`` holds the exception as a value that only
    Python unwraps: DDP's reducer reads it as tensors, and crashes.)

    On CUDA tensors (``cuda`` = the operation's ``_native.DeviceOp`` and its device),
    as ProcessGroupNCCL's: ``wait()`` and ``synchronize()`` make torch's current stream
    wait for the operation's end (a stream wait: the host waits only until ferroccl's
    executor has run the operation, which drives it from the host), ``is_completed()``
    says whether its device work is over, and the future is a CUDA future of that
    device whose callbacks' streams wait for the operation's end."""

    _op: ferroccl.Work | None = None
    _gate = None
    _fut = None
    _cuda = None

    def __init__(self, result: list[torch.Tensor], op: ferroccl.Work | None = None, cuda=None):
        super().__init__()
        self._result = result
        self._cuda = cuda
        if op is not None:
            self._op = op
            self._gate = self._new_gate()
            op._on_done = self._over
            with _LOCK:
                _LIVE.add(self)

    def _new_gate(self):
        return _future(None if self._cuda is None else [self._cuda[1]])

    def _over(self) -> None:
        with _LOCK:
            _LIVE.discard(self)
            _RECENT.append(self)
        self._gate.set_result(None)

    def _settle(self, _gate):
        e = self.exception()
        if e is not None:
            raise e.with_traceback(None)
        if self._cuda is not None:
            # Runs with torch's callback streams current: they wait for our end.
            op, device = self._cuda
            op.wait_stream(_current_stream(device))
        return self._result

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self._op is not None:
            secs = None
            if timeout is not None:
                secs = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
                if secs <= 0:
                    secs = None  # torch's kNoTimeout
            self._op.wait(secs)
        if self._cuda is not None:
            op, device = self._cuda
            op.wait_stream(_current_stream(device))
        return True

    def is_completed(self) -> bool:
        if self._op is not None and not self._op.is_completed():
            return False
        if self._cuda is not None and self.exception() is None:
            return self._cuda[0].query()
        return True

    def is_success(self) -> bool:
        return self.is_completed() and self.exception() is None

    def exception(self):
        return None if self._op is None else self._op.exception()

    def get_future(self):
        with _LOCK:
            if self._fut is None:
                if self._gate is None:  # ran on the caller's thread: over already
                    self._gate = self._new_gate()
                    self._gate.set_result(None)
                self._fut = self._gate.then(self._settle)
            return self._fut

    def result(self):
        self.wait()
        return self._result

    def synchronize(self) -> None:
        """Makes torch's current stream wait for the operation (CUDA), without raising
        its error (``wait()`` does)."""
        if self._op is not None and self._op._ticket is not None:
            self._op._ticket.wait()
        if self._cuda is not None and self.exception() is None:
            op, device = self._cuda
            op.wait_stream(_current_stream(device))

    def source_rank(self) -> int:
        raise UnsupportedError("ferroccl has no receive from any source")


_C10D_MODULE = "torch.distributed.distributed_c10d"


def _caller_waits(opts) -> bool:
    """Whether the operation's caller waits for it at once: torch 2.x says so in
    ``opts.asyncOp``; in 1.13, a ``torch.distributed`` function called with
    ``async_op=False`` (its next step is ``work.wait()``). Anything else (DDP's
    reducer, a caller that asked for async) runs in the background."""
    flag = getattr(opts, "asyncOp", None)
    if flag is not None:
        return not flag
    f = sys._getframe(1)
    while f is not None and f.f_globals.get("__name__", "").startswith("ferroccl"):
        f = f.f_back
    if f is None or f.f_globals.get("__name__") != _C10D_MODULE:
        return False
    # send and recv wait for their work; isend and irecv do not.
    return f.f_locals.get("async_op") is False or f.f_code.co_name in ("send", "recv")


# torch.distributed's functions a synchronous call may answer with None. torch 2.x
# ends each with ``elif work is not None: work.wait()`` ("the backend has sync'ed at
# CPP level"); 1.13 calls ``work.wait()`` unguarded. Only the ones whose source says
# so take None (the rest, and every other caller, get a Work).
_NONE_CALLERS = (
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "barrier",
)
_NONE_GUARD = re.compile(r"elif\s*\(?\s*work is not None\s*\)?\s*:\s*(#[^\n]*)?\s*work\.wait\(\)")
_none_codes: frozenset | None = None


def _none_ok(frame) -> bool:
    """Whether ``frame`` (the caller of a backend method whose operation is over) is
    one of torch.distributed's functions that take None for a Work there: sparing a
    Work that nobody would keep (half a microsecond, a fifth of a small call's
    binding)."""
    global _none_codes
    if _none_codes is None:
        _none_codes = _guarded_codes()
    return frame is not None and frame.f_code in _none_codes


def _guarded_codes() -> frozenset:
    c10d = sys.modules.get(_C10D_MODULE)
    codes = set()
    for name in _NONE_CALLERS:
        try:
            fn = inspect.unwrap(getattr(c10d, name))
            if _NONE_GUARD.search(inspect.getsource(fn)):
                codes.add(fn.__code__)
        except (AttributeError, TypeError, OSError, ValueError):
            continue
    return frozenset(codes)
