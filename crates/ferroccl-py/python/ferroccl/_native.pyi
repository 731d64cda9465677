"""Types of ``ferroccl._native``, the extension module (``crates/ferroccl-py/src``).

The package ``ferroccl`` wraps it; buffers cross as ``(address, elements, dtype)``
tuples that ``ferroccl.buffer`` checked, and non-blocking operations report by calling
``callback(None | exception)`` once, under the GIL, on a thread of the communicator's.
"""

from collections.abc import Callable, Sequence
from typing import Any, final

from typing_extensions import TypeAlias

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
    "Ticket",
    "TimeoutError",
    "UnsupportedError",
    "__version__",
    "new_token",
    "shutdown",
]
__version__: str

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
    def abort(self) -> None: ...
    def close(self) -> None: ...
    def poisoned(self) -> str | None: ...
    def dump_trace(self, dir: str) -> str: ...
    def all_reduce(
        self, buf: _RawBuf, op: str, callback: _Callback | None = None
    ) -> Ticket | None: ...
    def broadcast(
        self, buf: _RawBuf, root: int, callback: _Callback | None = None
    ) -> Ticket | None: ...
    def reduce(
        self, buf: _RawBuf, op: str, root: int, callback: _Callback | None = None
    ) -> Ticket | None: ...
    def all_gather(
        self, send: _RawBuf, recv: _RawBuf, callback: _Callback | None = None
    ) -> Ticket | None: ...
    def reduce_scatter(
        self, send: _RawBuf, recv: _RawBuf, op: str, callback: _Callback | None = None
    ) -> Ticket | None: ...
    def all_to_all(
        self,
        send: _RawBuf,
        recv: _RawBuf,
        send_counts: Sequence[int] | None = None,
        recv_counts: Sequence[int] | None = None,
        callback: _Callback | None = None,
    ) -> Ticket | None: ...
    def gather(
        self, send: _RawBuf, recv: _RawBuf, root: int, callback: _Callback | None = None
    ) -> Ticket | None: ...
    def scatter(
        self, send: _RawBuf, recv: _RawBuf, root: int, callback: _Callback | None = None
    ) -> Ticket | None: ...
    def barrier(self, callback: _Callback | None = None) -> Ticket | None: ...
    def send(
        self, buf: _RawBuf, peer: int, tag: int = 0, callback: _Callback | None = None
    ) -> Ticket | None: ...
    def recv(
        self, buf: _RawBuf, peer: int, tag: int = 0, callback: _Callback | None = None
    ) -> Ticket | None: ...
    def split(self, color: int | None, key: int = 0) -> Communicator | None: ...
    def group(self, ranks: Sequence[int]) -> Communicator | None: ...
    def group_of_members(self, ranks: Sequence[int], nonce: int) -> Communicator: ...
    def split_by_host(self) -> Communicator: ...

def new_token() -> str:
    """A fresh random job token (64 hex digits)."""

def shutdown(grace: float = 2.0) -> None:
    """Ends every communicator's threads (``atexit``)."""
