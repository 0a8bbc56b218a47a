"""Membership wire forms: signed announcements and pull messages. Pure, no network."""

from __future__ import annotations

import hashlib
import hmac
import math

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarmd.errors import BadAnnouncement, BadPullMessage, SwarmdError
from swarmd.membership import (
    DOMAIN, Announcement, Limits, PeerState, PullPage, PullRequest, decode_page, decode_request,
    decode_signed, encode_page, encode_request, encode_signed, fingerprint,
)

NOW = 1_700_000_000.0
LIMITS = Limits()
PID = "12D3KooWQYhTNQdmr3ArTeUHRYzFg94BKyTkoWBDWez9kSCVe2Xo"


def signer(pid: str):
    """Fake peer key: HMAC keyed by the peer id (tests only)."""
    return lambda message: hmac.new(pid.encode(), message, hashlib.sha256).digest()


def verify(pid: str, message: bytes, signature: bytes) -> bool:
    return hmac.compare_digest(hmac.new(pid.encode(), message, hashlib.sha256).digest(), signature)


def ann(**changes) -> Announcement:
    base = dict(peer_id=PID, addrs=("/ip4/203.0.113.7/tcp/31337",), stage=1,
                state=PeerState.ONLINE, throughput=120.5, queue=3, version="0.1.0",
                model_hash="5ca1ab1e0ddba11d", timestamp=NOW, period=2.0)
    base.update(changes)
    return Announcement(**base)


def wire(a: Announcement | None = None) -> bytes:
    a = a or ann()
    return encode_signed(a, signer(a.peer_id))


def reason(data: bytes, *, verifier=verify, now: float = NOW, limits: Limits = LIMITS) -> str:
    with pytest.raises(BadAnnouncement) as info:
        decode_signed(data, verifier, limits, now)
    assert isinstance(info.value, SwarmdError) and info.value.code == "bad_announcement"
    return info.value.reason


# ------------------------------------------------------------------------------ round trip

def test_roundtrip_and_compact_size() -> None:
    a = ann()
    data = wire(a)
    assert decode_signed(data, verify, LIMITS, NOW) == a
    # 52-char peer id, one address, 16-hex model hash, 32-byte HMAC: well under 1 KiB
    assert len(data) < 200


announcements = st.builds(
    Announcement,
    peer_id=st.text(min_size=1, max_size=128),
    addrs=st.lists(st.text(min_size=1, max_size=64), max_size=4).map(tuple),
    stage=st.none() | st.integers(0, 65535),
    state=st.sampled_from(PeerState),
    throughput=st.floats(0, 1e9, allow_nan=False) | st.integers(0, 10**9),
    queue=st.integers(0, 2**31 - 1),
    version=st.text(min_size=1, max_size=20),
    model_hash=st.text(max_size=64),
    timestamp=st.floats(NOW - 3600, NOW + 20),
    period=st.floats(0.001, 3600),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(announcements)
def test_roundtrip_any_valid_announcement(a: Announcement) -> None:
    data = encode_signed(a, signer(a.peer_id))
    if len(data) > LIMITS.max_wire_bytes:
        assert reason(data) == "oversized"
        return
    got = decode_signed(data, verify, LIMITS, NOW)
    assert got == a and got.state is a.state


@pytest.mark.parametrize("changes", [
    {"peer_id": ""}, {"peer_id": "x" * 129}, {"peer_id": 7},
    {"addrs": ["/ip4/1.2.3.4/tcp/1"]}, {"addrs": ("",)}, {"addrs": ("a",) * 17},
    {"stage": -1}, {"stage": 1 << 16}, {"stage": True}, {"stage": 1.0},
    {"state": "online"}, {"throughput": -1.0}, {"throughput": math.nan},
    {"throughput": math.inf}, {"throughput": "1"}, {"queue": -1}, {"queue": True},
    {"version": ""}, {"model_hash": None}, {"timestamp": math.nan}, {"timestamp": -1.0},
    {"period": 0.0}, {"period": -2.0}, {"period": math.inf},
])
def test_announcement_is_validated_when_built(changes: dict) -> None:
    with pytest.raises(ValueError):
        ann(**changes)


def test_announcement_is_frozen_and_evolve_validates() -> None:
    a = ann()
    with pytest.raises(AttributeError):
        a.stage = 2  # type: ignore[misc]
    assert a.evolve(stage=2).stage == 2 and a.stage == 1
    with pytest.raises(ValueError):
        a.evolve(queue=-5)


# ------------------------------------------------------------------------------- rejection

def test_oversized_is_refused_before_parsing() -> None:
    big = ann(addrs=tuple(f"/dns4/{'h' * 60}.example/tcp/{i}" for i in range(16)))
    assert reason(wire(big)) == "oversized"
    assert reason(b"\x00" * (LIMITS.max_wire_bytes + 1)) == "oversized"
    assert decode_signed(wire(big), verify, Limits(max_wire_bytes=4096), NOW) == big


def _body_of(data: bytes) -> bytes:
    return msgpack.unpackb(data)[0]


def _resign(body: list) -> bytes:
    packed = msgpack.packb(body, use_bin_type=True)
    return msgpack.packb([packed, signer(PID)(DOMAIN + packed)], use_bin_type=True)


@pytest.mark.parametrize("data", [
    b"", b"\xc1", b"\x92", b"not msgpack at all", msgpack.packb({"a": 1}),
    msgpack.packb([1, 2]), msgpack.packb([b"body", b"sig", b"extra"]),
    msgpack.packb(["str body", b"sig"]), msgpack.packb([b"\x93\x01\x02\x03", b"sig"]),
    wire()[:-5],
])
def test_malformed_bytes(data: bytes) -> None:
    assert reason(data) == "malformed"


GOOD_BODY = [3, PID, ["/ip4/203.0.113.7/tcp/31337"], 1, 1, 120.5, 3, "0.1.0", "5ca1ab1e", NOW, 2.0,
             7, "0123456789abcdef0123456789abcdef"]


@pytest.mark.parametrize("index, value", [
    (0, 2), (0, 4),        # body versions we do not speak
    (1, b"bytes id"), (2, "not a list"), (3, -4), (4, 9), (5, "fast"), (5, math.nan),
    (6, -1), (7, None), (9, "yesterday"), (10, 0.0), (2, [7]), (11, -1), (11, 1.5),
    (12, None), (12, "x" * 65),
])
def test_malformed_fields_even_when_signed(index: int, value: object) -> None:
    body = list(GOOD_BODY)
    body[index] = value
    assert reason(_resign(body)) == "malformed"


def test_signed_good_body_passes_the_same_path() -> None:
    ann = decode_signed(_resign(GOOD_BODY), verify, LIMITS, NOW)
    assert ann.model_hash == "5ca1ab1e" and ann.manifest == "0123456789abcdef" * 2


def test_unsigned() -> None:
    body = _body_of(wire())
    assert reason(msgpack.packb([body], use_bin_type=True)) == "unsigned"
    assert reason(msgpack.packb([body, b""], use_bin_type=True)) == "unsigned"


def test_sign_must_return_bytes() -> None:
    with pytest.raises(ValueError):
        encode_signed(ann(), lambda m: b"")


def test_forged_by_another_key_or_tampered_or_without_domain() -> None:
    body = _body_of(wire())
    other = msgpack.packb([body, signer("12D3KooWmallory")(DOMAIN + body)], use_bin_type=True)
    assert reason(other) == "forged"
    no_domain = msgpack.packb([body, signer(PID)(body)], use_bin_type=True)
    assert reason(no_domain) == "forged"
    tampered = _body_of(wire(ann(throughput=9999.0)))
    sig = msgpack.unpackb(wire())[1]
    assert reason(msgpack.packb([tampered, sig], use_bin_type=True)) == "forged"


def test_verifier_that_raises_or_returns_truthy_non_bool_counts_as_forged() -> None:
    def boom(pid: str, m: bytes, s: bytes) -> bool:
        raise RuntimeError("bad key encoding")
    assert reason(wire(), verifier=boom) == "forged"
    assert reason(wire(), verifier=lambda *a: 1) == "forged"  # type: ignore[arg-type,return-value]


def test_clock_checks() -> None:
    assert reason(wire(ann(timestamp=NOW + 31))) == "future"
    assert decode_signed(wire(ann(timestamp=NOW + 29)), verify, LIMITS, NOW).timestamp == NOW + 29
    assert reason(wire(ann(timestamp=NOW - LIMITS.max_age_s - 1))) == "too_old"


def test_adversarial_verifier_accepting_everything_still_cannot_pass_malformed() -> None:
    assert reason(_resign([2, "", [], None, 1, 1.0, 0, "v", "h", NOW, 1.0, 0]),
                  verifier=lambda *a: True) == "malformed"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300))
def test_random_bytes_only_ever_raise_bad_announcement(data: bytes) -> None:
    try:
        decode_signed(data, lambda *a: True, LIMITS, NOW)
    except BadAnnouncement:
        pass


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_no_single_byte_change_passes_as_another_announcement(data: st.DataObject) -> None:
    """A relay cannot alter an entry: any changed byte is refused, or decodes to the same."""
    original = wire()
    i = data.draw(st.integers(0, len(original) - 1))
    b = data.draw(st.integers(0, 255).filter(lambda b: b != original[i]))
    mutated = original[:i] + bytes([b]) + original[i + 1:]
    try:
        got = decode_signed(mutated, verify, LIMITS, NOW)
    except BadAnnouncement:
        return
    assert got == ann()


# ----------------------------------------------------------------------------- fingerprint

def test_fingerprint_names_one_version() -> None:
    assert fingerprint(wire()) == fingerprint(wire())
    assert fingerprint(wire()) != fingerprint(wire(ann(timestamp=NOW + 1)))
    assert 0 <= fingerprint(wire()) < 2**32


# --------------------------------------------------------------------------- pull messages

def test_pull_request_roundtrip() -> None:
    for request in (PullRequest(), PullRequest(cutoff=NOW - 60, have=frozenset({1, 2**32 - 1}),
                                               cursor=PID, max_bytes=4096)):
        assert decode_request(encode_request(request), LIMITS) == request
    assert PullRequest().full and not PullRequest(cutoff=1.0).full
    assert PullRequest(cutoff=1.0).next_page("x").cursor == "x"


@pytest.mark.parametrize("changes", [{"cutoff": math.nan}, {"have": {1}}, {"cursor": ""},
                                     {"max_bytes": 10}])
def test_pull_request_is_validated(changes: dict) -> None:
    with pytest.raises(ValueError):
        PullRequest(**changes)


@pytest.mark.parametrize("data", [
    b"", msgpack.packb([1, None, b"abc", None, 65536]), msgpack.packb([2, None, b"", None, 65536]),
    msgpack.packb([1, "soon", b"", None, 65536]), msgpack.packb([1, None, b"", None, 5]),
    msgpack.packb({"cutoff": 1}),
])
def test_bad_pull_requests(data: bytes) -> None:
    with pytest.raises(BadPullMessage) as info:
        decode_request(data, LIMITS)
    assert info.value.reason == "malformed"


def test_oversized_pull_request() -> None:
    request = PullRequest(cutoff=1.0, have=frozenset(range(LIMITS.max_digest + 1)))
    with pytest.raises(BadPullMessage) as info:
        decode_request(encode_request(request), LIMITS)
    assert info.value.reason == "oversized"


def test_pull_page_roundtrip_and_errors() -> None:
    page = PullPage(entries=(wire(), wire(ann(stage=2))), next_cursor=PID)
    assert decode_page(encode_page(page), LIMITS) == page
    for bad in (b"\x93", msgpack.packb([1, ["text"], None]), msgpack.packb([1, [b"x"], 5])):
        with pytest.raises(BadPullMessage):
            decode_page(bad, LIMITS)
    huge = encode_page(PullPage(entries=(b"x" * (LIMITS.max_page_bytes + 1000),)))
    with pytest.raises(BadPullMessage) as info:
        decode_page(huge, LIMITS)
    assert info.value.reason == "oversized"
