"""PyTorch 2.x's mesh-based parallelism over the backend, each against gloo in the same
test: FSDP2, tensor parallel, a 2 x 2 mesh, pipelining; and what torch builds on a
mesh (DeviceMesh, monitored_barrier, async checkpoints). Skipped on torch 1.13 (CI
runs them under a torch 2.x: see tests/python.rs)."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed")

pytest.importorskip("torch.distributed.device_mesh", reason="torch 1.x has no DeviceMesh")

import ranks

TOL = 1e-6


def both(n, fn, *args, timeout=240):
    """``fn`` over ferroccl and over gloo, by rank."""
    return {
        b: ranks.run(n, fn, b, *args, module="parallel", timeout=timeout)
        for b in ("ferroccl", "gloo")
    }


def assert_close(ours, theirs, what):
    (l1, p1), (l2, p2) = ours, theirs
    assert len(l1) == len(l2) > 0, what
    gap = max(abs(a - b) for a, b in zip(l1, l2))
    assert gap <= TOL, f"{what}: losses {gap:.3g} apart: {l1} vs {l2}"
    for a, b in zip(p1, p2):
        assert a.shape == b.shape, what
        d = (a - b).abs().max().item()
        assert d <= TOL, f"{what}: parameters {d:.3g} apart"


def test_fsdp2_trains_as_over_gloo():
    res = both(2, "fsdp2")
    for r in range(2):
        assert_close(res["ferroccl"][r], res["gloo"][r], f"FSDP2 rank {r}")
    assert res["ferroccl"][0][0] == res["ferroccl"][1][0], "the ranks' mean losses differ"


def test_tensor_parallel_trains_as_over_gloo():
    res = both(2, "tensor_parallel")
    for r in range(2):
        assert_close(res["ferroccl"][r], res["gloo"][r], f"tensor parallel rank {r}")


def test_a_2x2_mesh_of_data_and_tensor_parallel_trains_as_over_gloo():
    res = both(4, "mesh_2d", timeout=300)
    for r in range(4):
        assert_close(res["ferroccl"][r], res["gloo"][r], f"2 x 2 mesh rank {r}")


def per_edge_p2p() -> bool:
    """Whether this torch can put each direction between pipeline stages on a group
    of its own (``torch.distributed.config.pipeline_per_edge_p2p``)."""
    try:
        from torch.distributed import config
    except ImportError:
        return False
    return hasattr(config, "pipeline_per_edge_p2p")


@pytest.mark.parametrize("schedule,per_edge", [("gpipe", False), ("1f1b", False), ("1f1b", True)])
def test_pipelining_trains_as_over_gloo(schedule, per_edge):
    if per_edge and not per_edge_p2p():
        pytest.skip("this torch has no per-edge pipeline groups")
    res = both(2, "pipelining", schedule, per_edge)
    for r in range(2):
        ours, theirs = res["ferroccl"][r], res["gloo"][r]
        if r == 1:
            assert_close(ours, theirs, f"{schedule} last stage")
        for a, b in zip(ours[1], theirs[1]):
            assert (a - b).abs().max().item() <= TOL, f"{schedule} stage {r}"


def test_device_mesh_monitored_barrier_and_async_save_work():
    res = ranks.run(4, "mesh_facts", module="parallel", timeout=180)
    for r, got in enumerate(res):
        assert got["b_sum"] == 2.0, got
        assert all(isinstance(x, str) for x in got["names"]), got
        # A plain tensor is saved as replicated: rank 0's, loaded on every rank.
        assert got["loaded"] == [0.0, 1.0, 2.0, 3.0], got


def test_monitored_barrier_names_the_rank_that_did_not_come():
    import parallel

    if not parallel.monitored_barrier_is_open():
        pytest.skip("this torch serves monitored_barrier from gloo only")
    res = ranks.run(3, "monitored_barrier_late", module="parallel", timeout=60)
    got = res[0]
    assert got["type"] is not None, got
    assert "rank 2 did not reach it" in got["msg"], got
    assert got["after"] < 2 + 5, got


def test_a_mesh_laid_out_differently_on_each_rank_is_a_mismatch_not_a_hang():
    res = ranks.run(4, "mesh_disagrees", module="parallel", timeout=120)
    for r, got in enumerate(res):
        assert got["type"] == "MismatchError", (r, got)
        assert "mismatched new group" in got["msg"], (r, got)
        assert got["after"] < 30, (r, got)


@pytest.mark.parametrize("route", ["process-group", "backend"])
def test_both_routes_into_torch_run_the_mesh_and_the_barrier(route):
    """FERROCCL_TORCH_CLASS: ferroccl's class is torch's ProcessGroup by default, a
    Backend under torch's own ProcessGroup when asked where torch has Python backends;
    DeviceMesh, monitored_barrier and async checkpoints work either way."""
    from ferroccl.torch import _python_backends

    env = {"FERROCCL_TORCH_CLASS": route}
    res = ranks.run(2, "class_route", module="parallel", timeout=120, env=env)
    want_ours = route == "process-group" or not _python_backends()
    for got in res:
        assert got["is_ours"] == want_ours, (route, got)
        assert got["sum"] == [3.0] * 4, got
    res = ranks.run(4, "mesh_facts", module="parallel", timeout=180, env=env)
    for got in res:
        assert got["b_sum"] == 2.0 and got["loaded"] == [0.0, 1.0, 2.0, 3.0], (route, got)


def test_an_unknown_route_is_refused_by_name():
    import subprocess
    import sys

    code = "import ferroccl.torch"
    env = dict(__import__("os").environ, FERROCCL_TORCH_CLASS="pg")
    p = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode != 0
    assert "FERROCCL_TORCH_CLASS='pg'" in p.stderr and "process-group or backend" in p.stderr


def test_collectives_under_inference_mode_give_what_gloo_gives():
    # The copies into an inference tensor ran on the communicator's thread, outside
    # the caller's inference mode, and torch refused them.
    res = both(2, "inference_mode")
    for r in range(2):
        assert res["ferroccl"][r] == res["gloo"][r], f"rank {r}"


def split_group_exists() -> bool:
    return hasattr(torch.distributed, "split_group")


def test_split_group_makes_the_children_gloo_makes():
    if not split_group_exists():
        pytest.skip("this torch has no split_group")
    res = both(4, "split")
    assert res["ferroccl"] == res["gloo"], res
    by_rank = res["ferroccl"]
    assert [r["sum"] for r in by_rank] == [4.0, 6.0, 4.0, 6.0], by_rank
    assert [r["from_first"] for r in by_rank] == [0.0, 30.0, 0.0, 30.0], by_rank
    assert [r["rank"] for r in by_rank] == [0, 1, 1, 0], by_rank
    assert by_rank[3]["ranks"] == [3, 1] and by_rank[0]["ranks"] == [0, 2], by_rank
    assert [r["solo"] for r in by_rank] == [None, 0, 0, None], by_rank
    assert all(r["named"] for r in by_rank), by_rank


def test_ranks_given_different_splits_raise_mismatch_not_hang():
    if not split_group_exists():
        pytest.skip("this torch has no split_group")
    res = ranks.run(4, "split_disagrees", module="parallel", timeout=60)
    for r in (0, 1):
        assert res[r]["type"] == "MismatchError", res
        assert "different splits" in res[r]["msg"], res
        assert res[r]["after"] < 30, res
    for r in (2, 3):
        assert res[r]["type"] is None and res[r]["sum"] == 2.0, res


def test_torch_compile_over_ddp_and_c10d_calls_trains_as_over_gloo():
    res = both(2, "compiled")
    for r in range(2):
        (l1, p1, o1), (l2, p2, o2) = res["ferroccl"][r], res["gloo"][r]
        assert_close((l1, p1), (l2, p2), f"compiled DDP rank {r}")
        assert o1 == o2 == [7.0] * 4, (o1, o2)
