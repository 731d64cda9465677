"""ferroccl's collectives from Python, without torch.distributed.

    torchrun --nproc_per_node 4 crates/ferroccl-py/examples/collectives.py
    ferroccl launch -n 4 -- python3 crates/ferroccl-py/examples/collectives.py

Every rank checks each result against its definition and exits non-zero on a mismatch.
"""

import ferroccl
import numpy as np


def main():
    comm = ferroccl.Communicator.from_env()
    r, n = comm.rank, comm.world_size

    x = np.full(1 << 20, r + 1, dtype=np.float32)  # 4 MiB
    comm.all_reduce(x)  # in place; the same bits on every rank
    assert (x == n * (n + 1) / 2).all()

    # Non-blocking: start two, compute, wait.
    a, b = np.full(1000, r, dtype=np.int64), np.full(10, r, dtype=np.float64)
    wa, wb = (
        comm.all_reduce(a, op="max", async_op=True),
        comm.all_reduce(b, async_op=True),
    )
    wa.wait()
    wb.wait()
    assert a[0] == n - 1 and b[0] == n * (n - 1) / 2

    # All-to-all: block q goes to rank q.
    send = np.repeat(np.arange(n) + 100 * r, 4).astype(np.int32)
    recv = np.empty_like(send)
    comm.all_to_all(send, recv)
    assert (recv == np.repeat(np.arange(n) * 100 + r, 4)).all()

    # Sub-communicators: even and odd ranks.
    half = comm.split(r % 2)
    y = np.array([r], dtype=np.int64)
    half.all_reduce(y)
    assert y[0] == sum(q for q in range(n) if q % 2 == r % 2)

    # Point-to-point around a ring, without ordering the sends by hand.
    right, left = (r + 1) % n, (r - 1) % n
    got = np.empty(8, dtype=np.float32)
    ws = [
        comm.send(np.full(8, r, dtype=np.float32), right, async_op=True),
        comm.recv(got, left, async_op=True),
    ]
    for w in ws:
        w.wait()
    assert (got == left).all()

    # A mistake is a typed error on every rank, not a hang or wrong numbers.
    try:
        comm.all_reduce(np.ones(4 if r == 0 else 8, dtype=np.float32))
    except ferroccl.MismatchError as e:
        if r == 0:
            print(f"as expected: {type(e).__name__}: {e}")
    if r == 0:
        print(f"rank 0 of {n} over {comm.transport}: every collective checked")


if __name__ == "__main__":
    main()
