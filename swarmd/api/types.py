"""The values the daemon's user commands return: one function, two faces.

``swarmd status`` and ``GET /api/v0/status`` serve the same ``StatusInfo``; the CLI prints it as
text or ``--json``, the HTTP API as JSON. Every type converts to plain JSON with ``to_json()``
and back with ``from_json()`` (the CLI reads what the HTTP API wrote).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

from swarmd.peer_states import PeerState

#: every lifecycle state a peer announces (``swarmd.peer_states``), in the page's order
PEER_STATES = tuple(s.value for s in PeerState)


def to_json(value: Any) -> Any:
    """A dataclass tree as plain JSON values (tuples become lists)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_json(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    if isinstance(value, dict):
        return {str(k): to_json(v) for k, v in value.items()}
    return value


@dataclass(frozen=True, slots=True, kw_only=True)
class IdInfo:
    peer_id: str
    addrs: tuple[str, ...]
    swarm: str
    version: str

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> IdInfo:
        return cls(peer_id=data["peer_id"], addrs=tuple(data["addrs"]), swarm=data["swarm"],
                   version=data["version"])


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerRow:
    """One peer as this daemon's membership view sees it."""

    peer_id: str
    stage: int | None
    state: str
    throughput: float  # samples/s, as the peer measured and announced it
    queue: int
    routable: bool
    #: why the peer is kept out of routing (unknown stage, other model, ...); None if routable
    reason: str | None = None
    #: seconds since its newest announcement was made
    age_s: float = 0.0
    addrs: tuple[str, ...] = ()
    #: optimizer steps of its stage
    step: int = 0

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PeerRow:
        return cls(**{**data, "addrs": tuple(data.get("addrs", ()))})


@dataclass(frozen=True, slots=True, kw_only=True)
class StageRow:
    stage: int
    peers: tuple[PeerRow, ...]
    #: sum of the routable peers' throughput
    total_throughput: float
    routable_peers: int

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StageRow:
        return cls(stage=data["stage"], peers=tuple(PeerRow.from_json(p) for p in data["peers"]),
                   total_throughput=data["total_throughput"],
                   routable_peers=data["routable_peers"])


@dataclass(frozen=True, slots=True, kw_only=True)
class SwarmInfo:
    swarm: str
    num_stages: int
    stages: tuple[StageRow, ...]
    #: the stage with the lowest total throughput (the pipeline's speed); None if no stages
    bottleneck: int | None
    #: peers kept out of routing whose stage is unknown here (reason says why)
    excluded: tuple[PeerRow, ...] = ()
    #: total peers in the view, this daemon included
    peers_total: int = 0

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SwarmInfo:
        return cls(swarm=data["swarm"], num_stages=data["num_stages"],
                   stages=tuple(StageRow.from_json(s) for s in data["stages"]),
                   bottleneck=data["bottleneck"],
                   excluded=tuple(PeerRow.from_json(p) for p in data.get("excluded", ())),
                   peers_total=data.get("peers_total", 0))


@dataclass(frozen=True, slots=True, kw_only=True)
class ConnectedPeer:
    """A peer this daemon is connected to or routes to (``GET /api/v0/peers``)."""

    peer_id: str
    stage: int | None = None
    state: str | None = None
    #: whether a libp2p connection to it is open now (False: known only to our routing)
    connected: bool = True
    #: how our router of the next stage treats it: ok, paused (busy), slow or banned; None
    #: when it is not a peer we route to
    routing: str | None = None
    #: why it is banned (``violation:<reason>`` or ``error:<reason>``) and for how long yet
    ban_reason: str | None = None
    ban_left_s: float | None = None
    #: protocol violations counted against it, and the last one's reason
    violations: int = 0
    violation_reason: str | None = None
    #: its requests refused here (busy) because it had its budget in flight
    budget_refusals: int = 0
    #: the wiring (swarmd/pipeline/wiring.py), samples/s: what its hops show (``throughput``,
    #: ``measured`` once we have a hop), the ceiling it announced, the share of a hop that is
    #: its compute and the compute time its last reply said, the routing ceiling (ceiling x
    #: compute share), the rate routing uses (the smaller) and whether the ceiling binds
    throughput: float | None = None
    measured: bool = False
    ceiling: float | None = None
    compute_share: float | None = None
    compute_s: float | None = None
    routing_ceiling: float | None = None
    rate: float | None = None
    capped: bool = False
    #: the addresses its newest membership announcement lists (empty: none seen)
    addrs: tuple[str, ...] = ()
    #: how our connection reaches it: "direct" (at least one direct connection) or "relayed"
    #: (only through a relay's circuit); None when not connected or the host runs no relay code
    path: str | None = None

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ConnectedPeer:
        known = {f.name for f in fields(cls)}
        data = {k: v for k, v in data.items() if k in known}
        if "addrs" in data:
            data["addrs"] = tuple(data["addrs"])
        return cls(**data)


def peer_rows(connected: Collection[str], known: Mapping[str, tuple[int | None, str]],
              routing: Sequence[Any] = (), refusals: Mapping[str, int] | None = None,
              addrs_of: Callable[[str], tuple[str, ...]] | None = None,
              paths: Mapping[str, str] | None = None) -> list[ConnectedPeer]:
    """The rows of ``GET /api/v0/peers``: every connected peer and every peer our routing
    knows (``routing``: ``swarmd.pipeline.wiring.PeerWiringState`` rows), by peer id.
    ``known``: membership's {peer: (stage, state)}; ``refusals``: budget refusals by peer;
    ``addrs_of(peer)``: the addresses it announces; ``paths``: ``"direct"`` or ``"relayed"`` by
    connected peer (``transport.relay.RelayNode.paths``)."""
    refusals, paths = refusals or {}, paths or {}
    routed = {r.peer_id: r for r in routing}
    rows = []
    for p in sorted(set(connected) | routed.keys()):
        stage, state = known.get(p, (None, None))
        r = routed.get(p)
        rows.append(ConnectedPeer(
            peer_id=p, stage=stage, state=state, connected=p in connected,
            routing=r.state if r is not None else None,
            ban_reason=r.ban_reason if r is not None else None,
            ban_left_s=round(r.ban_left_s, 3) if r is not None and r.ban_left_s is not None
            else None,
            violations=r.violations if r is not None else 0,
            violation_reason=r.violation_reason if r is not None else None,
            budget_refusals=refusals.get(p, 0), **_wiring_fields(r),
            addrs=tuple(addrs_of(p)) if addrs_of is not None else (),
            path=paths.get(p) if p in connected else None))
    return rows


def _wiring_fields(r: Any) -> dict[str, Any]:
    """A routed peer's wiring figures for its ``ConnectedPeer`` row, rounded (none: {})."""
    if r is None or not getattr(r, "listed", True):
        return {}

    def rounded(x: float | None, digits: int = 3) -> float | None:
        return round(float(x), digits) if x is not None else None

    return {"throughput": rounded(r.throughput), "measured": bool(r.measured),
            "ceiling": rounded(r.ceiling), "compute_share": rounded(r.compute_share, 4),
            "compute_s": rounded(r.compute_s, 6), "routing_ceiling": rounded(r.routing_ceiling),
            "rate": rounded(r.rate), "capped": bool(r.capped)}


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainerRow:
    """A trainer this daemon's stage serves, as it last told (``swarmd.pipeline.progress``)."""

    peer_id: str
    #: steps it took, and the mean loss of the last one (None: none yet)
    step: int
    loss: float | None = None
    #: its latest validation loss and the step it was measured at
    val_loss: float | None = None
    val_step: int | None = None
    #: its data shard ("i/n") and epoch
    shard: str | None = None
    epoch: int | None = None
    #: seconds since it last told
    heard_s: float = 0.0
    #: (step, loss) and (step, validation loss), oldest first: in ``TrainingInfo`` only
    losses: tuple[tuple[int, float], ...] = ()
    val_losses: tuple[tuple[int, float], ...] = ()

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TrainerRow:
        known = {f.name for f in fields(cls)}
        data = {k: v for k, v in data.items() if k in known}
        for key in ("losses", "val_losses"):
            data[key] = tuple((int(s), float(v)) for s, v in data.get(key, ()))
        return cls(**data)


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainingInfo:
    """The trainers' progress with their loss curves (``GET /api/v0/training``)."""

    trainers: tuple[TrainerRow, ...] = ()

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TrainingInfo:
        return cls(trainers=tuple(TrainerRow.from_json(t) for t in data.get("trainers", ())))


def trainer_rows(series: Sequence[Any], now: float, *, curves: bool) -> tuple[TrainerRow, ...]:
    """``TrainerBook.series()`` as rows (with their curves when ``curves``)."""
    return tuple(TrainerRow(
        peer_id=s.peer_id, step=s.latest.step, loss=s.latest.loss, val_loss=s.latest.val_loss,
        val_step=s.latest.val_step, shard=s.latest.shard, epoch=s.latest.epoch,
        heard_s=round(max(0.0, now - s.heard_at), 3),
        losses=tuple(s.losses) if curves else (),
        val_losses=tuple(s.val_losses) if curves else ()) for s in series)


@dataclass(frozen=True, slots=True, kw_only=True)
class StatusInfo:
    peer_id: str
    swarm: str
    version: str
    stage: int | None
    state: str
    uptime_s: float
    connected_peers: int
    throughput: float
    queue: int
    #: error and traffic counters, by dotted name (``protocol_errors.truncated``)
    counters: dict[str, int] = field(default_factory=dict)
    #: whether peers can dial this daemon: public, private or unknown (dial-backs)
    reachability: str = "unknown"
    #: relays this daemon holds a reservation on (while private)
    relays: tuple[str, ...] = ()
    #: what to do about being private (empty otherwise)
    reachability_hint: str = ""
    #: our addresses as several peers observed them (identify), with our listen port
    observed_addrs: tuple[str, ...] = ()
    #: what this daemon announces it is reached at (relayed, observed, then bound addresses)
    announced_addrs: tuple[str, ...] = ()
    #: the deadline policy and, per peer, measured round trip and bandwidth and the deadlines
    #: derived from them (swarmd.links)
    links: dict[str, Any] = field(default_factory=dict)
    #: ``[limits]`` as set and what the caps did: upload/download (cap, bytes through the bucket,
    #: bytes throttled, seconds waited), saved activations, device memory, cpu threads
    limits: dict[str, Any] = field(default_factory=dict)
    #: while stopping (state ``leaving``): seconds of ``node.shutdown_grace_s`` left
    grace_left_s: float | None = None
    #: the hash of the swarm manifest this daemon runs (``swarmd.manifest``), its model in a
    #: few words, and where it came from (own, swarm, kept)
    manifest: str = ""
    model: str = ""
    manifest_from: str = ""
    #: the trainers this daemon's stage serves, as they last told (curves: ``TrainingInfo``)
    trainers: tuple[TrainerRow, ...] = ()
    #: durations by dotted name (``hop_seconds.forward``, ``step_seconds``), each
    #: ``swarmd.api.histogram.HistogramSnapshot.to_json``: cumulative buckets, sum, count
    histograms: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StatusInfo:
        known = {f.name for f in fields(cls)}
        data = {k: v for k, v in data.items() if k in known}  # a newer daemon's extra keys
        for key in ("relays", "observed_addrs", "announced_addrs"):
            if key in data:
                data[key] = tuple(data[key])
        if "trainers" in data:
            data["trainers"] = tuple(TrainerRow.from_json(t) for t in data["trainers"])
        return cls(**data)


@dataclass(frozen=True, slots=True, kw_only=True)
class StageInfo:
    """The stage this daemon serves and the state of its weights (``GET /api/v0/stage``)."""

    stage: int | None
    state: str
    #: optimizer steps the stage has taken
    step: int = 0
    #: samples accumulated toward the next step on this peer
    samples: int = 0
    #: where the current weights came from: initial, checkpoint or peers
    state_from: str = "initial"
    #: bytes done and total of a state download in progress, else None
    syncing: tuple[int, int] | None = None
    #: blake2b-128 of the parameters' bytes: equal on peers that hold the same weights
    params_digest: str = ""
    params_norm: float = 0.0
    #: whether this peer's steps wait for the microbatches in flight here
    #: (``serving.step_drains``: no gradient applied late, for a pause per step)
    step_drains: bool = False
    #: the mean, over the samples stepped with so far, of the optimizer steps between the
    #: weights a forward ran on here and those its gradient was applied to (None: no step yet)
    lateness_steps: float | None = None
    #: seconds this peer's gate stood closed for its steps (what draining cost it)
    gate_closed_s: float = 0.0
    #: what this stage takes in: "activations", or "token ids" (stage 0 holding the
    #: embedding: the trainers send ids, not a compressed embedding)
    takes: str = "activations"

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StageInfo:
        syncing = data.get("syncing")
        return cls(**{**data, "syncing": tuple(syncing) if syncing is not None else None})


class DaemonApi(Protocol):
    """What the HTTP API and the CLI need from a running daemon."""

    def id_info(self) -> IdInfo: ...

    async def status(self) -> StatusInfo: ...

    def swarm(self) -> SwarmInfo: ...

    async def stage_info(self) -> StageInfo: ...

    async def peers(self) -> list[ConnectedPeer]: ...

    def training(self) -> TrainingInfo: ...

    async def stop(self) -> None:
        """Begin a graceful shutdown (returns at once; the daemon exits shortly after)."""
        ...
