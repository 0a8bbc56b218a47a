"""Membership wire forms: the signed announcement, and the pull request / page of the view
exchange. msgpack is used here and nowhere else in ``swarmd.membership``.

An announcement is one peer's claim about itself (who, where, which stage, how loaded). On the
wire it is ``msgpack([body, signature])`` where ``body`` is a positional msgpack array (no map
keys: ~230 bytes with a 52-character peer id, one address, a 16-hex model hash, a 32-hex
manifest hash and a 64-byte signature). The signature covers ``DOMAIN + body``, so a signature made for another protocol
with the same key can never pass as an announcement. Signing and verifying are functions passed
in (the peer's libp2p key in the daemon, fakes in tests).

The bytes are relayed verbatim: a neighbour serving its view hands out each peer's own signed
bytes, so it cannot forge, only withhold, another peer's entry. ``fingerprint`` (4 bytes of
BLAKE2b of the wire form) names one version of one entry in the digests of pull requests.

Everything decoded here is checked before use: total size first, then msgpack container limits,
then types and ranges (``Announcement`` validates itself when built), then the clock, then the
signature. Every failure is a :class:`~swarmd.errors.BadAnnouncement` (or
:class:`~swarmd.errors.BadPullMessage`) whose ``reason`` is one of :data:`DROP_REASONS`.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

import msgpack

from swarmd.errors import BadAnnouncement, BadPullMessage
from swarmd.peer_states import PeerState

__all__ = [
    "PeerState", "Announcement", "Limits", "PullRequest", "PullPage", "DOMAIN", "DROP_REASONS",
    "Sign", "Verify", "encode_signed", "decode_signed", "fingerprint",
    "encode_request", "decode_request", "encode_page", "decode_page",
]

#: prefix of every signed message; never sent, only signed and verified
DOMAIN = b"swarmd/membership/announce/1\x00"
#: wire format version (first element of every body / request / page)
WIRE_VERSION = 1
#: version of the announcement body (2 added ``step``, 3 ``manifest``)
BODY_VERSION = 3

Sign = Callable[[bytes], bytes]
Verify = Callable[[str, bytes, bytes], bool]

#: why an announcement can be dropped; the keys of ``View.dropped``
DROP_REASONS = (
    "oversized", "malformed", "unsigned", "forged", "future", "too_old",  # decoding
    "expired", "stale", "conflict", "too_frequent", "view_full",          # against the view
)


_STATE_CODES = {PeerState.JOINING: 0, PeerState.ONLINE: 1, PeerState.MIGRATING: 2,
                PeerState.LEAVING: 3, PeerState.SYNCING: 4}
_STATES_BY_CODE = {code: state for state, code in _STATE_CODES.items()}

#: what hostile bytes can make msgpack or our checks raise (msgpack documents "other
#: exceptions can be raised during unpacking")
_PARSE_ERRORS = (ValueError, TypeError, OverflowError, RecursionError, msgpack.UnpackException)

_MAX_ID = 128
_MAX_ADDR = 256
_MAX_ADDRS = 16
_MAX_STR = 128
_MAX_STAGE = 1 << 16
_MAX_QUEUE = 1 << 31
_MAX_STEP = 1 << 62
_MAX_MANIFEST = 64


def _check_str(name: str, value: object, max_len: int, *, empty: bool = False) -> None:
    if type(value) is not str:
        raise ValueError(f"{name} must be a str, not {type(value).__name__}")
    if not (empty or value) or len(value) > max_len:
        raise ValueError(f"{name} must have 1 to {max_len} characters")


def _finite(value: object) -> bool:
    return type(value) in (int, float) and math.isfinite(value)


@dataclass(frozen=True, slots=True, kw_only=True)
class Announcement:
    """One peer's signed claim about itself. Validated when built (``ValueError`` otherwise)."""

    peer_id: str
    addrs: tuple[str, ...]
    #: stage served, or None while not serving any
    stage: int | None
    state: PeerState
    #: measured throughput, samples per second
    throughput: float
    queue: int
    #: software version of the daemon
    version: str
    #: hash of the model definition; peers with another hash are never routed to
    model_hash: str
    #: seconds since the epoch, the signer's clock
    timestamp: float
    #: the signer promises its next announcement within this many seconds; receivers expire
    #: the entry after ``expiry_periods`` of them
    period: float
    #: optimizer steps its stage has taken (0 for peers without a stage)
    step: int = 0
    #: hash of the swarm manifest it runs (``swarmd.manifest``): every setting mates share;
    #: "" says nothing (peers announcing another hash are never routed to)
    manifest: str = ""

    def __post_init__(self) -> None:
        _check_str("peer_id", self.peer_id, _MAX_ID)
        if type(self.addrs) is not tuple or len(self.addrs) > _MAX_ADDRS:
            raise ValueError(f"addrs must be a tuple of at most {_MAX_ADDRS} strings")
        for addr in self.addrs:
            _check_str("addrs entry", addr, _MAX_ADDR)
        if self.stage is not None and (type(self.stage) is not int
                                       or not 0 <= self.stage < _MAX_STAGE):
            raise ValueError(f"stage must be None or an int from 0 to {_MAX_STAGE - 1}")
        if not isinstance(self.state, PeerState):
            raise ValueError("state must be a PeerState")
        if not _finite(self.throughput) or self.throughput < 0:
            raise ValueError("throughput must be a finite number >= 0")
        if type(self.queue) is not int or not 0 <= self.queue < _MAX_QUEUE:
            raise ValueError("queue must be an int >= 0")
        _check_str("version", self.version, _MAX_STR)
        _check_str("model_hash", self.model_hash, _MAX_STR, empty=True)
        if not _finite(self.timestamp) or self.timestamp < 0:
            raise ValueError("timestamp must be a finite number >= 0")
        if not _finite(self.period) or self.period <= 0:
            raise ValueError("period must be a finite number > 0")
        if type(self.step) is not int or not 0 <= self.step < _MAX_STEP:
            raise ValueError("step must be an int >= 0")
        _check_str("manifest", self.manifest, _MAX_MANIFEST, empty=True)

    def evolve(self, **changes: object) -> Announcement:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)


@dataclass(frozen=True, slots=True, kw_only=True)
class Limits:
    """What a receiver accepts. The defaults suit swarms up to ~10^5 peers."""

    #: largest signed announcement on the wire
    max_wire_bytes: int = 1024
    #: a timestamp further ahead of our clock is dropped as "future"
    max_future_s: float = 30.0
    #: a timestamp further behind our clock is dropped as "too_old" (3 x the longest period)
    max_age_s: float = 3 * 3600.0
    #: largest pull page (the view exchange), in bytes of its wire form
    max_page_bytes: int = 64 * 1024
    #: most fingerprints in one pull request's digest
    max_digest: int = 4096


# ----------------------------------------------------------------------------- announcements

def _body(ann: Announcement) -> bytes:
    return msgpack.packb(
        [BODY_VERSION, ann.peer_id, list(ann.addrs), ann.stage, _STATE_CODES[ann.state],
         float(ann.throughput), ann.queue, ann.version, ann.model_hash, float(ann.timestamp),
         float(ann.period), ann.step, ann.manifest],
        use_bin_type=True)


def encode_signed(ann: Announcement, sign: Sign) -> bytes:
    """The wire form of ``ann``, signed with ``sign`` (over ``DOMAIN + body``)."""
    body = _body(ann)
    signature = sign(DOMAIN + body)
    if type(signature) is not bytes or not signature:
        raise ValueError("sign() must return non-empty bytes")
    return msgpack.packb([body, signature], use_bin_type=True)


def _unpack(data: bytes, max_bytes: int) -> object:
    # the container limits default to len(data); no maps, no extension types, ever
    return msgpack.unpackb(data, raw=False, use_list=False, strict_map_key=True,
                           max_str_len=max_bytes, max_bin_len=max_bytes,
                           max_array_len=max_bytes, max_map_len=0, max_ext_len=0)


def _parse_body(body: bytes) -> Announcement:
    fields = _unpack(body, len(body))
    if type(fields) is not tuple or len(fields) != 13 or fields[0] != BODY_VERSION:
        raise ValueError(f"not an announcement body of version {BODY_VERSION}")
    (_, peer_id, addrs, stage, state, throughput, queue, version, model_hash, ts,
     period, step, manifest) = fields
    if type(addrs) is not tuple or state not in _STATES_BY_CODE:
        raise ValueError("bad addrs or state")
    return Announcement(peer_id=peer_id, addrs=addrs, stage=stage,
                        state=_STATES_BY_CODE[state], throughput=throughput, queue=queue,
                        version=version, model_hash=model_hash, timestamp=ts, period=period,
                        step=step, manifest=manifest)


def decode_signed(data: bytes, verify: Verify, limits: Limits, now: float) -> Announcement:
    """Check and decode one signed announcement; raise ``BadAnnouncement(reason)`` otherwise.

    Checks, in order: size ("oversized"), structure and field values ("malformed"), presence of
    a signature ("unsigned"), clock ("future", "too_old"), signature ("forged"; ``verify``
    raising counts as forged). The clock is checked before the signature because it is cheap.
    """
    if len(data) > limits.max_wire_bytes:
        raise BadAnnouncement("oversized", f"{len(data)} bytes > {limits.max_wire_bytes}")
    try:
        outer = _unpack(data, limits.max_wire_bytes)
        if type(outer) is not tuple or not 1 <= len(outer) <= 2 or type(outer[0]) is not bytes:
            raise ValueError("not [body, signature]")
        ann = _parse_body(outer[0])
    except _PARSE_ERRORS as exc:
        raise BadAnnouncement("malformed", str(exc)[:200]) from None
    signature = outer[1] if len(outer) == 2 else b""
    if type(signature) is not bytes or not signature:
        raise BadAnnouncement("unsigned", ann.peer_id)
    if ann.timestamp > now + limits.max_future_s:
        raise BadAnnouncement("future", f"{ann.peer_id} is {ann.timestamp - now:.0f} s ahead")
    if ann.timestamp < now - limits.max_age_s:
        raise BadAnnouncement("too_old", f"{ann.peer_id} is {now - ann.timestamp:.0f} s old")
    try:
        good = verify(ann.peer_id, DOMAIN + outer[0], signature) is True
    except Exception:  # a verifier choking on hostile input is a failed verification
        good = False
    if not good:
        raise BadAnnouncement("forged", ann.peer_id)
    return ann


def fingerprint(wire: bytes) -> int:
    """4-byte name of one signed version (collisions cost at most one missed delta, see view)."""
    return int.from_bytes(hashlib.blake2b(wire, digest_size=4).digest(), "big")


# ------------------------------------------------------------------------ pull request / page

@dataclass(frozen=True, slots=True, kw_only=True)
class PullRequest:
    """Ask a neighbour for its view: entries whose signed timestamp is >= ``cutoff`` (all of
    them when None: the full view) and whose fingerprint is not in ``have``, in peer-id order
    after ``cursor``, at most ``max_bytes`` of them."""

    cutoff: float | None = None
    have: frozenset[int] = field(default_factory=frozenset)
    cursor: str | None = None
    max_bytes: int = 64 * 1024

    def __post_init__(self) -> None:
        if self.cutoff is not None and not _finite(self.cutoff):
            raise ValueError("cutoff must be None or a finite number")
        if type(self.have) is not frozenset:
            raise ValueError("have must be a frozenset of fingerprints")
        if self.cursor is not None:
            _check_str("cursor", self.cursor, _MAX_ID)
        if type(self.max_bytes) is not int or self.max_bytes < 1024:
            raise ValueError("max_bytes must be an int >= 1024")

    @property
    def full(self) -> bool:
        return self.cutoff is None

    def next_page(self, cursor: str) -> PullRequest:
        return replace(self, cursor=cursor)


@dataclass(frozen=True, slots=True, kw_only=True)
class PullPage:
    """Part of a neighbour's view: signed announcements as they travel; ``next_cursor`` is set
    when more remain (ask again with ``request.next_page(next_cursor)``)."""

    entries: tuple[bytes, ...]
    next_cursor: str | None = None


def encode_request(request: PullRequest) -> bytes:
    have = b"".join(fp.to_bytes(4, "big") for fp in sorted(request.have))
    return msgpack.packb([WIRE_VERSION, request.cutoff, have, request.cursor, request.max_bytes],
                         use_bin_type=True)


def request_limit(limits: Limits) -> int:
    return 4 * limits.max_digest + 2 * _MAX_ID + 64


def decode_request(data: bytes, limits: Limits) -> PullRequest:
    if len(data) > request_limit(limits):
        raise BadPullMessage("oversized", f"request of {len(data)} bytes")
    try:
        fields = _unpack(data, len(data))
        if type(fields) is not tuple or len(fields) != 5 or fields[0] != WIRE_VERSION:
            raise ValueError("not a pull request of wire version 1")
        _, cutoff, have, cursor, max_bytes = fields
        if type(have) is not bytes or len(have) % 4:
            raise ValueError("the digest must be a byte string of 4-byte fingerprints")
        if len(have) > 4 * limits.max_digest:
            raise BadPullMessage("oversized", f"digest of {len(have) // 4} fingerprints")
        fps = frozenset(int.from_bytes(have[i:i + 4], "big") for i in range(0, len(have), 4))
        return PullRequest(cutoff=cutoff, have=fps, cursor=cursor, max_bytes=max_bytes)
    except _PARSE_ERRORS as exc:
        raise BadPullMessage("malformed", str(exc)[:200]) from None


def encode_page(page: PullPage) -> bytes:
    return msgpack.packb([WIRE_VERSION, list(page.entries), page.next_cursor], use_bin_type=True)


def page_size(entries: Iterable[bytes]) -> int:
    """Bytes of a page holding ``entries`` (exact up to a few header bytes, never under)."""
    return 8 + 2 * _MAX_ID + sum(len(e) + 3 for e in entries)


def decode_page(data: bytes, limits: Limits) -> PullPage:
    limit = limits.max_page_bytes + 2 * _MAX_ID + 64
    if len(data) > limit:
        raise BadPullMessage("oversized", f"page of {len(data)} bytes")
    try:
        fields = _unpack(data, len(data))
        if type(fields) is not tuple or len(fields) != 3 or fields[0] != WIRE_VERSION:
            raise ValueError("not a pull page of wire version 1")
        _, entries, cursor = fields
        if type(entries) is not tuple or not all(type(e) is bytes for e in entries):
            raise ValueError("entries must be a list of byte strings")
        if cursor is not None:
            _check_str("cursor", cursor, _MAX_ID)
        return PullPage(entries=entries, next_cursor=cursor)
    except _PARSE_ERRORS as exc:
        raise BadPullMessage("malformed", str(exc)[:200]) from None
