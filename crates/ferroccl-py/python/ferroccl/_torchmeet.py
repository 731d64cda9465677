"""How the ranks of a ``ferroccl.torch`` group meet: on the store torch hands the
backend (rank 0 publishes the job's token, identity and ferroccl's store address there),
and, for ``new_group``, the members' check that they were given the same members."""

from __future__ import annotations

import collections
import hashlib
import json
import os
import socket
import time
from datetime import timedelta

import torch.distributed as dist

from . import Communicator, InvalidArgumentError, MismatchError
from . import TimeoutError as FerrocclTimeout

# How many groups of each list of members this rank made (``_nonce``), since the
# default group was made.
_NONCES: dict = collections.Counter()


def _advertise() -> str:
    for var in ("FERROCCL_ADVERTISE_ADDR", "MASTER_ADDR"):
        v = os.environ.get(var, "").strip()
        if v:
            return v
    return socket.gethostname()


def _attempt(store):
    """``store`` as this attempt of the job sees it. torchrun restarts every worker of
    a job that lost one (``--max-restarts``) on the same store, where the keys the
    last attempt left are still set: read as this attempt's, they send a restarted
    rank to a dead one's address (gloo's restarted ranks fail so). ferroccl's keys go
    under the attempt's number (``TORCHELASTIC_RESTART_COUNT``, the same on every
    worker of an attempt)."""
    n = os.environ.get("TORCHELASTIC_RESTART_COUNT", "").strip()
    return dist.PrefixStore(f"ferroccl-attempt-{n}/", store) if n else store


def _get(store, key: str, timeout: timedelta) -> bytes:
    store.wait([key], timeout)
    return bytes(store.get(key))


def _meet(
    store, rank: int, size: int, timeout: timedelta, transport: str | None = None
) -> Communicator:
    """A fresh communicator meeting on ``store``: rank 0 publishes the job's token and
    identity there (``FERROCCL_TOKEN`` when set), and ferroccl's store address. Its
    transport is ``FERROCCL_TRANSPORT``'s, or ``transport``."""
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
        transport=transport,
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
    world = _attempt(dist.distributed_c10d._get_default_store())
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


def _split(pg, ranks: list[int], name: str):
    """This rank's share of ``pg.split_group(ranks)``: ferroccl's ``split`` over the
    group, the color a hash of the list itself, each member keyed by its place in it.
    Members given different lists thus never form one child: a child that is not the
    list this rank was given (a member passed another, or none) is a
    :class:`ferroccl.MismatchError` naming the list, on each rank it reaches. A list that
    is no split of the group (a rank twice or out of range) is refused, after this
    rank took part as a non-member so that the others are not left waiting."""
    me, size = pg.rank(), pg.size()
    bad = len(set(ranks)) != len(ranks) or any(not 0 <= r < size for r in ranks)
    member = me in ranks and not bad
    color = None
    if member:
        digest = hashlib.sha256(json.dumps(ranks).encode()).digest()
        color = int.from_bytes(digest[:4], "little")
    child = pg.comm.split(color, ranks.index(me) if member else 0)
    if bad:
        raise InvalidArgumentError(
            f"split_group{' ' + name if name else ''}: {ranks} is no split of a group of "
            f"{size} ranks (a rank twice or out of range)"
        )
    if child is None:
        return None
    if child.world_size != len(ranks) or child.rank != ranks.index(me):
        child.close()
        raise MismatchError(
            f"rank {me} of the group: split_group was given the child {ranks}, but "
            f"{child.world_size} rank(s) of the group gave that list: the ranks passed "
            "different splits"
        )
    return child
