"""The lab's delayer: holds each packet the router forwards for its path's one-way delay,
drops what loss, a stall or a partition says, and releases the rest at their due time, in
order per path.

Runs as one process per lab inside the router namespace, started by :class:`WanLab`::

    ip netns exec <router ns> python -m tools.wanlab.delayer --queue 0

It binds NFQUEUE ``--queue`` (the router's FORWARD chain sends packets of hosts that need it
there) and asks the kernel for GSO packets whole (``NFQA_CFG_F_GSO``: a TCP sender's
segments that travel as one buffer are held and released as one, about a third fewer
packets for this process than one per segment; the loss of such a packet is that of any
of its segments), prints ``{"ready": true, "whole_gso": ...}`` on stdout once bound, then
reads control lines
(:func:`tools.wanlab.spec.encode_control`) on stdin and answers each with ``{"ack": seq, ...}``
(counters when asked). It exits when stdin closes: with the lab, or when the lab's process died.

:class:`DelayLine` is the pure part (time and randomness passed in); :func:`main` is the I/O.
"""

from __future__ import annotations

import heapq
import json
import math
import os
import random
import select
import socket
import struct
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, TypeVar

from tools.wanlab.spec import LAB_MTU, LabError, LinkState, decode_control

P = TypeVar("P")

#: packets held at once; beyond this new packets are dropped (counted in ``overflow``)
MAX_HELD = 60_000
#: the kernel queue's length: packets waiting for a verdict, held ones included
KERNEL_QUEUE_LEN = 65_536
#: a TCP segment's payload at the lab's MTU (IPv4 and TCP headers without options)
SEGMENT_BYTES = LAB_MTU - 40
#: a packet released this much after its due time is counted late (``late_over_1ms``): the
#: delayer did not get the CPU in time, and the path's delay was longer than its profile's
LATE_S = 1e-3


@dataclass(slots=True)
class _HostState:
    delay_s: float = 0.0
    loss: float = 0.0
    blocked: bool = False
    stalled_until: float = 0.0


@dataclass(slots=True)
class DelayLine(Generic[P]):
    """Per-host delay and loss for packets keyed by (source, destination) address.

    ``offer(now, src, dst, packet)`` says ``"drop"``, ``"pass"`` (nothing to wait for) or
    ``"held"``; ``due(now)`` hands back the held packets whose time has come, in due order
    (and counts how late: ``late_us``, their total, ``late_max_us``, ``late_over_1ms``);
    ``next_due()`` says when the next one is due. Packets of one path leave in the order they
    came, also when its delay shrinks while some are held (a packet that could pass waits
    while an earlier one of its path is held)."""

    rng: random.Random
    max_held: int = MAX_HELD
    hosts: dict[bytes, _HostState] = field(default_factory=dict)
    held: list[tuple[float, int, tuple[bytes, bytes], P]] = field(default_factory=list)
    last_due: dict[tuple[bytes, bytes], float] = field(default_factory=dict)
    held_per_path: dict[tuple[bytes, bytes], int] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=lambda: {
        "passed": 0, "held": 0, "released": 0, "lost": 0, "blocked": 0, "overflow": 0,
        "late_us": 0, "late_max_us": 0, "late_over_1ms": 0})
    _seq: int = 0

    def configure(self, now: float, state: LinkState) -> None:
        key = bytes(int(x) for x in state.host.split("."))
        h = self.hosts.setdefault(key, _HostState())
        h.delay_s, h.loss, h.blocked = state.delay_ms / 1e3, state.loss, state.blocked
        if state.stall_s > 0:
            h.stalled_until = now + state.stall_s

    def offer(self, now: float, src: bytes, dst: bytes, packet: P, segments: int = 1) -> str:
        """``segments``: how many packets of the wire ``packet`` stands for (a GSO buffer):
        it is lost when any of them would be."""
        a, b = self.hosts.get(src), self.hosts.get(dst)
        delay = 0.0
        for h in (a, b):
            if h is None:
                continue
            if h.blocked or now < h.stalled_until:
                self.counters["blocked"] += 1
                return "drop"
            if h.loss > 0 and self.rng.random() < 1.0 - (1.0 - h.loss) ** segments:
                self.counters["lost"] += 1
                return "drop"
            delay += h.delay_s
        path = (src, dst)
        due = max(now + delay, self.last_due.get(path, 0.0))
        waiting = self.held_per_path.get(path, 0)
        if due <= now and not waiting:
            self.counters["passed"] += 1
            return "pass"
        if len(self.held) >= self.max_held:
            self.counters["overflow"] += 1
            return "drop"
        self.last_due[path] = due
        self.held_per_path[path] = waiting + 1
        self._seq += 1
        heapq.heappush(self.held, (due, self._seq, path, packet))
        self.counters["held"] += 1
        return "held"

    def due(self, now: float) -> list[P]:
        out = []
        # (lateness in locals, the counters once: this runs for every packet held)
        late_s, late = 0.0, 0
        first_due = self.held[0][0] if self.held else now  # the earliest: the latest out
        while self.held and self.held[0][0] <= now:
            due, _, path, packet = heapq.heappop(self.held)
            late_s += now - due
            late += now - due > LATE_S
            left = self.held_per_path[path] - 1
            if left:
                self.held_per_path[path] = left
            else:
                del self.held_per_path[path]
            out.append(packet)
        if out:
            c = self.counters
            c["released"] += len(out)
            c["late_us"] += int(late_s * 1e6)
            c["late_over_1ms"] += late
            c["late_max_us"] = max(c["late_max_us"], int((now - first_due) * 1e6))
        return out

    def next_due(self) -> float | None:
        return self.held[0][0] if self.held else None


# ---- the process ------------------------------------------------------------------------------

def _serve(queue_num: int, seed: int) -> None:  # pragma: no cover - runs in the router netns
    import time

    from netfilterqueue import COPY_PACKET, NetfilterQueue

    line: DelayLine[Any] = DelayLine(rng=random.Random(seed))
    clock: Callable[[], float] = time.monotonic

    def on_packet(pkt: Any) -> None:
        head = pkt.get_payload()  # the first 20 bytes: the IPv4 header
        verdict = line.offer(clock(), head[12:16], head[16:20], pkt, segments(head))
        if verdict == "pass":
            pkt.accept()
        elif verdict == "drop":
            pkt.drop()

    nfq = NetfilterQueue()
    nfq.bind(queue_num, on_packet, max_len=KERNEL_QUEUE_LEN, mode=COPY_PACKET, range=20)
    nfq_fd = nfq.get_fd()
    # (no packet is queued yet: the lab sends packets here only once this process is ready)
    whole_gso = _ask_whole_gso(nfq_fd, queue_num)
    stdin = sys.stdin.buffer.fileno()
    os.set_blocking(stdin, False)
    buf = b""
    _say({"ready": True, "pid": os.getpid(), "whole_gso": whole_gso})
    try:
        while True:
            nxt = line.next_due()
            timeout = None if nxt is None else max(0.0, nxt - clock())
            readable, _, _ = select.select([nfq_fd, stdin], [], [], timeout)
            if nfq_fd in readable:
                nfq.run(block=False)
            for pkt in line.due(clock()):
                pkt.accept()
            if stdin in readable:
                chunk = os.read(stdin, 65536)
                if not chunk:
                    return  # the lab closed our stdin, or its process is gone
                buf += chunk
                while b"\n" in buf:
                    raw, buf = buf.split(b"\n", 1)
                    _control(line, raw, clock())
    finally:
        nfq.unbind()


def segments(head: bytes) -> int:
    """How many wire packets an IPv4 packet with this header stands for: more than one for a
    GSO buffer longer than the MTU (its total length is the whole buffer's)."""
    if len(head) < 4:
        return 1
    total = int.from_bytes(head[2:4], "big")
    return max(1, math.ceil((total - 40) / SEGMENT_BYTES))


#: nfnetlink: the queue subsystem's config message, its attributes and the GSO flag
_NFNL_SUBSYS_QUEUE, _NFQNL_MSG_CONFIG = 3, 2
_NFQA_CFG_MASK, _NFQA_CFG_FLAGS, _NFQA_CFG_F_GSO = 4, 5, 1 << 2
_NLM_F_REQUEST, _NLM_F_ACK, _NLMSG_ERROR = 1, 4, 2


def gso_config_message(queue_num: int, seq: int = 1) -> bytes:
    """The netlink message that asks for queue ``queue_num``'s GSO packets whole."""
    def attr(kind: int, value: int) -> bytes:
        return struct.pack("=HH", 8, kind) + struct.pack(">I", value)

    body = struct.pack("=BBH", socket.AF_UNSPEC, 0, socket.htons(queue_num))
    body += attr(_NFQA_CFG_MASK, _NFQA_CFG_F_GSO) + attr(_NFQA_CFG_FLAGS, _NFQA_CFG_F_GSO)
    return struct.pack("=IHHII", 16 + len(body), (_NFNL_SUBSYS_QUEUE << 8) | _NFQNL_MSG_CONFIG,
                       _NLM_F_REQUEST | _NLM_F_ACK, seq, 0) + body


def acked(reply: bytes, seq: int = 1) -> bool:
    """Whether ``reply`` is the kernel's success answer (an error message with 0) to ``seq``."""
    if len(reply) < 20:
        return False
    _, kind, _, got, _ = struct.unpack_from("=IHHII", reply)
    return kind == _NLMSG_ERROR and got == seq and struct.unpack_from("=i", reply, 16)[0] == 0


def _ask_whole_gso(fd: int, queue_num: int) -> bool:  # pragma: no cover - the router netns
    """Ask on the queue's own netlink socket (the kernel takes a queue's config only from its
    owner); False where the kernel refuses (then one packet per segment, as before)."""
    sock = socket.socket(fileno=os.dup(fd))
    try:
        sock.settimeout(5.0)
        sock.send(gso_config_message(queue_num))
        return acked(sock.recv(4096))
    except OSError:
        return False
    finally:
        sock.close()  # the duplicate: the queue's socket stays open


def _control(line: DelayLine[Any], raw: bytes, now: float) -> None:
    try:
        seq, links, stats = decode_control(raw)
    except LabError as exc:
        _say({"error": str(exc)})
        return
    for state in links:
        line.configure(now, state)
    _say({"ack": seq, **({"counters": dict(line.counters), "holding": len(line.held)}
                         if stats else {})})


def _say(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:  # pragma: no cover - runs in the router netns
    import argparse

    parser = argparse.ArgumentParser(description="the wanlab NFQUEUE delayer")
    parser.add_argument("--queue", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0, help="seeds the loss decisions")
    args = parser.parse_args(argv)
    try:
        _serve(args.queue, args.seed)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
