"""Types of ``ferroccl._native``, the extension module (``crates/ferroccl-py/src``).

The package ``ferroccl`` wraps it; buffers cross as ``(address, elements, dtype)``
tuples that ``ferroccl.buffer`` checked, and non-blocking operations report by calling
``callback(None | exception)`` once, under the GIL, on a thread of the communicator's.
With ``device=`` (a :class:`DeviceOp`) the tuples are CUDA memory of its GPU, and the
operation is ordered with the stream the device op was issued on.
"""

from collections.abc import Callable, Sequence
from typing import Any, final

from typing_extensions import TypeAlias

__all__ = [
    "AbortedError",
    "Communicator",
    "ConfigError",
    "CudaError",
    "DeviceOp",
    "FerrocclError",
    "InvalidArgumentError",
    "IoError",
    "MismatchError",
    "PeerClosedError",
    "PeerFailedError",
    "PoisonedError",
    "ProtocolError",
    "RendezvousError",
    "Ticket",
    "TimeoutError",
    "UnsupportedError",
    "__version__",
    "has_cuda",
    "new_token",
    "shutdown",
]
__version__: str
#: Whether this build moves CUDA memory (the ``cuda`` feature).
has_cuda: bool

#: ``(address, elements, dtype name)``: a contiguous CPU buffer the caller keeps alive
#: and untouched until the operation is over.
_RawBuf: TypeAlias = tuple[int, int, str]
#: Called once with None (done) or the operation's exception.
_Callback: TypeAlias = Callable[[BaseException | None], object]

class FerrocclError(RuntimeError):
    """Any ferroccl failure. ``kind`` is the Rust variant's name; ``rank``, ``peer``,
    ``op``, ``origin``, ``told_by``, ``cause``, ``cause_kind`` and ``after`` are set
    where the failure has them."""

class InvalidArgumentError(FerrocclError): ...
class UnsupportedError(FerrocclError): ...
class ConfigError(FerrocclError): ...
class RendezvousError(FerrocclError): ...
class PeerClosedError(FerrocclError): ...
class PeerFailedError(FerrocclError): ...
class ProtocolError(FerrocclError): ...
class MismatchError(FerrocclError): ...
class TimeoutError(FerrocclError): ...
class AbortedError(FerrocclError): ...
class PoisonedError(FerrocclError): ...
class CudaError(FerrocclError): ...
class IoError(FerrocclError): ...

@final
class Ticket:
    """A non-blocking operation's handle."""

    def done(self) -> bool:
        """True once the operation is over (its callback has run); never blocks."""

    def wait(self, timeout: float | None = None) -> bool:
        """Waits until the operation is over; False if ``timeout`` seconds passed
        first. Without a timeout, the waiting thread runs the queue up to it."""

@final
class DeviceOp:
    """One operation on CUDA memory, ordered with the caller's stream (the library's
    ``ferroccl::order``): issued there by :meth:`Communicator.device_op`, run on
    ferroccl's stream after it."""

    @property
    def ordinal(self) -> int:
        """The GPU."""
    @property
    def stream(self) -> int:
        """ferroccl's stream the operation runs on (a raw ``CUstream``)."""
    @property
    def caller(self) -> int:
        """The caller's stream it was issued on."""
    def wait_stream(self, stream: int) -> None:
        """Makes ``stream`` wait (on the device) for the operation's end; raises before
        the operation ran."""
    def after(self) -> None:
        """More work on the buffers was queued on :attr:`stream`: the end moves behind
        it."""
    def query(self) -> bool:
        """True once the operation ran and its device work is over."""
    def release_now(self) -> bool:
        """True when the buffers may go back to their allocator now; False when
        ferroccl's stream may still use them (``record_stream`` first)."""

@final
class Communicator:
    """A ferroccl communicator behind its own worker thread: operations run in the
    order they are issued. With ``callback`` an operation is queued and returns a
    :class:`Ticket`; without, it runs on the calling thread and raises its error."""

    @staticmethod
    def from_env() -> Communicator: ...
    @staticmethod
    def local_group(world_size: int) -> list[Communicator]: ...
    @staticmethod
    def on_store(
        store: Any,
        rank: int,
        world_size: int,
        advertise: str,
        token: str,
        job_id: str,
        timeout: float | None = None,
        local_rank: int | None = None,
        transport: str | None = None,
    ) -> Communicator: ...
    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def local_rank(self) -> int: ...
    @property
    def id(self) -> int: ...
    @property
    def job_ranks(self) -> list[int]: ...
    @property
    def transport(self) -> str: ...
    @property
    def hosts(self) -> int | None: ...
    def abort(self) -> None: ...
    def close(self) -> None: ...
    def poisoned(self) -> str | None: ...
    def dump_trace(self, dir: str) -> str: ...
    def all_reduce(
        self,
        buf: _RawBuf,
        op: str,
        callback: _Callback | None = None,
        device: DeviceOp | None = None,
    ) -> Ticket | None: ...
    def broadcast(
        self,
        buf: _RawBuf,
        root: int,
        callback: _Callback | None = None,
        device: DeviceOp | None = None,
    ) -> Ticket | None: ...
    def reduce(
        self,
        buf: _RawBuf,
        op: str,
        root: int,
        callback: _Callback | None = None,
        device: DeviceOp | None = None,
    ) -> Ticket | None: ...
    def all_gather(
        self,
        send: _RawBuf,
        recv: _RawBuf,
        callback: _Callback | None = None,
        device: DeviceOp | None = None,
    ) -> Ticket | None: ...
    def reduce_scatter(
        self,
        send: _RawBuf,
        recv: _RawBuf,
        op: str,
        callback: _Callback | None = None,
        device: DeviceOp | None = None,
    ) -> Ticket | None: ...
    def all_to_all(
        self,
        send: _RawBuf,
        recv: _RawBuf,
        send_counts: Sequence[int] | None = None,
        recv_counts: Sequence[int] | None = None,
        callback: _Callback | None = None,
        device: DeviceOp | None = None,
    ) -> Ticket | None: ...
    def gather(
        self,
        send: _RawBuf,
        recv: _RawBuf,
        root: int,
        callback: _Callback | None = None,
        device: DeviceOp | None = None,
    ) -> Ticket | None: ...
    def scatter(
        self,
        send: _RawBuf,
        recv: _RawBuf,
        root: int,
        callback: _Callback | None = None,
        device: DeviceOp | None = None,
    ) -> Ticket | None: ...
    def barrier(self, callback: _Callback | None = None) -> Ticket | None: ...
    def send(
        self,
        buf: _RawBuf,
        peer: int,
        tag: int = 0,
        callback: _Callback | None = None,
        device: DeviceOp | None = None,
    ) -> Ticket | None: ...
    def recv(
        self,
        buf: _RawBuf,
        peer: int,
        tag: int = 0,
        callback: _Callback | None = None,
        device: DeviceOp | None = None,
    ) -> Ticket | None: ...
    def device_op(self, ordinal: int, stream: int) -> DeviceOp:
        """Issues a device op on GPU ``ordinal`` for a caller whose work on the buffers
        is queued on ``stream`` (``torch.cuda.current_stream().cuda_stream``)."""
    def split(self, color: int | None, key: int = 0) -> Communicator | None: ...
    def group(self, ranks: Sequence[int]) -> Communicator | None: ...
    def group_of_members(self, ranks: Sequence[int], nonce: int) -> Communicator: ...
    def split_by_host(self) -> Communicator: ...

def new_token() -> str:
    """A fresh random job token (64 hex digits)."""

def shutdown(grace: float = 2.0) -> None:
    """Ends every communicator's threads (``atexit``)."""
