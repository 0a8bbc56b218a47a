"""The offer of a checkpoint (``swarmd.state.offer``) as a value: built and checked in one
place, refused when malformed (the sender's fault, a typed error)."""

from __future__ import annotations

import pytest

from swarmd.state.offer import StateOffer
from swarmd.state.transfer import BadStateRequest
from transport.frames import Message


def test_an_offer_round_trips() -> None:
    offer = StateOffer(stage=1, step=40, model_hash="m:abc")
    back = StateOffer.from_message(Message(kind="state_offer", meta=offer.to_meta()))
    assert back == offer


@pytest.mark.parametrize("kind, meta", [
    ("state_info", {"stage": 1, "step": 4, "model_hash": "m"}),
    ("state_offer", {"stage": -1, "step": 4, "model_hash": "m"}),
    ("state_offer", {"stage": 1, "step": True, "model_hash": "m"}),
    ("state_offer", {"stage": 1, "step": 4, "model_hash": ""}),
    ("state_offer", {"stage": 1, "step": 4}),
])
def test_a_malformed_offer_is_refused(kind: str, meta: dict) -> None:
    with pytest.raises(BadStateRequest):
        StateOffer.from_message(Message(kind=kind, meta=meta))
