"""SwarmLoad.from_view: what the daemon's balancing loop judges."""


def test_a_view_becomes_the_load_the_balancer_judges() -> None:
    from types import SimpleNamespace as NS

    from swarmd.balancing.policy import SwarmLoad

    row0 = NS(stage=0, peers=[
        NS(peer_id="a", state="online", reason=None, throughput=10),
        NS(peer_id="b", state="syncing", reason="syncing", throughput=0),
        NS(peer_id="c", state="online", reason="other_model", throughput=99)])
    row1 = NS(stage=1, peers=[NS(peer_id="d", state="leaving", reason=None, throughput=3),
                              NS(peer_id="e", state="weird", reason=None, throughput=3)])
    load = SwarmLoad.from_view(2, NS(stages=[row0, row1]))
    # another model and an unknown state are left out; a leaving peer counts nowhere
    assert sorted(p.peer_id for p in load.peers()) == ["a", "b"]
    assert load.get("b").state == "joining" and "d" not in load
    assert load.served_totals() == [10.0, 0.0]
