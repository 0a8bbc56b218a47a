"""The ``model`` reply (swarmd.pipeline.model_info): built and checked in one place, unknown
keys dropped, malformed replies refused with a typed error."""

from __future__ import annotations

import pytest

from swarmd.errors import BadActivation
from swarmd.models.seam import fingerprint_of
from swarmd.pipeline.model_info import MAX_FIELDS, ModelInfo, mismatched_peers, parse_model_info
from transport.frames import Message


def test_a_model_info_round_trips_and_drops_unknown_keys() -> None:
    fp = fingerprint_of({"dtype": "float32", "hf.hidden_size": 32, "sizes": [1, 2]})
    wire = ModelInfo(name="m", hash=fp.hash, fields=fp.fields).wire()
    wire["meta"]["extra"] = "ignored"
    got = parse_model_info(Message(**wire))
    assert got == ModelInfo(name="m", hash=fp.hash, fields=fp.fields)
    assert fp.differences(got.fields) == []


@pytest.mark.parametrize("meta", [
    {}, {"name": "m", "hash": 3, "fields": {}}, {"name": "", "hash": "h", "fields": {}},
    {"name": "m", "hash": "h", "fields": []},
    {"name": "m", "hash": "h", "fields": {str(i): i for i in range(MAX_FIELDS + 1)}},
    {"name": "m", "hash": "h", "fields": {"k": "x" * 10_000}},
])
def test_a_malformed_model_info_is_refused(meta: dict) -> None:
    with pytest.raises(BadActivation):
        parse_model_info(Message(kind="model", meta=meta))
    with pytest.raises(BadActivation):
        parse_model_info(Message(kind="ok", meta={"name": "m", "hash": "h", "fields": {}}))


def test_mismatched_peers_are_the_stage_peers_kept_out_for_another_model() -> None:
    from swarmd.api.types import PeerRow, StageRow, SwarmInfo

    def row(peer: str, stage: int | None, reason: str | None) -> PeerRow:
        return PeerRow(peer_id=peer, stage=stage, state="online", throughput=1.0, queue=0,
                       routable=reason is None, reason=reason, addrs=(f"/ip4/127.0.0.1/{peer}",))

    info = SwarmInfo(swarm="s", num_stages=1, bottleneck=0, stages=(StageRow(
        stage=0, peers=(row("a", 0, None), row("b", 0, "model_hash_mismatch")),
        total_throughput=1.0, routable_peers=1),),
        excluded=(row("t", None, "model_hash_mismatch"),))
    assert mismatched_peers(info) == [("b", ("/ip4/127.0.0.1/b",))]
