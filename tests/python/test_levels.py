"""The two-level exchange (``topology``) through the Python package: CPU ranks over gloo, nodes
emulated with ``CFC_NODE``, in CI. The schedule itself is tested in ``src/engine/tests/levels.rs``;
here, whole DDP jobs and AllReducer calls, the bytes between nodes, the choice of topology and
checkpoints moved between topologies."""

import os

import pytest
import torch
import torch.distributed as dist

import cfc
from cfc import CfcState
from conftest import spawn_scenario_results
from test_ddp import make, train

DEV = torch.device("cpu")  # set in each worker process


def _place(rank, per_node):
    os.environ["CFC_NODE"] = f"node{rank // per_node}"


def ddp_two_nodes(rank, world, out):
    """2 nodes of 2: plain, flat and two-level DDP train alike; two-level sends fewer bytes
    between nodes; its checkpoint loads into a flat state, which trains on."""
    _place(rank, 2)
    steps = 24
    ddp, opt = make()
    plain = train(ddp, opt, rank, steps + 6)
    result = {"rank": rank, "plain": plain[steps - 1], "plain_end": plain[-1]}
    for topology in ("flat", "two-level"):
        state = CfcState(topology=topology, min_compress_numel=0, warmup_steps=1)
        ddp, opt = make(state)
        losses = train(ddp, opt, rank, steps)
        s = state.stats()
        result[topology] = {"loss": losses[-1], "levels": state.levels, "between": s["between_nodes"],
                            "inside": s["inside_node"], "sent": s["bytes_sent"],
                            "compressed": s["compressed_buckets"], "ratio_between": s["ratio_between_nodes"]}
        if topology == "two-level":
            sd = state.state_dict()
            result["saved_levels"] = sd["engine"]["levels"]
            flat = CfcState(topology="flat", min_compress_numel=0, warmup_steps=1)
            ddp2, opt2 = make(flat)
            ddp2.load_state_dict(ddp.state_dict())
            opt2.load_state_dict(opt.state_dict())
            flat.load_state_dict(sd)
            more = train(ddp2, opt2, rank, 6, start=steps)
            result["resumed"] = {"loss": more[-1], "levels": flat.levels}
    out.put(result)


def allreducer_three_nodes(rank, world, out):
    """3 nodes of 2: AllReducer's first call (zero residuals) is within the bound of the exact
    average, the same on every rank; odd sizes leave a tail that goes plain."""
    _place(rank, 2)
    eps = 1e-3
    reducer = cfc.distributed.AllReducer(CfcState(eps=eps, topology="two-level", min_compress_numel=0))
    g = torch.Generator().manual_seed(rank)
    worst = 0.0
    for n in (50_001, 4096, 7):
        x = torch.randn(n, generator=g) * 0.01
        exact = x.double()
        dist.all_reduce(exact)
        exact /= world
        y = reducer(x.clone()).wait()
        worst = max(worst, (y.double() - exact).abs().max().item())
        everyone = [torch.empty_like(y) for _ in range(world)]
        dist.all_gather(everyone, y)
        assert all(torch.equal(e, y) for e in everyone)
    out.put({"rank": rank, "worst": worst, "eps": eps, "levels": reducer.state.levels})
    reducer.close()


def unequal_nodes(rank, world, out):
    """Nodes of 2 and 1 ranks: "two-level" is refused on every rank, with the sizes named;
    "auto" runs flat."""
    os.environ["CFC_NODE"] = "a" if rank < 2 else "b"
    x = torch.ones(40_000)
    auto = cfc.distributed.AllReducer(CfcState(eps=1e-3, min_compress_numel=0))
    auto(x.clone()).wait()
    result = {"auto_levels": auto.state.levels}
    auto.close()
    forced = cfc.distributed.AllReducer(CfcState(eps=1e-3, topology="two-level", min_compress_numel=0))
    try:
        forced(x.clone()).wait()
        result["error"] = None
    except Exception as e:  # noqa: BLE001 - the message is what is checked
        result["error"] = str(e)
    forced.close()
    out.put(result)


SCENARIOS = {"ddp_two_nodes": ddp_two_nodes, "allreducer_three_nodes": allreducer_three_nodes,
             "unequal_nodes": unequal_nodes}


def test_ddp_over_two_nodes_of_two(tmp_path):
    got = spawn_scenario_results(tmp_path, "test_levels", "ddp_two_nodes", 4)
    assert len(got) == 4
    for r in got:
        flat, two = r["flat"], r["two-level"]
        assert flat["levels"] is None
        assert two["levels"] == {"nodes": 2, "per_node": 2, "node": r["rank"] // 2, "local": r["rank"] % 2}
        assert two["compressed"] > 0
        # within a few percent of plain all-reduce's loss, either way
        for loss in (flat["loss"], two["loss"]):
            assert abs(loss - r["plain"]) <= 0.05 * r["plain"] + 0.02, r
        assert abs(r["resumed"]["loss"] - r["plain_end"]) <= 0.05 * r["plain_end"] + 0.02, r
        assert r["saved_levels"] == (2, 2) or r["saved_levels"] == [2, 2]
        assert r["resumed"]["levels"] is None
        assert two["inside"] > 0 and two["between"] + two["inside"] == two["sent"]
    # each node sends about half the flat exchange's bytes to the other (G = 2)
    flat_out = sum(r["flat"]["between"] for r in got)
    two_out = sum(r["two-level"]["between"] for r in got)
    assert two_out < 0.75 * flat_out, (two_out, flat_out)
    # and the saving on that link, against a float32 ring's, says so
    for r in got:
        assert r["two-level"]["ratio_between"] > 1.5 * r["flat"]["ratio_between"] > 1.5, r


def test_allreducer_over_three_nodes_stays_within_the_bound(tmp_path):
    got = spawn_scenario_results(tmp_path, "test_levels", "allreducer_three_nodes", 6)
    assert len(got) == 6
    for r in got:
        assert r["levels"]["nodes"] == 3 and r["levels"]["per_node"] == 2
        assert r["worst"] <= r["eps"] * 1.001, r


def test_nodes_of_different_sizes(tmp_path):
    got = spawn_scenario_results(tmp_path, "test_levels", "unequal_nodes", 3)
    assert len(got) == 3
    for r in got:
        assert r["auto_levels"] is None
        assert r["error"] is not None and "[2, 1]" in r["error"] and "flat" in r["error"], r


def test_the_topology_option_is_checked():
    with pytest.raises(ValueError, match="topology must be"):
        CfcState(topology="ring")
    assert CfcState(topology="two-level").topology == "two-level"
    assert "topology='flat'" in repr(CfcState(topology="flat"))
