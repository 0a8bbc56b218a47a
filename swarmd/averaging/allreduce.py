"""All-reduce of the gradients of one stage among its live peers, over libp2p streams.

The round's decisions (parts and units, repair chain, which values a peer may take, valid
replies) live in ``swarmd.averaging.plan``; the aggregators in ``swarmd.averaging.aggregation``. This
module is the I/O.

Driving a round: every peer of ``group`` calls, at about the same time (a peer that starts
late is fine: what reaches it before it joins is buffered)::

    result = await averager.all_reduce(round_id, group, vector, weight, codec="fp16",
                                       aggregator="mean", cap_s=600, parts=...)

with the same ``round_id`` (new for every round, e.g. ``f"{stage}:{step}"``), the same
``group`` (any order; it is sorted) and the same ``parts`` (or the same ``bandwidths``: the
plan is derived deterministically). Every survivor returns the same ``result.vector``, bit for
bit, or raises :class:`AllReduceFailed` by its deadline. The deadline follows the links
(``swarmd.links``): what this peer moves with each other peer (``RoundPlan.transfers``, at the
codec's bytes per value) over the bandwidth and round trips measured with it, with slack, at
least the policy's floor and at most ``cap_s`` (``averaging.timeout_s``); ``deadline_s`` fixes
it instead. A finished round feeds the estimates: each peer's bytes at the round's aggregate
rate (``LinkEstimates.observe_shared``). The returned vector is new memory;
``vector`` itself must not change until the call returns.

One stream per request, one request per (peer, unit):

* ``contribute`` (peer -> owner of unit u): the peer's slice and weight. Per owner, one
  contribution is on the wire at a time, units in order, so that units arrive one by one. The
  owner waits until every other peer contributed (or is known unreachable) or until
  ``gather_fraction`` of the deadline, refuses non-finite contributions, aggregates, and
  answers every contributor, late ones too, with the same encoded frame; its own copy is that
  frame decoded, so all hold the same bits.
* ``repair`` (peer -> the e-th peer after the owner): sent when the owner's answer did not come
  by ``reply_fraction`` of the deadline (or the owner is unreachable). The repairer ``probe``-s
  every other peer: one that holds the unit hands it over (it is relayed); the others hand over
  their contribution and refuse older values from then on; if nobody held it, the repairer
  aggregates. Repaired values travel uncompressed, so relays stay exact.

Unlike hivemind, whose peers fall back to their local values for a part whose reducer failed
(survivors then disagree), a lost part is re-aggregated once and the same bits go to every
survivor. A peer whose own vector holds NaN/Inf takes part with weight 0 (it still gets the
average). A peer that failed to connect once is not dialed again in that round.

Authority: requests are parsed into typed messages (``swarmd.averaging.messages``) in
``_serve``; a contribution is taken only from a member of the plan's group, for a unit this
peer owns, of the unit's length and with at most ``max_weight`` samples; a probe only from the
unit's repairer of that epoch (a probe raises the floor, so an outsider's would make this peer
refuse the owner's value); a repair request only from a member. Buffered messages for a round
not joined yet are held to the same rules when it is. Times are the Averager's ``clock`` (``time.monotonic`` unless one is given).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any, Callable, Sequence

import torch

from swarmd.averaging.aggregation import AggregateFn, Aggregator, BadGradient, check_finite
from swarmd.averaging.messages import (Contribute, Probe, Repair, parse_contribution,
                                       parse_request)
from swarmd.averaging.plan import (DEFAULT_CHUNK, BadAllReduceMessage, PartValue, RoundPlan,
                                   fits, parse_part, pick_relayed)
from swarmd.averaging.rounds import (RAW, AllReduceFailed, AllReduceResult, AveragerOptions,
                                     Refusal, RoundState, RoundTable, aggregate_unit, summarize)
from swarmd.averaging.wire import StreamPool, decode_own
from swarmd.errors import BadPeerMessage
from swarmd.links import LinkEstimates, Transfer, links_for
from transport.codecs import CodecSpec
from transport.counters import Counters
from transport.errors import PeerUnavailable, TransportError
from transport.frames import Message, OutgoingFrame
from transport.host import Host
from transport.stream import OFFLOAD_BYTES, Stream, encode_off_loop
from swarmd.protocols import Protocols

log = logging.getLogger("swarmd.averaging.allreduce")

__all__ = ["AllReduceFailed", "AllReduceResult", "Averager", "AveragerOptions", "protocol_id"]

_FAILURES = (TransportError, BadPeerMessage, TimeoutError)
#: added to every derived round deadline: members are told to start and join at slightly
#: different times (stage_sync asks within 3 s, a dial takes about 1 s)
ROUND_START_S = 10.0
#: what may be queued ahead of a stream open on a busy link (one TCP send buffer), and the
#: longest an open may take
OPEN_QUEUE_BYTES = 4 << 20
OPEN_CAP_S = 60.0


def protocol_id(swarm: str) -> str:
    return Protocols(swarm).allreduce


def bytes_per_value(codec: CodecSpec) -> float:
    """About what one float32 value costs on the wire under ``codec`` (zstd not counted)."""
    base = codec.name.split("+")[0]
    if base == "fp16":
        return 2.0
    scale = 4.0 if codec.scale_dtype == "float32" else 2.0
    if base == "int8":
        return 1.0 + scale / codec.block_size
    if base in ("int4", "int2"):
        return int(base[3]) / 8 + scale / codec.block_size
    return 4.0


class Averager:
    """``async with Averager(host, protocol_id(swarm)) as averager:`` serves ``protocol``."""

    def __init__(self, host: Host, protocol: str, *, options: AveragerOptions | None = None,
                 addrs_of: Callable[[str], Sequence[str]] | None = None,
                 links: LinkEstimates | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        #: every time here is read from this clock (seconds, monotonic)
        self._clock = clock
        self.host = host
        #: the daemon's shared link estimates (swarmd.links): round deadlines follow them
        self.links = links if links is not None else links_for(host)
        self.protocol = protocol
        self.options = options or AveragerOptions()
        self.addrs_of = addrs_of
        #: rounds, rounds_failed, contributions_received, contributions_refused, peers_missing,
        #: repaired_parts, late_contributions, local_non_finite, plan_mismatch, buffer_full,
        #: bad_requests.<reason> (malformed, or not the sender's to send: wrong_part,
        #: bad_weight, not_repairer, not_a_member), refused.<code> (busy, not_joined, ...),
        #: open_retries, pooled_stream_stale
        self.counters = Counters()
        self._rounds = RoundTable(self.options, self.counters)
        self._pool = StreamPool(host, protocol, self.counters,
                                dial_timeout_s=self.options.dial_timeout_s,
                                open_timeout=self.open_timeout)
        self._tasks: set[asyncio.Task[Any]] = set()

    async def __aenter__(self) -> Averager:
        self.host.set_handler(self.protocol, self._handle)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.host.remove_handler(self.protocol)
        self._pool.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=5.0)
        self._rounds.clear()

    # ---- the caller's side ---------------------------------------------------------------
    def decline(self, round_id: str) -> None:
        """This peer will not join ``round_id`` (it refused its start): its members' requests
        for it are refused at once (``RoundTable.decline``)."""
        self._rounds.decline(round_id)

    async def all_reduce(self, round_id: str, group: Sequence[str], vector: torch.Tensor,
                         weight: float, *, codec: CodecSpec | str = "fp16",
                         aggregator: Aggregator | AggregateFn | str = "mean",
                         deadline_s: float | None = None, cap_s: float | None = None,
                         parts: Sequence[int] | None = None,
                         bandwidths: Sequence[float | None] | None = None,
                         chunk: int = DEFAULT_CHUNK,
                         addrs_of: Callable[[str], Sequence[str]] | None = None,
                         max_weight: float = math.inf) -> AllReduceResult:
        """Average ``vector`` (flat float32, this peer's mean gradient over ``weight``
        samples) with the other peers of ``group``; see the module doc. ``parts`` (in sorted
        group order), ``bandwidths`` (in ``group``'s order), ``chunk`` and ``max_weight``
        must be the same on every peer; ``addrs_of(peer_id)`` gives multiaddrs to dial a peer
        not connected. A contribution claiming more than ``max_weight`` samples is refused."""
        if vector.dtype != torch.float32 or vector.dim() != 1:
            raise ValueError(f"vector must be flat float32, got {vector.dtype} "
                             f"{tuple(vector.shape)}")
        if not (math.isfinite(weight) and 0 <= weight <= max_weight) or not (
                deadline_s is None or deadline_s > 0):
            raise ValueError(f"weight must be finite and in [0, {max_weight}] ({weight!r}) and "
                             f"deadline_s positive ({deadline_s!r})")
        plan = RoundPlan.build(round_id, group, vector.numel(), parts=parts,
                               bandwidths=bandwidths, chunk=chunk)
        spec = CodecSpec.parse(codec) if isinstance(codec, str) else codec
        transfers = plan.transfers(plan.index(self.host.peer_id), bytes_per_value(spec))
        if deadline_s is None:
            deadline_s = self.round_deadline(transfers, cap_s=cap_s)
        try:  # a whole gradient: checked in a thread, not on the event loop
            await asyncio.to_thread(check_finite, vector, who="this peer")
        except BadGradient as exc:  # left out of every unit, not only where the NaN lies
            log.warning("round %s: %s; left out of the average", round_id, exc)
            self.counters.add("local_non_finite")
            vector, weight = torch.zeros_like(vector), 0.0
        rnd = self._rounds.join(plan, plan.index(self.host.peer_id), self._clock(),
                                deadline_s, max_weight=max_weight)
        rnd.vector, rnd.weight = vector.detach().cpu().contiguous(), float(weight)
        rnd.codec = spec
        rnd.aggregate = Aggregator.parse(aggregator) if isinstance(aggregator, str) else aggregator
        rnd.addrs_of = addrs_of or self.addrs_of
        rnd.out = torch.empty(plan.total, dtype=torch.float32)
        rnd.joined.set()
        start = self._clock()
        try:
            async with asyncio.timeout(rnd.deadline - start):
                async with asyncio.TaskGroup() as tg:
                    for u, unit in enumerate(plan.units):
                        mine = unit.owner == rnd.me
                        tg.create_task(self._own(rnd, u) if mine else self._obtain(rnd, u))
        except TimeoutError:
            pass
        finally:
            out = rnd.out
            self._rounds.finish(rnd)
        missing = [u for u, unit in enumerate(rnd.units) if unit.state.value is None]
        if missing or out is None:
            self.counters.add("rounds_failed")
            owners = sorted({plan.group[plan.units[u].owner] for u in missing})
            raise AllReduceFailed(f"round {round_id}: {len(missing)} units of {owners} missing "
                                  f"at the {deadline_s:.3g} s deadline")
        result = await asyncio.to_thread(summarize, rnd, out, self._clock() - start)
        if not result.missing and not result.repaired_parts:  # a clean round measures links
            self.links.observe_shared(transfers, result.seconds, self._clock())
        self.counters.add("rounds")
        self.counters.add("peers_missing", len(result.missing))
        self.counters.add("repaired_parts", len(result.repaired_parts))
        return result

    def open_timeout(self, peer: str) -> float:
        """A dial or stream open to ``peer``: its frames may wait behind a full send buffer
        of units (``OPEN_QUEUE_BYTES``) on that link, plus ``dial_timeout_s``."""
        return self.links.deadline(peer, OPEN_QUEUE_BYTES, round_trips=2,
                                   extra_s=self.options.dial_timeout_s, cap_s=OPEN_CAP_S)

    def round_deadline(self, transfers: Sequence[Transfer], *,
                       cap_s: float | None = None) -> float:
        """The deadline of a round moving ``transfers`` (see the module doc); aggregating and
        checking the units is covered by the policy's slack and floor."""
        return self.links.deadline_all(transfers, extra_s=ROUND_START_S, cap_s=cap_s)

    # ---- the units this peer owns ----------------------------------------------------------
    async def _own(self, rnd: RoundState, u: int) -> None:
        plan, unit = rnd.plan, rnd.units[u]
        assert plan is not None
        others = {i for i in range(plan.n) if i != rnd.me}
        while unit.state.floor == 0 and (left := rnd.gather_at - self._clock()) > 0:
            if others <= {plan.index(s) for s in unit.contributions} | rnd.unreachable:
                break
            unit.changed.clear()
            try:
                async with asyncio.timeout(left):
                    await unit.changed.wait()
            except TimeoutError:
                break
        if unit.state.floor == 0:
            inputs = [(plan.index(s), t, w) for s, (t, w) in unit.contributions.items()]
            assert rnd.vector is not None
            inputs.append((rnd.me, rnd.vector[plan.units[u].span], rnd.weight))
            tensor, weight, who = await asyncio.to_thread(aggregate_unit, rnd, inputs,
                                                          self.counters)
            message = Message(kind="part", meta={"e": 0, "W": weight, "c": who},
                              tensors=(tensor,))
            frame = await encode_off_loop(message, rnd.codec)
            if unit.state.floor == 0:  # no repairer asked meanwhile: publish, then decode
                unit.frame = frame
                unit.done.set()
                own = await decode_own(frame, self.host.options.limits)
                unit.state.offer(PartValue(own, 0, weight, tuple(who)))
        log.debug("round %s: own unit %d at %.3f", rnd.round_id, u,
                  self._clock() - rnd.start)
        unit.done.set()
        if unit.state.value is None:
            await self._walk_chain(rnd, u)
        await self._place(rnd, u)

    async def _place(self, rnd: RoundState, u: int) -> None:
        """Copy unit ``u``'s value into the result now, while other units still travel."""
        unit, plan = rnd.units[u], rnd.plan
        if unit.state.value is None or rnd.out is None or plan is None or unit.placed:
            return
        unit.placed = True
        target, value = rnd.out[plan.units[u].span], unit.state.value.tensor
        if value.numel() * 4 > OFFLOAD_BYTES:
            await asyncio.to_thread(target.copy_, value)
        else:
            target.copy_(value)

    # ---- the units of others -----------------------------------------------------------
    async def _obtain(self, rnd: RoundState, u: int) -> None:
        plan, unit = rnd.plan, rnd.units[u]
        assert plan is not None and rnd.vector is not None
        owner = plan.units[u].owner
        request = Message(kind="contribute", meta=self._meta(rnd, u, w=rnd.weight),
                          tensors=(rnd.vector[plan.units[u].span],))
        try:
            reply = await self._ask(rnd, owner, request, rnd.codec,
                                    rnd.reply_at - self._clock(), slot=rnd.send_slots[owner])
            value = await self._checked_part(rnd, u, reply, f"owner {plan.group[owner]}")
            accepted = unit.state.offer(value)
        except (*_FAILURES, BadGradient) as exc:
            log.info("round %s: no unit %d from its owner %s: %s", rnd.round_id, u,
                     plan.group[owner], exc)
            accepted = False
        if not accepted:
            await self._walk_chain(rnd, u)
        await self._place(rnd, u)

    async def _walk_chain(self, rnd: RoundState, u: int) -> None:
        plan, state = rnd.plan, rnd.units[u].state
        assert plan is not None
        for epoch, c in plan.chain(u):
            if state.value is not None:
                return
            if c == rnd.me:
                try:
                    await asyncio.shield(self._repair(rnd, u, epoch))
                except Refusal:
                    pass
                return
            request = Message(kind="repair", meta=self._meta(rnd, u, e=epoch))
            timeout = min(self.options.repair_timeout_s, rnd.deadline - self._clock())
            try:
                reply = await self._ask(rnd, c, request, RAW, timeout)
                value = await self._checked_part(rnd, u, reply, f"repairer {plan.group[c]}")
                if state.offer(value):
                    return
            except (*_FAILURES, BadGradient) as exc:
                log.info("round %s: repair of unit %d by %s failed: %s", rnd.round_id, u,
                         plan.group[c], exc)

    async def _checked_part(self, rnd: RoundState, u: int, reply: Message,
                            who: str) -> PartValue:
        """A unit's value from a peer: well formed, a sane weight, finite (checked in a
        thread: a unit is up to 16 MB)."""
        assert rnd.plan is not None
        value = parse_part(rnd.plan, u, reply.kind, reply.meta, reply.tensors,
                           max_weight=rnd.max_weight)
        await asyncio.to_thread(check_finite, value.tensor, who=who)
        return value

    def _repair(self, rnd: RoundState, u: int, epoch: int) -> asyncio.Task[PartValue]:
        unit = rnd.units[u]
        if unit.repair is None:
            unit.repair = self._spawn(self._do_repair(rnd, u, epoch))
        return unit.repair

    async def _do_repair(self, rnd: RoundState, u: int, epoch: int) -> PartValue:
        plan, state = rnd.plan, rnd.units[u].state
        assert plan is not None
        if state.value is not None:
            return state.value
        if rnd.vector is None:
            raise Refusal("round_finished", f"round {rnd.round_id} is over here")
        state.raise_floor(epoch)
        inputs = [(rnd.me, rnd.vector[plan.units[u].span].clone(), rnd.weight)]
        # a peer that has not joined yet holds the probe until it does, by our gather time
        hold = max(0.0, rnd.gather_at - self._clock())
        probe = Message(kind="probe", meta=self._meta(rnd, u, e=epoch, g=hold))
        # a hung peer must not take the round down: keep half the time left for the rest
        timeout = min(hold + self.options.probe_timeout_s,
                      (rnd.deadline - self._clock()) / 2)

        async def ask(k: int) -> Message | None:
            try:
                return await self._ask(rnd, k, probe, RAW, timeout)
            except _FAILURES as exc:
                log.info("round %s: probe of %s failed: %s", rnd.round_id, plan.group[k], exc)
                return None

        # a peer found unreachable in this round is not asked again (each dial costs ~1 s)
        peers = [k for k in range(plan.n) if k != rnd.me and k not in rnd.unreachable]
        found = []
        for k, reply in zip(peers, await asyncio.gather(*(ask(k) for k in peers))):
            try:
                if reply is not None and reply.kind == "part":
                    found.append(parse_part(plan, u, reply.kind, reply.meta, reply.tensors))
                elif reply is not None and reply.kind == "contribution":
                    got = parse_contribution(reply.kind, reply.meta, reply.tensors,
                                             length=plan.units[u].length,
                                             max_weight=rnd.max_weight)
                    inputs.append((k, got.tensor, got.weight))
            except BadPeerMessage as exc:
                log.info("round %s: bad probe reply from %s: %s", rnd.round_id,
                         plan.group[k], exc)
        if state.value is not None:
            return state.value
        relayed = pick_relayed(found)
        if relayed is not None:
            value = PartValue(relayed.tensor, epoch, relayed.weight, relayed.contributors)
        else:
            tensor, weight, who = await asyncio.to_thread(aggregate_unit, rnd, inputs,
                                                          self.counters)
            value = PartValue(tensor, epoch, weight, tuple(who))
        if state.value is None:
            state.value = value
        return state.value

    # ---- requests ------------------------------------------------------------------------
    def _meta(self, rnd: RoundState, u: int, **extra: Any) -> dict[str, Any]:
        wait = max(0.0, rnd.deadline - self._clock())
        return {"r": rnd.round_id, "d": rnd.digest, "u": u, "t": wait, **extra}

    async def _ask(self, rnd: RoundState, k: int, message: Message, codec: CodecSpec,
                   timeout: float, slot: asyncio.Semaphore | None = None) -> Message:
        """One exchange with peer ``k``. ``slot`` is held until the request is written:
        requests that share it go out one at a time, in the order they came. A peer that
        could not be reached is not dialed again in this round."""
        plan = rnd.plan
        assert plan is not None
        peer = plan.group[k]
        held = slot

        def sent() -> None:
            nonlocal held
            if held is not None:
                held.release()
                held = None

        try:
            async with asyncio.timeout(max(timeout, 0.001)):
                if held is not None:
                    await held.acquire()
                if k in rnd.unreachable:  # failed once this round: no second dial (~1 s)
                    raise PeerUnavailable(f"{peer} was unreachable earlier in this round")
                addrs = rnd.addrs_of(peer) if rnd.addrs_of else ()
                reply, out_bytes, in_bytes = await self._pool.exchange(
                    peer, message, codec, addrs=addrs, sent=sent)
        except PeerUnavailable:
            rnd.mark_unreachable(k)
            raise
        finally:
            sent()
        rnd.bytes_sent += out_bytes
        rnd.bytes_received += in_bytes
        return reply

    # ---- serving ---------------------------------------------------------------------------
    async def _handle(self, stream: Stream) -> None:
        await self._pool.serve(stream, self._serve, self.options.idle_stream_s)

    async def _serve(self, message: Message, peer: str, nbytes: int) -> OutgoingFrame:
        request = parse_request(message.kind, message.meta, message.tensors,
                                max_wait=self.options.max_wait_s)
        rnd = self._rounds.lookup(request.round_id, request.digest, message.kind, nbytes,
                                  self._clock())
        if isinstance(request, Contribute):
            return await self._serve_contribute(rnd, request, peer, nbytes)
        if isinstance(request, Probe):
            return await self._serve_probe(rnd, request, peer)
        return await self._serve_repair(rnd, request, peer)

    async def _serve_contribute(self, rnd: RoundState, request: Contribute, peer: str,
                                nbytes: int) -> OutgoingFrame:
        u, tensor, w = request.unit, request.tensor, float(request.weight)
        self.counters.add("contributions_received")
        if rnd.plan is None:  # buffered until the local peer joins (checked then)
            rnd.pending[(u, peer)] = (tensor, w)
            rnd.pending_bytes += nbytes
            await self._rounds.wait_joined(rnd, request.wait)
            if u >= len(rnd.units) or (peer not in rnd.units[u].contributions
                                       and not rnd.units[u].done.is_set()):
                raise BadAllReduceMessage("wrong_part", f"unit {u} from {peer}")
        else:
            plan = rnd.plan
            if not fits(plan, u, tensor) or plan.units[u].owner != rnd.me or (
                    peer not in plan.group) or peer == plan.group[rnd.me]:
                raise BadAllReduceMessage("wrong_part", f"unit {u} from {peer}")
            if w > rnd.max_weight:
                raise BadAllReduceMessage("bad_weight", f"{peer} claims {w} samples, at "
                                                        f"most {rnd.max_weight} are possible")
            unit = rnd.units[u]
            if not unit.done.is_set() and not rnd.finished:
                unit.contributions[peer] = (tensor, w)
                unit.changed.set()
            else:
                self.counters.add("late_contributions")
        unit = rnd.units[u]
        try:
            async with asyncio.timeout(request.wait):
                await unit.done.wait()
        except TimeoutError:
            raise Refusal("not_ready", f"unit {u} of {rnd.round_id} is not decided") from None
        if unit.frame is None:
            raise Refusal("part_repaired", f"unit {u} of {rnd.round_id} is being repaired: "
                                            f"ask the repair chain")
        return unit.frame

    async def _serve_probe(self, rnd: RoundState, request: Probe, peer: str) -> OutgoingFrame:
        """Only the unit's repairer of ``epoch`` may probe it (a probe raises the floor)."""
        u, epoch = request.unit, request.epoch
        if rnd.plan is None:
            key = (u, peer)
            rnd.pending_floors[key] = max(rnd.pending_floors.get(key, 0), epoch)
            try:
                await self._rounds.wait_joined(rnd, request.hold)
            except Refusal:
                return await encode_off_loop(Message(kind="absent"), RAW)
        plan = rnd.plan
        assert plan is not None
        if not 0 <= u < len(plan.units) or peer not in plan.group or (
                (epoch, plan.group.index(peer)) not in plan.chain(u)):
            raise BadAllReduceMessage("not_repairer", f"{peer} probed unit {u} at epoch "
                                                      f"{epoch}")
        unit = rnd.units[u]
        if unit.frame is not None:  # this peer owns it and has answered with this frame
            return unit.frame
        if unit.state.value is not None:
            v = unit.state.value
            return await encode_off_loop(
                Message(kind="part", meta=v.meta(), tensors=(v.tensor,)), RAW)
        unit.state.raise_floor(epoch)
        unit.changed.set()  # if this peer owns it: give up, a repairer took over
        if rnd.vector is None:
            return await encode_off_loop(Message(kind="absent"), RAW)
        mine = rnd.vector[plan.units[u].span].clone()  # the caller reuses its vector later
        return await encode_off_loop(
            Message(kind="contribution", meta={"w": rnd.weight}, tensors=(mine,)), rnd.codec)

    async def _serve_repair(self, rnd: RoundState, request: Repair,
                            peer: str) -> OutgoingFrame:
        plan, u, epoch = rnd.plan, request.unit, request.epoch
        assert plan is not None
        if peer not in plan.group:
            raise BadAllReduceMessage("not_a_member", f"{peer} is not in round {rnd.round_id}")
        if not 0 <= u < len(plan.units) or (epoch, rnd.me) not in plan.chain(u):
            raise BadAllReduceMessage("not_repairer", f"unit {u}, epoch {epoch}")
        try:
            async with asyncio.timeout(request.wait):
                value = await asyncio.shield(self._repair(rnd, u, epoch))
        except TimeoutError:
            raise Refusal("not_ready", f"repair of unit {u} not done in time") from None
        return await encode_off_loop(
            Message(kind="part", meta=value.meta(), tensors=(value.tensor,)), RAW)

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

