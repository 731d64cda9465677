"""torch tensors and reduce ops as ferroccl's backend hands them to the communicator:
the ``(address, elements, dtype)`` of a tensor (at once on the hot path, else the
typed error naming what is wrong), copies in and out of non-contiguous ones, flat
views of several, and torch's ``ReduceOp`` as ferroccl's name."""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import InvalidArgumentError, UnsupportedError
from . import buffer as _buffer

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


# torch's ReduceOp and RedOpType hash to the RedOpType's value (1.13 to 2.15): the key
# of _OP_NAMES, read without the attribute lookups of the general path.
_OP_TYPES = frozenset({dist.ReduceOp, type(dist.ReduceOp.SUM)})


def _op_name(op) -> str:
    """ferroccl's name for a torch ``ReduceOp``."""
    if type(op) in _OP_TYPES:
        name = _OP_NAMES.get(hash(op))
        if name is not None:
            return name
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
    """A contiguous tensor for ``t`` (on its device, which the caller checked):
    itself, or a copy to copy back."""
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
    or CUDA tensor of a supported dtype (the hot path), else the typed error naming
    what is wrong (``ferroccl.buffer``'s for any other CPU buffer)."""
    name = _NAMES.get(t.dtype)
    if name is None or not t.is_contiguous() or not (t.is_cpu or t.is_cuda):
        if t.is_cuda:
            _refuse(t)
        return _buffer(t)
    return (t.data_ptr(), t.numel(), name)


def _cpu_raw(t: torch.Tensor):
    """``_raw(t)`` for what most calls hand over, a contiguous CPU tensor of a dtype
    ferroccl has (in one pass: a third of a microsecond less than the checks one by
    one); None for anything else, which takes the checked path."""
    name = _NAMES.get(t.dtype)
    if name is not None and t.is_cpu and t.is_contiguous():
        return (t.data_ptr(), t.numel(), name)
    return None


def _refuse(t: torch.Tensor, what: str = "buffer"):
    """The typed error for a CUDA tensor ferroccl cannot take as it is."""
    if t.dtype not in _NAMES:
        raise UnsupportedError(
            f"{what} has dtype {t.dtype}, which ferroccl does not support (it has "
            f"{', '.join(_NAMES.values())})"
        )
    raise InvalidArgumentError(f"{what} is not contiguous (call .contiguous())")


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
