"""Per-peer budgets on the serving side: how much one remote peer may have in flight here. Pure.

A stage peer admits a ``forward`` or ``backward`` only while its sender has fewer than
``max_requests`` requests and fewer than ``max_bytes`` tensor bytes in flight here (a request is
in flight from its arrival until its reply), and a training forward only while its trainer
has fewer than ``max_saved`` microbatches kept here awaiting their backward (a trainer that
takes results but never sends backwards would otherwise hold every saved slot until they
expire); the excess is refused at once with ``busy``, never queued, and counted per reason
(``requests``, ``bytes`` or ``saved``). One request larger than the whole
byte budget is admitted when the peer has nothing else in flight (the transport's frame limit
bounds it), so an honest large microbatch is never refused forever.

The defaults are generous for an honest trainer (which keeps a few microbatches in flight per
stage) and still let one peer hold at most half of a stage worker's 64 saved slots through
requests it keeps open. Accounting is per peer id and bounded: a peer with nothing in flight
keeps no entry.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

__all__ = ["BudgetConfig", "Ticket", "PeerBudgets", "REASONS", "message_bytes"]

#: why a request is refused
REASONS = ("requests", "bytes", "saved")
#: peers whose refusal counts are kept (beyond it, the counts of one peer are dropped)
MAX_COUNTED_PEERS = 1024


@dataclass(frozen=True, slots=True, kw_only=True)
class BudgetConfig:
    #: requests one peer may have in flight here at once
    max_requests: int = 32
    #: tensor bytes one peer may have in flight here at once
    max_bytes: int = 256 << 20
    #: microbatches of one trainer kept here for their backward (half a worker's 64 slots)
    max_saved: int = 32

    def __post_init__(self) -> None:
        if not (isinstance(self.max_requests, int) and self.max_requests >= 1):
            raise ValueError("BudgetConfig: max_requests must be an integer >= 1")
        if not (isinstance(self.max_bytes, int) and self.max_bytes >= 1):
            raise ValueError("BudgetConfig: max_bytes must be an integer >= 1")
        if not (isinstance(self.max_saved, int) and self.max_saved >= 1):
            raise ValueError("BudgetConfig: max_saved must be an integer >= 1")


@dataclass(frozen=True, slots=True)
class Ticket:
    """What one admitted request holds; give it back with ``PeerBudgets.release``."""

    peer: str
    nbytes: int


class PeerBudgets:
    """Requests and bytes in flight per remote peer; see the module docstring."""

    def __init__(self, config: BudgetConfig | None = None) -> None:
        self.config = config or BudgetConfig()
        self._requests: dict[str, int] = {}
        self._bytes: dict[str, int] = {}
        #: refusals by reason (all peers), and by peer (at most MAX_COUNTED_PEERS peers)
        self.refused: Counter[str] = Counter()
        self.refused_by_peer: dict[str, int] = {}
        self.admitted = 0

    def admit(self, peer: str, nbytes: int) -> Ticket | str:
        """A ticket when ``peer`` may send ``nbytes`` more now, else the reason it may not."""
        nbytes = max(0, int(nbytes))
        held = self._requests.get(peer, 0)
        reason = None
        if held >= self.config.max_requests:
            reason = "requests"
        elif held and self._bytes.get(peer, 0) + nbytes > self.config.max_bytes:
            reason = "bytes"
        if reason is not None:
            return self._refused(peer, reason)
        self._requests[peer] = held + 1
        self._bytes[peer] = self._bytes.get(peer, 0) + nbytes
        self.admitted += 1
        return Ticket(peer, nbytes)

    def may_save(self, trainer: str, saved: int) -> str | None:
        """None when ``trainer``, with ``saved`` microbatches kept here, may have one more
        kept; else the reason (``saved``), counted."""
        return self._refused(trainer, "saved") if saved >= self.config.max_saved else None

    def _refused(self, peer: str, reason: str) -> str:
        self.refused[reason] += 1
        if peer in self.refused_by_peer or len(self.refused_by_peer) < MAX_COUNTED_PEERS:
            self.refused_by_peer[peer] = self.refused_by_peer.get(peer, 0) + 1
        return reason

    def release(self, ticket: Ticket) -> None:
        """The request of ``ticket`` was answered (or failed): its share is free again."""
        held = self._requests.get(ticket.peer, 0)
        if held <= 1:
            self._requests.pop(ticket.peer, None)
            self._bytes.pop(ticket.peer, None)
            return
        self._requests[ticket.peer] = held - 1
        self._bytes[ticket.peer] = max(0, self._bytes.get(ticket.peer, 0) - ticket.nbytes)

    def in_flight(self, peer: str) -> tuple[int, int]:
        """(requests, bytes) ``peer`` has in flight here now."""
        return self._requests.get(peer, 0), self._bytes.get(peer, 0)

    def peers(self) -> list[str]:
        """Peers with something in flight now."""
        return sorted(self._requests)


def message_bytes(message: object) -> int:
    """The tensor bytes a message carries (what dominates its size); 0 for what is not one."""
    total = 0
    for t in getattr(message, "tensors", ()) or ():
        try:
            total += int(t.numel()) * int(t.element_size())
        except (AttributeError, TypeError, ValueError):
            pass
    return total
