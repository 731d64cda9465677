"""The package on its own: numpy arrays, ranks as threads, typed errors."""

import threading

import ferroccl
import numpy as np
import pytest

DTYPES = ["float32", "float64", "float16", "int32", "int64", "uint8"]


def on_threads(n, fn):
    comms = ferroccl.Communicator.local_group(n)
    out, errs = [None] * n, []

    def body(c):
        try:
            out[c.rank] = fn(c)
        except BaseException as e:  # noqa: BLE001
            errs.append(e)

    ts = [threading.Thread(target=body, args=(c,)) for c in comms]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
        assert not t.is_alive(), "a rank hung"
    for c in comms:
        c.close()
    if errs:
        raise errs[0]
    return out


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_collectives_on_threads_match_their_definition(n, dtype):
    def rank(c):
        r = c.rank
        mine = lambda q: (np.arange(8) * 3 + q) % 5 + 1
        x = mine(r).astype(dtype)
        c.all_reduce(x)
        assert (x == sum(mine(q) for q in range(n)).astype(dtype)).all()
        x = mine(r).astype(dtype)
        c.all_reduce(x, op="max")
        assert (x == np.max([mine(q) for q in range(n)], 0).astype(dtype)).all()
        g = np.zeros(8 * n, dtype=dtype)
        c.all_gather(mine(r).astype(dtype), g)
        assert (g == np.concatenate([mine(q) for q in range(n)]).astype(dtype)).all()
        b = mine(r).astype(dtype)
        c.broadcast(b, root=n - 1)
        assert (b == mine(n - 1).astype(dtype)).all()
        s = np.zeros(8 * n, dtype=dtype)
        c.all_to_all(np.repeat(np.arange(n) + 10 * r, 8).astype(dtype), s)
        assert (s == np.repeat(np.arange(n) * 10 + r, 8).astype(dtype)).all()
        w = c.all_reduce(np.ones(3, dtype=dtype), async_op=True)
        w.wait(10)
        assert w.is_completed() and w.exception() is None
        return True

    assert on_threads(n, rank) == [True] * n


def test_mismatched_sizes_raise_mismatch_on_every_rank():
    def rank(c):
        with pytest.raises(ferroccl.MismatchError) as e:
            c.all_reduce(np.ones(4 if c.rank == 0 else 8, dtype=np.float32))
        assert "mismatched collective" in str(e.value)
        # The communicator is poisoned: later calls say why.
        with pytest.raises(ferroccl.PoisonedError):
            c.all_reduce(np.ones(4, dtype=np.float32))
        return True

    assert on_threads(2, rank) == [True, True]


def test_bad_buffers_are_refused_before_any_traffic():
    (c,) = ferroccl.Communicator.local_group(1)
    with pytest.raises(ferroccl.UnsupportedError, match="int8"):
        c.all_reduce(np.ones(3, dtype=np.int8))
    with pytest.raises(ferroccl.InvalidArgumentError, match="contiguous"):
        c.all_reduce(np.ones((4, 4), dtype=np.float32)[:, 1])
    ro = np.ones(3, dtype=np.float32)
    ro.flags.writeable = False
    with pytest.raises(ferroccl.InvalidArgumentError, match="read-only"):
        c.all_reduce(ro)
    with pytest.raises(ferroccl.UnsupportedError, match="bxor"):
        c.all_reduce(np.ones(3, dtype=np.float32), op="bxor")
    # A float32 in the other byte order would be summed as garbage; dtypes that share
    # a supported one's letter code (datetimes of other units) are no float32 either.
    swapped = ">f4" if np.little_endian else "<f4"
    with pytest.raises(ferroccl.UnsupportedError, match="byte order"):
        c.all_reduce(np.ones(3, dtype=swapped))
    with pytest.raises(ferroccl.UnsupportedError, match="datetime64"):
        c.all_reduce(np.zeros(3, dtype="M8[s]"))
    # The checks above happen before the communicator sees the call: it still works.
    x = np.ones(3, dtype=np.float32)
    c.all_reduce(x)
    assert (x == 1).all()
    # A refusal by the communicator poisons it, as in Rust (its peers would wait).
    with pytest.raises(ferroccl.InvalidArgumentError, match="world_size"):
        c.all_gather(np.ones(3, dtype=np.float32), np.ones(5, dtype=np.float32))
    with pytest.raises(ferroccl.PoisonedError, match="refused a call"):
        c.all_reduce(x)
    c.close()
    with pytest.raises(ferroccl.PoisonedError, match="closed"):
        c.all_reduce(x)


def test_wait_honours_its_timeout_and_errors_are_ferroccl_errors():
    comms = ferroccl.Communicator.local_group(2)
    # Rank 1 never joins: the wait times out, the operation goes on; abort ends it.
    w = comms[0].all_reduce(np.ones(4, dtype=np.float32), async_op=True)
    with pytest.raises(ferroccl.TimeoutError, match="not done after 0.2 s"):
        w.wait(0.2)
    # Timeouts Python can spell that are not durations do not crash the binding.
    assert not w._ticket.wait(float("nan")) and not w._ticket.wait(-1.0)
    comms[0].abort()
    with pytest.raises(ferroccl.AbortedError) as e:
        w.wait(10)
    assert isinstance(e.value, ferroccl.FerrocclError) and e.value.kind == "Aborted"
    for c in comms:
        c.close()


def test_split_and_group_make_children():
    def rank(c):
        half = c.split(c.rank % 2, key=-c.rank)
        x = np.array([c.rank], dtype=np.int64)
        half.all_reduce(x)
        assert x[0] == sum(q for q in range(4) if q % 2 == c.rank % 2)
        assert half.rank == (1 - c.rank // 2)  # ordered by key = -rank
        g = c.group([3, 0])
        assert (g is None) == (c.rank in (1, 2))
        if g is not None:
            assert g.job_ranks == [3, 0] and g.id != 0
        return True

    assert on_threads(4, rank) == [True] * 4


def test_a_callback_may_issue_collectives_and_wait_for_them():
    """What DDP's PowerSGD hook does: a completion callback that all-reduces again and
    blocks on it. Callbacks run off the communicator's executor, so the queue goes on
    (the worker used to run them under the communicator's lock, and hung here)."""

    def rank(c):
        n = c.native
        got = {}
        done = threading.Event()
        a = np.full(4, c.rank + 1, dtype=np.float32)
        b = np.full(4, 10.0 * (c.rank + 1), dtype=np.float32)
        d = np.full(4, 100.0 * (c.rank + 1), dtype=np.float32)

        def second(_err):  # a callback of a callback, on its own thread
            got["d"] = d.copy()
            done.set()

        def first(err):
            got["err"] = err
            n.all_reduce(ferroccl.buffer(b), "sum", None)  # blocking, from a callback
            got["b"] = b.copy()
            # non-blocking, then waited for, from a callback
            n.all_reduce(ferroccl.buffer(d), "sum", second).wait()

        n.all_reduce(ferroccl.buffer(a), "sum", first)
        assert done.wait(20), "a callback's collectives never ran"
        assert got["err"] is None and (a == 3).all()
        assert (got["b"] == 30).all() and (got["d"] == 300).all()
        return True

    assert on_threads(2, rank) == [True, True]
