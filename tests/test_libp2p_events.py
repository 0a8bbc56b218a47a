"""Which py-libp2p swarm log records count as refused inbound connections (pure)."""

from __future__ import annotations

import logging

import pytest

from transport.libp2p_events import SWARM_LOGGER, counter_of


def record(msg: str, *args: object) -> logging.LogRecord:
    return logging.LogRecord(SWARM_LOGGER, logging.DEBUG, __file__, 1, msg, args, None)


FAILED = "Error handling incoming connection: %s"


@pytest.mark.parametrize("rec, name", [
    (record("failed to upgrade security for peer at %s: %s", "/ip4/1.2.3.4", "x"),
     "inbound_rejected.handshake"),
    (record("Inbound upgrade timeout (%.1fs) exceeded for %s", 10.0, "/ip4/1.2.3.4"),
     "inbound_rejected.timeout"),
    # the catch-all after a record that counted it already: not twice
    (record(FAILED, "failed to upgrade security for peer at /ip4/1.2.3.4"), None),
    (record(FAILED, "Inbound upgrade timeout exceeded for /ip4/1.2.3.4"), None),
    (record(FAILED, "fail to upgrade mux for peer Qm"), None),
    # reasons only the catch-all names
    (record(FAILED, "Connection denied by resource manager (pre-upgrade admission)"),
     "inbound_rejected.resources"),
    (record(FAILED, "Maximum connections limit reached"), "inbound_rejected.cap"),
    # garbage that broke the negotiation with an exception libp2p does not wrap
    (record(FAILED, "'utf-8' codec can't decode byte 0xff in position 0"),
     "inbound_rejected.error"),
    (record(FAILED, object()), "inbound_rejected.error"),
    (record(FAILED), "inbound_rejected.error"),  # arguments that do not format
    (record("upgraded mux for peer %s", "Qm"), None),
])
def test_a_swarm_record_counts_once_under_its_reason(rec: logging.LogRecord,
                                                      name: str | None) -> None:
    assert counter_of(rec) == name
