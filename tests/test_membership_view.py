"""The membership view: announcements in, view, snapshots and pull pages out. Pure, no loop."""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import random

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarmd.errors import BadPullMessage
from swarmd.membership import (
    DOMAIN, Announcement, Limits, PeerState, PullPage, PullRequest, View, ViewConfig,
    decode_page, encode_page, encode_request, encode_signed,
)

NOW = 1_700_000_000.0
HASH = "5ca1ab1e0ddba11d"
CONFIG = ViewConfig(stages=3, model_hash=HASH)


def signer(pid: str):
    return lambda message: hmac.new(pid.encode(), message, hashlib.sha256).digest()


def verify(pid: str, message: bytes, signature: bytes) -> bool:
    return hmac.compare_digest(hmac.new(pid.encode(), message, hashlib.sha256).digest(), signature)


def pid(i: int) -> str:
    return f"12D3KooW{i:044d}"


def ann(i: int = 0, **changes) -> Announcement:
    base = dict(peer_id=pid(i), addrs=(f"/ip4/10.0.0.{i % 250}/tcp/31337",), stage=i % 3,
                state=PeerState.ONLINE, throughput=100.0 + i, queue=0, version="0.1.0",
                model_hash=HASH, timestamp=NOW, period=10.0)
    base.update(changes)
    return Announcement(**base)


def wire(a: Announcement) -> bytes:
    return encode_signed(a, signer(a.peer_id))


def view(*anns: Announcement, now: float = NOW, config: ViewConfig = CONFIG) -> View:
    v = View(config, verify)
    for a in anns:
        assert v.apply(wire(a), now).outcome in ("added", "updated", "removed", "tombstone")
    return v


def state_of(v: View, now: float) -> dict[str, tuple]:
    return {a.peer_id: (a.timestamp, a.state, a.stage, a.throughput)
            for a in v.announcements(now)}


# ----------------------------------------------------------------------------------- apply

def test_add_update_duplicate_stale_and_counts() -> None:
    v = View(CONFIG, verify)
    first, newer = wire(ann(0)), wire(ann(0, timestamp=NOW + 5, throughput=50.0))
    assert v.apply(first, NOW).outcome == "added"
    assert v.apply(first, NOW).outcome == "duplicate"
    assert v.apply(newer, NOW + 5).outcome == "updated"
    res = v.apply(first, NOW + 5)
    assert (res.outcome, res.reason) == ("dropped", "stale")
    assert v.get(pid(0)).throughput == 50.0 and len(v) == 1
    assert v.counts["added"] == v.counts["updated"] == v.counts["duplicate"] == 1
    assert v.dropped == {"stale": 1}


def _resign(a: Announcement, key_of: str) -> bytes:
    body = msgpack.unpackb(wire(a))[0]
    return msgpack.packb([body, signer(key_of)(DOMAIN + body)], use_bin_type=True)


@pytest.mark.parametrize("data, why", [
    (_resign(ann(1), "12D3KooWmallory"), "forged"),
    (msgpack.packb([msgpack.unpackb(wire(ann(1)))[0]], use_bin_type=True), "unsigned"),
    (b"\x92garbage", "malformed"),
    (b"x" * 2000, "oversized"),
    (wire(ann(1, timestamp=NOW + 600)), "future"),
    (wire(ann(1, timestamp=NOW - 4 * 3600)), "too_old"),
    (wire(ann(1, timestamp=NOW - 31, period=10.0)), "expired"),
])
def test_bad_announcements_are_dropped_and_counted(data: bytes, why: str) -> None:
    v = view(ann(0))
    before = state_of(v, NOW)
    res = v.apply(data, NOW)
    assert (res.outcome, res.reason) == ("dropped", why)
    assert v.dropped == {why: 1} and state_of(v, NOW) == before
    assert v.snapshot(NOW).dropped == {why: 1}


def test_too_frequent_versions_are_dropped_but_leaving_is_not() -> None:
    v = view(ann(0))
    assert v.apply(wire(ann(0, timestamp=NOW + 0.2)), NOW).reason == "too_frequent"
    assert v.apply(wire(ann(0, timestamp=NOW + 0.2, state=PeerState.LEAVING)),
                   NOW).outcome == "removed"


def test_conflicting_versions_with_one_timestamp_settle_on_the_same_bytes() -> None:
    a, b = wire(ann(0, queue=1)), wire(ann(0, queue=2))
    v1, v2 = View(CONFIG, verify), View(CONFIG, verify)
    for x in (a, b):
        v1.apply(x, NOW)
    for x in (b, a):
        v2.apply(x, NOW)
    assert v1.get(pid(0)) == v2.get(pid(0)) and v1.dropped == v2.dropped == {"conflict": 1}


def test_view_full() -> None:
    v = view(ann(0), ann(1), config=ViewConfig(stages=3, model_hash=HASH, max_peers=2))
    assert v.apply(wire(ann(2)), NOW).reason == "view_full"
    assert v.apply(wire(ann(1, timestamp=NOW + 1)), NOW + 1).outcome == "updated"


# ---------------------------------------------------------------------- routing and snapshot

def test_unknown_stage_model_hash_and_state_are_listed_but_not_routed() -> None:
    v = view(ann(0, stage=0), ann(1, stage=7), ann(2, stage=1, model_hash="other"),
             ann(3, stage=None), ann(4, stage=2, state=PeerState.JOINING),
             ann(5, stage=2, state=PeerState.MIGRATING), ann(6, stage=2, throughput=7.0))
    snap = v.snapshot(NOW)
    why = {p.peer_id: p.why_not for s in snap.stages for p in s.peers}
    why.update({p.peer_id: p.why_not for p in snap.other_peers})
    assert why == {pid(0): None, pid(1): "unknown_stage", pid(2): "model_hash_mismatch",
                   pid(3): "no_stage", pid(4): "joining", pid(5): "migrating", pid(6): None}
    assert snap.peers == 7 == len(v)
    assert [s.total_throughput for s in snap.stages] == [100.0, 0.0, 7.0]
    assert [s.routable_peers for s in snap.stages] == [1, 0, 1]
    assert (snap.bottleneck_stage, snap.bottleneck_throughput) == (1, 0.0)
    assert v.stage_totals(NOW) == [100.0, 0.0, 7.0]
    assert {p.peer_id for p in snap.other_peers} == {pid(1), pid(3)}
    assert v.why_not(pid(2), NOW) == "model_hash_mismatch" and v.why_not(pid(0), NOW) is None
    assert v.why_not(pid(99), NOW) == "not_listed"
    json.dumps(snap.to_dict())


def test_peers_of_another_manifest_are_listed_but_neither_routed_nor_counted() -> None:
    ours, theirs = "a" * 32, "b" * 32
    config = ViewConfig(stages=3, model_hash=HASH, manifest=ours)
    v = view(ann(0, stage=0, manifest=ours), ann(1, stage=0, manifest=theirs, step=3),
             ann(2, stage=1, manifest=""), config=config)  # "" says nothing: not compared
    assert v.why_not(pid(1), NOW) == "manifest_mismatch"
    assert v.why_not(pid(0), NOW) is None and v.why_not(pid(2), NOW) is None
    assert v.stage_totals(NOW) == [100.0, 102.0, 0.0]
    assert not v.stage_has_state(0, NOW, besides=pid(0))  # another manifest holds no state
    # a view without a manifest of its own compares none
    assert view(ann(1, stage=0, manifest=theirs)).why_not(pid(1), NOW) is None


def test_bottleneck_is_the_lowest_total_ties_to_the_lowest_stage() -> None:
    v = view(ann(0, stage=0, throughput=50.0), ann(1, stage=1, throughput=20.0),
             ann(2, stage=1, throughput=20.0), ann(3, stage=2, throughput=39.0))
    snap = v.snapshot(NOW)
    assert (snap.bottleneck_stage, snap.bottleneck_throughput) == (2, 39.0)
    tie = view(ann(0, stage=0, throughput=5.0), ann(1, stage=1, throughput=5.0),
               ann(2, stage=2, throughput=5.0)).snapshot(NOW)
    assert tie.bottleneck_stage == 0
    assert View(CONFIG, verify).snapshot(NOW).bottleneck_stage == 0


def test_overdue_entries_leave_routing_before_they_expire() -> None:
    v = view(ann(0, period=100.0), ann(1, period=1000.0))
    # one period + min(period, overdue_grace_s = 120 s) after signing
    assert v.why_not(pid(0), NOW + 199) is None and v.why_not(pid(0), NOW + 201) == "overdue"
    assert v.why_not(pid(1), NOW + 1119) is None and v.why_not(pid(1), NOW + 1121) == "overdue"
    assert v.stage_totals(NOW + 201) == [0.0, 101.0, 0.0]
    assert len(v.announcements(NOW + 201)) == 2


def test_lateness_delays_overdue_and_expiry_of_entries_accepted_after_it_was_set() -> None:
    """On a congested link announcements arrive seconds after they were signed: the service
    sets ``lateness_s`` from how long its pulls take, and a peer refreshing on time is
    neither overdue nor expired for it (without it, one signed 2 s periods ago arriving
    6 s late is dropped as expired on arrival)."""
    v = view(ann(0, period=2.0))
    assert v.why_not(pid(0), NOW + 4.5) == "overdue"
    late = ann(1, period=2.0)
    assert v.apply(wire(late), NOW + 6.5).reason == "expired"  # 3 periods old on arrival
    v.lateness_s = 8.0
    assert v.apply(wire(late), NOW + 6.5).outcome == "added"
    assert v.why_not(pid(1), NOW + 11.9) is None and v.why_not(pid(1), NOW + 12.1) == "overdue"
    assert v.why_not(pid(0), NOW + 4.5) == "overdue"  # accepted before: as it was
    assert v.peer_ids(NOW + 13.9) == [pid(1)]  # pid(0) expired at 6 s
    assert {a.peer_id for a in v.expire(NOW + 14.1)} == {pid(0), pid(1)}


def test_a_peer_heard_from_directly_stays_routable_a_period_past_the_last_contact() -> None:
    v = view(ann(0, period=2.0), ann(1, period=2.0, state=PeerState.LEAVING))
    assert v.heard_from(pid(0), NOW + 3.5)  # answered a hop of ours, its refresh still late
    assert v.why_not(pid(0), NOW + 5.4) is None and v.why_not(pid(0), NOW + 5.6) == "overdue"
    assert not v.heard_from(pid(0), NOW + 3.0)  # nothing newer: nothing moves
    assert v.expire(NOW + 7.0) == []  # would have expired at 6 s
    assert [a.peer_id for a in v.expire(NOW + 7.6)] == [pid(0)]  # two periods past contact
    assert not v.heard_from(pid(0), NOW + 8.0)  # gone: nothing to extend
    assert not v.heard_from(pid(1), NOW + 1.0)  # a tombstone stays one
    assert not v.heard_from(pid(7), NOW + 1.0)  # never listed


def test_a_stage_has_state_when_another_peer_serves_it_online_or_announces_a_step() -> None:
    me = pid(9)
    # a first peer of a new stage: nothing shows it (nor our own entry, nor other stages)
    assert not view().stage_has_state(1, NOW, besides=me)
    assert not view(ann(9, stage=1, step=5), ann(0, stage=0, step=5)).stage_has_state(
        1, NOW, besides=me)
    # fresh mates still syncing at step 0 hold nothing; another model's peers neither
    fresh = view(ann(1, stage=1, state=PeerState.SYNCING),
                 ann(4, stage=1, state=PeerState.JOINING),
                 ann(7, stage=1, model_hash="other", step=9))
    assert not fresh.stage_has_state(1, NOW, besides=me)
    # online (even overdue), or trained (step > 0) in any state: the stage has state
    overdue = view(ann(1, stage=1))
    assert overdue.why_not(pid(1), NOW + 25) == "overdue"
    assert overdue.stage_has_state(1, NOW + 25, besides=me)
    assert view(ann(1, stage=1, state=PeerState.SYNCING, step=3)).stage_has_state(
        1, NOW, besides=me)
    assert view(ann(1, stage=1, state=PeerState.MIGRATING, step=3)).stage_has_state(
        1, NOW, besides=me)
    # gone: expired or left
    assert not view(ann(1, stage=1)).stage_has_state(1, NOW + 30, besides=me)
    assert not view(ann(1, stage=1, state=PeerState.LEAVING, step=3)).stage_has_state(
        1, NOW, besides=me)


# -------------------------------------------------------------------------- expiry, leaving

@pytest.mark.parametrize("period", [2.0, 10.0, 1750.0])
def test_killed_peer_leaves_within_three_periods(period: float) -> None:
    v = view(ann(0, period=period), ann(1, period=period, timestamp=NOW + 1), now=NOW + 1)
    almost = NOW + 3 * period - 0.01
    assert pid(0) in v.peer_ids(almost) and v.expire(almost) == []
    gone = NOW + 3 * period
    assert pid(0) not in v.peer_ids(gone) and v.snapshot(gone).peers == 1
    assert [a.peer_id for a in v.expire(gone)] == [pid(0)]
    assert v.counts["expired"] == 1 and len(v) == 1


def test_declared_period_is_clamped() -> None:
    v = view(ann(0, period=0.01), ann(1, period=1e9))
    assert v.expire(NOW + 3 * CONFIG.min_period_s) == [ann(0, period=0.01)]
    assert [a.peer_id for a in v.expire(NOW + 3 * CONFIG.max_period_s)] == [pid(1)]


def test_leaving_removes_at_once_and_blocks_older_copies_until_it_expires() -> None:
    v = view(ann(0), ann(1))
    res = v.apply(wire(ann(0, timestamp=NOW + 1, state=PeerState.LEAVING)), NOW + 1)
    assert res.outcome == "removed"
    assert v.get(pid(0)) is None and pid(0) not in v.peer_ids(NOW + 1) and len(v) == 1
    assert v.snapshot(NOW + 1).peers == 1
    assert v.apply(wire(ann(0)), NOW + 2).reason == "stale"      # a copy still travelling
    assert v.apply(wire(ann(0, timestamp=NOW + 5)), NOW + 5).outcome == "added"  # came back
    tomb = view(ann(2, state=PeerState.LEAVING))
    assert len(tomb) == 0 and tomb.apply(wire(ann(2, timestamp=NOW - 1)), NOW).reason == "stale"
    assert tomb.expire(NOW + 30) == [] and tomb.apply(wire(ann(2, timestamp=NOW + 25)),
                                                      NOW + 30).outcome == "added"


def test_estimate_counts_live_peers_and_events() -> None:
    v = view(ann(0), ann(1, state=PeerState.JOINING))
    assert v.estimate(NOW).peers == 2
    v.apply(wire(ann(1, timestamp=NOW + 1)), NOW + 1)                       # joining -> online
    v.apply(wire(ann(0, timestamp=NOW + 2, stage=2)), NOW + 2)              # stage change
    v.apply(wire(ann(0, timestamp=NOW + 3, stage=2, throughput=1.0)), NOW + 3)  # refresh
    v.apply(wire(ann(1, timestamp=NOW + 4, state=PeerState.LEAVING)), NOW + 4)  # leave
    est = v.estimate(NOW + 4)
    assert est.peers == 1 and 150 < est.wire_bytes < 250
    assert est.events_per_s == pytest.approx(4 / CONFIG.event_horizon_s)
    assert v.estimate(NOW + 5 + CONFIG.event_horizon_s).events_per_s == 0.0


# ----------------------------------------------------------------------- order independence

def _history(rng: random.Random, peers: int) -> list[bytes]:
    """Honest announcement streams (versions >= min_gap apart) of a few peers, some leaving."""
    out = []
    for i in range(peers):
        t = NOW + rng.uniform(0, 5)
        for _ in range(rng.randrange(1, 5)):
            state = rng.choice([PeerState.JOINING, PeerState.ONLINE, PeerState.ONLINE,
                                PeerState.MIGRATING, PeerState.LEAVING])
            out.append(wire(ann(i, timestamp=t, state=state, stage=rng.choice([0, 1, 2, None]),
                                throughput=rng.uniform(0, 100), period=20.0)))
            t += rng.uniform(CONFIG.min_gap_s, 5)
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.randoms(use_true_random=False), st.integers(1, 6), st.data())
def test_any_interleaving_converges_to_the_same_view(rng: random.Random, peers: int,
                                                     data: st.DataObject) -> None:
    history = _history(rng, peers)
    order = data.draw(st.permutations(history))
    duplicates = data.draw(st.lists(st.sampled_from(history), max_size=10))
    when = NOW + 30
    a, b = View(CONFIG, verify), View(CONFIG, verify)
    for x in history:
        a.apply(x, when)
    for x in list(order) + duplicates:
        b.apply(x, when)
    assert state_of(a, when) == state_of(b, when)
    assert a.snapshot(when).to_dict() | {"counts": 0, "dropped": 0} == \
        b.snapshot(when).to_dict() | {"counts": 0, "dropped": 0}


# ------------------------------------------------------------------------------------ pull

def _pull_all(server: View, client: View, request: PullRequest, now: float) -> int:
    """Run one pull to the end over bytes, as the adapter would; returns the pages used."""
    pages = 0
    while True:
        page = server.handle_pull(encode_request(request), now)
        pages += 1
        assert len(page) <= server.config.limits.max_page_bytes
        _, cursor = client.apply_page(page, now)
        if cursor is None:
            return pages
        request = request.next_page(cursor)


@pytest.mark.parametrize("peers, page_bytes", [(1, 65536), (500, 65536), (3000, 65536),
                                              (300, 2048)])
def test_newcomer_gets_the_whole_view_in_a_bounded_number_of_pages(peers: int,
                                                                    page_bytes: int) -> None:
    limits = Limits(max_page_bytes=page_bytes)
    config = ViewConfig(stages=3, model_hash=HASH, limits=limits)
    server = view(*(ann(i, timestamp=NOW - i % 7) for i in range(peers)),
                  ann(peers, state=PeerState.LEAVING), config=config)
    client = View(config, verify)
    total = sum(len(e.wire) + 3 for e in server._entries.values())
    pages = _pull_all(server, client, client.pull_request(NOW, None), NOW)
    assert pages <= math.ceil(total / (page_bytes - 300)) + 1
    assert state_of(client, NOW) == state_of(server, NOW) and len(client) == peers
    assert client.apply(wire(ann(peers, timestamp=NOW - 1)), NOW).reason == "stale"


def test_delta_pull_sends_only_what_the_puller_lacks_since_the_cutoff() -> None:
    server = view(*(ann(i, timestamp=NOW + i) for i in range(10)), now=NOW + 10)
    client = view(*(ann(i, timestamp=NOW + i) for i in range(0, 10, 2)), now=NOW + 10)
    request = client.pull_request(NOW + 10, cutoff=NOW + 4)
    assert len(request.have) == 3                      # peers 4, 6, 8
    page = server.serve(request, NOW + 10)
    sent = {decode_page(encode_page(page), CONFIG.limits).entries[k]
            for k in range(len(page.entries))}
    assert sent == {wire(ann(i, timestamp=NOW + i)) for i in (5, 7, 9)}
    client.apply_page(encode_page(page), NOW + 10)
    assert server.serve(client.pull_request(NOW + 10, NOW + 4), NOW + 10).entries == ()


def test_digest_is_capped_by_moving_the_cutoff() -> None:
    config = ViewConfig(stages=3, model_hash=HASH, limits=Limits(max_digest=5))
    v = view(*(ann(i, timestamp=NOW + i) for i in range(12)), now=NOW + 12, config=config)
    request = v.pull_request(NOW + 12, NOW)
    assert len(request.have) == 5 and request.cutoff == NOW + 7
    assert len(encode_request(request)) < 200


def test_pull_exchanges_converge_two_views() -> None:
    rng = random.Random(7)
    a, b = View(CONFIG, verify), View(CONFIG, verify)
    for i in range(200):
        (a if rng.random() < 0.5 else b).apply(wire(ann(i, timestamp=NOW + rng.uniform(0, 9))),
                                               NOW + 10)
    now = NOW + 10
    _pull_all(a, b, b.pull_request(now, now - 60), now)
    _pull_all(b, a, a.pull_request(now, now - 60), now)
    assert state_of(a, now) == state_of(b, now) and len(a) == 200


def test_a_neighbour_cannot_forge_entries_in_a_page() -> None:
    honest = wire(ann(1))
    body = msgpack.unpackb(wire(ann(2, throughput=1e6)))[0]
    sig = msgpack.unpackb(wire(ann(2)))[1]
    forged = msgpack.packb([body, sig], use_bin_type=True)
    v = View(CONFIG, verify)
    results, cursor = v.apply_page(encode_page(PullPage(entries=(honest, forged, b"junk"))), NOW)
    assert [r.outcome for r in results] == ["added", "dropped", "dropped"]
    assert v.dropped == {"forged": 1, "malformed": 1} and cursor is None
    assert v.peer_ids(NOW) == [pid(1)]


def test_bad_pull_bytes_raise_a_typed_error() -> None:
    v = view(ann(0))
    with pytest.raises(BadPullMessage):
        v.handle_pull(b"\x00\x01", NOW)
    with pytest.raises(BadPullMessage):
        v.apply_page(b"\x93\x01", NOW)
    too_many = encode_page(PullPage(entries=(b"x",) * 2000))
    with pytest.raises(BadPullMessage):
        v.apply_page(too_many, NOW)
