"""The torch.distributed backend, on 1-4 ranks as processes."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed")

import ranks


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_every_collective_every_dtype_matches_its_definition(n):
    assert all(r > 0 for r in ranks.run(n, "collectives", timeout=180))


def test_env_init_and_the_plain_package_under_a_launcher_environment():
    assert ranks.run(2, "plain_numpy", init="env") == ["ok", "ok"]


def test_tcp_init_method():
    port = ranks.free_port()
    assert ranks.run(2, "collectives", init="tcp", env={"TEST_PORT": str(port)}, timeout=180)


@pytest.mark.parametrize("n", [2, 4])
def test_ddp_replicas_are_bitwise_equal_and_match_gloo(n):
    res = ranks.run(n, "ddp", timeout=240)
    for backend in ("ferroccl", "gloo"):
        _, params0, _ = res[0][backend]
        for r in range(1, n):
            _, params, _ = res[r][backend]
            assert torch.equal(params, params0), f"{backend}: rank {r}'s parameters differ"
    ours, theirs = res[0]["ferroccl"], res[0]["gloo"]
    rel = ((ours[1] - theirs[1]).abs().max() / theirs[1].abs().max()).item()
    assert rel <= 1e-6, f"ferroccl and gloo end {rel:.3g} apart (relative)"
    for a, b in zip(ours[0], theirs[0]):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), (ours[0], theirs[0])


def test_new_group_of_two_of_four():
    assert ranks.run(4, "subgroups") == ["ok"] * 4


@pytest.mark.parametrize("n", [2, 3])
def test_mismatched_call_raises_mismatch_on_every_rank(n):
    res = ranks.run(n, "mismatch")
    for r, got in enumerate(res):
        assert got["type"] == "MismatchError", (r, got)
        assert "mismatched collective" in got["msg"], (r, got)
        assert got["root"] == "Mismatch", (r, got)


def test_a_rank_killed_mid_training_makes_every_other_rank_raise_naming_it():
    n = 3
    res = ranks.run(n, "killed", allow_fail={n - 1}, timeout=120)
    assert res[n - 1] is None
    for r in range(n - 1):
        got = res[r]
        assert got["type"] not in (None,), (r, got)
        assert f"rank {n - 1}" in got["msg"], (r, got)
        assert got["after"] < 20 + 10, (r, got)


def test_unsupported_types_and_ops_are_typed_errors_naming_them():
    res = ranks.run(2, "misuse")
    for got in res:
        assert got["int8"][0] == "UnsupportedError" and "int8" in got["int8"][1]
        assert got["bool"][0] == "UnsupportedError" and "bool" in got["bool"][1]
        assert got["band"][0] == "UnsupportedError" and "BAND" in got["band"][1]
        assert got["avg_int"][0] == "UnsupportedError", got["avg_int"]


def test_wait_honours_its_timeout_and_the_operation_goes_on():
    res = ranks.run(2, "wait_timeout")
    assert "not done after 0.2 s" in res[0]["early"], res[0]
    assert res[0]["value"] == res[1]["value"] == [2.0] * 4


@pytest.mark.parametrize("n", [2, 3])
def test_a_rank_exiting_during_ddp_makes_the_others_raise_naming_it_not_crash(n):
    res = ranks.run(n, "ddp_peer_exits", allow_fail={n - 1}, timeout=120)
    assert res[n - 1] is None
    for r in range(n - 1):
        got = res[r]
        assert got["type"] is not None, (r, got)
        assert f"rank {n - 1}" in got["msg"], (r, got)
        assert any(k in got["msg"] for k in ("PeerClosedError", "PeerFailedError")), got
        assert got["after"] < 20 + 10, (r, got)


def test_a_mismatch_inside_a_ddp_bucket_raises_on_every_rank():
    n = 2
    res = ranks.run(n, "ddp_mismatch", timeout=120)
    for r, got in enumerate(res):
        assert got["type"] is not None, (r, got)
        assert "MismatchError" in got["msg"] or got["type"] == "MismatchError", (r, got)
        assert "mismatched collective" in got["msg"], (r, got)


def test_power_sgd_hook_trains_as_over_gloo():
    n = 2
    res = ranks.run(n, "power_sgd", timeout=180)
    for r in range(n):
        (ours, p_ours), (theirs, p_theirs) = res[r]["ferroccl"], res[r]["gloo"]
        assert len(ours) == 20
        assert max(abs(a - b) for a, b in zip(ours, theirs)) <= 1e-6, (ours, theirs)
        assert (p_ours - p_theirs).abs().max().item() <= 1e-6
    assert torch.equal(res[0]["ferroccl"][1], res[1]["ferroccl"][1])


def test_groups_carry_what_torch_reads_as_gloos_do():
    res = ranks.run(2, "torch_facts")
    for got in res:
        assert got["ferroccl"]["backend"] == "ferroccl", got
        assert got["ferroccl"]["cpu"] and got["gloo"]["cpu"] and got["sub"]["cpu"], got
        if got["gloo"]["name"] is not None:  # torch 2.x names its groups
            assert isinstance(got["ferroccl"]["name"], str), got
            assert got["sub"]["name"] not in (None, got["ferroccl"]["name"]), got
        assert got["sub_sum"] == [2.0] * 3


def test_blocking_calls_make_no_work_that_torch_would_drop():
    """torch 2.x's blocking functions take None from a call that is over (half a
    microsecond of a small call's binding, `_torchwork._none_ok`); 1.13's wait on the
    Work unguarded, and a direct call of the group's method always gets a Work."""
    import torch.distributed as dist

    res = ranks.run(2, "sync_calls")
    torch2 = hasattr(dist.AllreduceOptions(), "asyncOp")
    for got in res:
        want = 3.0 * 2**9  # 1 + 2, doubled by each of the nine calls after the first
        assert got["sum"] == want, got
        made, waited, same, after = got["direct"]
        assert (made, waited, same, after) == (1, True, True, 2 * want), got
        if torch2:
            assert {"all_reduce", "barrier"} <= set(got["guarded"]), got
            assert got["by_dist"] == 0, got
        else:
            assert got["guarded"] == [] and got["by_dist"] == 11, got


RESTARTED = """
import datetime, os, sys
import ferroccl.torch
import torch, torch.distributed as dist

dist.init_process_group("ferroccl", timeout=datetime.timedelta(seconds=30))
r, attempt = dist.get_rank(), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
t = torch.ones(4) * (r + 1)
for step in range(5):
    dist.all_reduce(t)
    if attempt == 0 and r == 1 and step == 2:
        os._exit(3)
g = dist.new_group([1, 0])
u = torch.ones(1)
dist.all_reduce(u, group=g)
print(f"rank {r} attempt {attempt}: {t[0].item()} {u.item()}", flush=True)
dist.destroy_process_group()
"""


def test_torchrun_restarts_a_job_that_lost_a_rank_on_the_same_store(tmp_path):
    """torchrun --max-restarts starts every worker again on the store of the attempt
    that failed, its keys still set: the restarted ranks meet as this attempt's, not at
    the dead ones' addresses (gloo's restarted ranks do, on torch 2.15)."""
    import subprocess
    import sys

    from torch.distributed.elastic.multiprocessing.api import Std

    if Std.from_str("0") is None:
        pytest.skip("this torch's torchrun cannot start on this Python (1.13 on 3.11)")
    script = tmp_path / "restarted.py"
    script.write_text(RESTARTED)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    cmd += ["--max_restarts", "1", "--master_port", str(ranks.free_port()), str(script)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=150, check=False)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    for r in range(2):
        assert f"rank {r} attempt 1: 48.0 2.0" in out, out[-4000:]
