"""The swarm manifest without daemons: the document (canonical, hashed, bounded, checked), the
settlement (take the swarm's settings or name each own one that differs), the home (adopted
files, kept manifest) and the protocol between libp2p hosts in this process (a forged
manifest, one over its limit, a tokenizer that does not match its hash: each counted and
refused, the next bootstrap peer asked)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections import Counter
from pathlib import Path
from typing import Any, AsyncIterator

import pytest
import uvloop

from swarmd.config import Config, load_config
from swarmd.errors import BadManifest, ManifestConflict, ManifestUnavailable
from swarmd.manifest import document
from swarmd.manifest.document import Manifest, TokenizerRef, decode, file_sha256
from swarmd.manifest.local import (MANIFEST_FILE, MODEL_DIR, adopt, keep, kept, manifest_of,
                                   own_keys, validate)
from swarmd.manifest.settle import conflict_text, differences, settle
from swarmd.manifest.local import swarm_manifest

LLAMA = {"model_type": "llama", "vocab_size": 300, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 64, "rms_norm_eps": 1e-06,
         "transformers_version": "4.99", "architectures": ["LlamaForCausalLM"]}


def hf_dir(path: Path, config: dict[str, Any] = LLAMA, tokenizer: bytes | None = None) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    if tokenizer is not None:
        (path / "tokenizer.json").write_bytes(tokenizer)
    return path


def founder(tmp_path: Path, tokenizer: bytes | None = b'{"a tokenizer": 1}', **env: str
            ) -> tuple[Config, Manifest, bytes | None]:
    model = hf_dir(tmp_path / "llama", tokenizer=tokenizer)
    config = load_config(None, {"SWARMD_MODEL_HF": str(model), "SWARMD_SWARM_NAME": "hf-swarm",
                                "SWARMD_TRAINING_LR": "0.001", **env})
    manifest, data = manifest_of(config)
    return config, manifest, data


# ---- the document -------------------------------------------------------------------------

def test_a_manifest_is_canonical_hashed_and_round_trips(tmp_path: Path) -> None:
    _, manifest, data = founder(tmp_path)
    raw = manifest.to_bytes()
    assert decode(raw, expect_hash=manifest.hash) == manifest
    assert raw == document.canonical(json.loads(raw)) and len(manifest.hash) == 32
    assert manifest.kind == "hf" and manifest.settings["training.lr"] == 0.001
    # what changes nothing is left out: another transformers version gives the same manifest
    assert "transformers_version" not in manifest.hf_config
    assert "architectures" not in manifest.hf_config
    assert manifest.tokenizer == TokenizerRef(sha256=file_sha256(data), size=len(data))
    assert "llama, 4 layers of width 32" in manifest.model_text()
    builtin = swarm_manifest(load_config(None, {}))
    assert builtin.kind == "builtin" and builtin.tokenizer is None
    assert builtin.hash != manifest.hash


def test_what_a_manifest_leaves_out_is_what_the_model_fingerprint_leaves_out() -> None:
    from swarmd.models.hf import _VOLATILE

    assert document.IGNORED_CONFIG_KEYS == _VOLATILE


@pytest.mark.parametrize("change, reason", [
    (lambda raw: raw + b" " * (document.MAX_MANIFEST_BYTES), "oversized"),
    (lambda raw: raw.replace(b'"training.lr":0.001', b'"training.lr":0.002'), "hash_mismatch"),
    (lambda raw: raw[:-1], "malformed"),
])
def test_bad_bytes_are_refused_with_their_reason(tmp_path: Path, change: Any,
                                                 reason: str) -> None:
    _, manifest, _ = founder(tmp_path)
    bad = change(manifest.to_bytes())
    with pytest.raises(BadManifest) as caught:  # checked in this order: size, hash, contents
        decode(bad, expect_hash=manifest.hash if reason != "malformed" else None)
    assert caught.value.reason == reason


@pytest.mark.parametrize("edit", [
    lambda d: d.update(extra=1),                                     # unknown top-level key
    lambda d: d["settings"].pop("training.lr"),                      # a setting missing
    lambda d: d["settings"].update({"training.lr": "fast"}),         # of the wrong type
    lambda d: d["settings"].update({"model.layers": 4}),             # not a key of an hf model
    lambda d: d.update(tokenizer={"sha256": "x", "size": 3}),        # not a sha256
    lambda d: d.update(tokenizer={"sha256": "a" * 64, "size": 1 << 40}),  # too large
    lambda d: d["hf_config"].update(transformers_version="1"),       # keys that change nothing
    lambda d: d.update(format="swarmd-manifest/9"),
])
def test_a_malformed_document_is_refused(tmp_path: Path, edit: Any) -> None:
    _, manifest, _ = founder(tmp_path)
    raw = json.loads(manifest.to_bytes())
    edit(raw)
    with pytest.raises(BadManifest) as caught:
        decode(document.canonical(raw))
    assert caught.value.reason == "malformed"


def test_bytes_not_in_canonical_form_are_refused(tmp_path: Path) -> None:
    _, manifest, _ = founder(tmp_path)
    spaced = json.dumps(json.loads(manifest.to_bytes()), indent=1).encode()
    with pytest.raises(BadManifest, match="canonical"):
        decode(spaced)


def test_settings_that_are_no_valid_configuration_are_refused(tmp_path: Path) -> None:
    _, manifest, _ = founder(tmp_path)
    bad = dataclasses.replace(manifest, settings={**manifest.settings, "wire.codec": "int9"})
    with pytest.raises(BadManifest, match="wire.codec"):
        validate(bad)


# ---- the settlement -----------------------------------------------------------------------

def test_a_volunteer_with_no_settings_takes_everything(tmp_path: Path) -> None:
    _, swarm, _ = founder(tmp_path)
    mine = load_config(None, {})
    ours = swarm_manifest(mine)
    assert own_keys(mine, ours) == frozenset()
    outcome = settle(ours, own_keys(mine, ours), swarm)
    assert outcome.ok
    assert {"model", "tokenizer", "swarm.name", "training.lr"} <= set(outcome.adopted)


def test_own_settings_that_differ_are_named_one_line_each(tmp_path: Path) -> None:
    _, swarm, _ = founder(tmp_path)
    mine = load_config(None, {"SWARMD_TRAINING_LR": "0.01", "SWARMD_WIRE_CODEC": "fp16",
                              "SWARMD_MODEL_WIDTH": "64"})
    ours = swarm_manifest(mine)
    outcome = settle(ours, own_keys(mine, ours), swarm)
    lines = [d.line() for d in outcome.conflicts]
    assert lines == ["model = 'the built-in GPT' here, 'a Hugging Face model (model.hf)' in "
                     "the swarm", "training.lr = 0.01 here, 0.001 in the swarm",
                     "wire.codec = 'fp16' here, 'int8' in the swarm"]
    text = conflict_text(outcome.conflicts, swarm.hash, "peer P")
    assert text.count("\n") == len(lines) + 1 and swarm.hash in text


def test_an_own_copy_of_another_model_names_each_config_key(tmp_path: Path) -> None:
    _, swarm, _ = founder(tmp_path)
    other = hf_dir(tmp_path / "wide", {**LLAMA, "hidden_size": 64, "transformers_version": "1"},
                   tokenizer=b'{"a tokenizer": 1}')
    mine = load_config(None, {"SWARMD_MODEL_HF": str(other)})
    ours = swarm_manifest(mine)
    outcome = settle(ours, own_keys(mine, ours), swarm)
    assert [d.line() for d in outcome.conflicts] == [
        "config.json hidden_size = 64 here, 32 in the swarm"]
    assert set(outcome.adopted) == {"swarm.name", "training.lr"}
    # a trainer takes nothing: every difference counts
    assert {d.key for d in differences(ours, swarm)} == {
        "config.json hidden_size", "swarm.name", "training.lr"}


# ---- the home -----------------------------------------------------------------------------

def test_adopting_writes_the_model_and_tokenizer_and_gives_the_swarms_manifest(
        tmp_path: Path) -> None:
    _, swarm, data = founder(tmp_path)
    home = tmp_path / "home"
    mine = load_config(None, {"SWARMD_MODEL_THREADS": "1"})
    outcome = settle(swarm_manifest(mine), own_keys(mine, swarm_manifest(mine)), swarm)
    result = adopt(mine, swarm, data, home, outcome.adopted)
    assert result.model.hf == str(home / MODEL_DIR) and result.model.threads == 1
    assert (home / MODEL_DIR / "tokenizer.json").read_bytes() == data
    assert json.loads((home / MODEL_DIR / "config.json").read_text())["hidden_size"] == 32
    assert manifest_of(result)[0] == swarm and result.swarm.name == "hf-swarm"
    keep(home, swarm)
    assert kept(home) == swarm
    (home / MANIFEST_FILE).write_bytes(b"{not json")
    assert kept(home) is None  # unusable: ignored (logged), never trusted


# ---- the protocol between hosts -----------------------------------------------------------

@contextlib.asynccontextmanager
async def hosts(n: int) -> AsyncIterator[list[Any]]:
    from transport import identity
    from transport.host import Host, HostOptions

    async with contextlib.AsyncExitStack() as stack:
        yield [await stack.enter_async_context(Host(identity.generate(),
                                                    HostOptions(pubsub=None)))
               for _ in range(n)]


def signed(host: Any, manifest_hash: str) -> bytes:
    import time

    from swarmd.membership.announcement import Announcement, PeerState, encode_signed
    from transport.signing import signer

    ann = Announcement(peer_id=host.peer_id, addrs=tuple(host.addrs), stage=0,
                       state=PeerState.ONLINE, throughput=0.0, queue=0, version="t",
                       model_hash="m:h", timestamp=time.time(), period=10.0,
                       manifest=manifest_hash)
    return encode_signed(ann, signer(host.identity))


def serve(host: Any, manifest: Any, tokenizer: bytes | None, *, announced: str | None = None
          ) -> None:
    from swarmd.manifest.service import ManifestServer

    wire = signed(host, manifest.hash if announced is None else announced)
    ManifestServer(host, manifest, tokenizer, lambda: wire).start()


class _Forged:
    """A manifest whose bytes are not the ones announced (or too large)."""

    def __init__(self, real: Manifest, data: bytes) -> None:
        self.hash, self.tokenizer, self._data = real.hash, real.tokenizer, data

    def to_bytes(self) -> bytes:
        return self._data


def test_a_joiner_refuses_forged_oversized_and_mismatched_answers_and_asks_the_next_peer(
        tmp_path: Path) -> None:
    from swarmd.manifest.service import fetch_manifest

    _, manifest, data = founder(tmp_path)
    assert data is not None
    forged = _Forged(manifest, manifest.to_bytes().replace(b"0.001", b"0.100"))
    huge = _Forged(manifest, manifest.to_bytes() + b" " * document.MAX_MANIFEST_BYTES)

    async def scenario() -> dict[str, Any]:
        async with hosts(6) as (liar, big, badtok, good, old, client):
            serve(liar, forged, data)
            serve(big, huge, data)
            serve(badtok, manifest, data[:-1] + b"!")   # the tokenizer's bytes altered
            serve(good, manifest, data)
            counters: Counter[str] = Counter()
            got = await fetch_manifest(client, [liar.addrs[0], big.addrs[0], badtok.addrs[0],
                                                old.addrs[0], good.addrs[0]],
                                       counters=counters, timeout_s=10)
            alone: Counter[str] = Counter()
            with pytest.raises(ManifestUnavailable) as caught:
                await fetch_manifest(client, [liar.addrs[0]], counters=alone, timeout_s=10)
            return {"got": got, "counters": counters, "error": str(caught.value)}

    out = uvloop.run(asyncio.wait_for(scenario(), 90))
    assert out["got"].manifest == manifest and out["got"].tokenizer == data
    assert out["counters"] == Counter({"refused.hash_mismatch": 1, "refused.oversized": 1,
                                       "refused.tokenizer_mismatch": 1, "unanswered": 1,
                                       "tokenizer_fetched": 1, "fetched": 1})
    assert "\n" not in out["error"] and "hash_mismatch" in out["error"]
    assert "--bootstrap" in out["error"]


def test_nobody_answering_is_not_a_refusal(tmp_path: Path) -> None:
    import socket

    from swarmd.manifest.service import fetch_manifest

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dead = f"/ip4/127.0.0.1/tcp/{port}/p2p/12D3KooWEr6KXGJvxwpQJcEk9mz6RfQ9MwVyTbAtvL7pev1J6wpx"

    async def scenario() -> Any:
        async with hosts(1) as (client,):
            counters: Counter[str] = Counter()
            return await fetch_manifest(client, [dead], counters=counters, timeout_s=5), counters

    got, counters = uvloop.run(asyncio.wait_for(scenario(), 60))
    assert got is None and counters == Counter({"unanswered": 1})


def test_a_trainer_of_other_settings_is_refused_naming_each(tmp_path: Path) -> None:
    from swarmd.manifest.join import check_trainer

    _, manifest, data = founder(tmp_path)
    trainer = load_config(None, {"SWARMD_MODEL_HF": str(tmp_path / "llama"),
                                 "SWARMD_SWARM_NAME": "hf-swarm",
                                 "SWARMD_TRAINING_LR": "0.001",
                                 "SWARMD_TRAINING_SCHEDULE": "pipelined"})

    async def scenario() -> None:
        async with hosts(2) as (stage, client):
            serve(stage, manifest, data)
            peer = await client.dial(stage.addrs[0])
            with pytest.raises(ManifestConflict) as caught:
                await check_trainer(client, trainer, [peer])
            assert "training.schedule = 'pipelined' here, 'sync' in the swarm" in str(
                caught.value)
            assert await check_trainer(client, dataclasses.replace(
                trainer, training=dataclasses.replace(trainer.training, schedule="sync")),
                [peer]) == manifest

    uvloop.run(asyncio.wait_for(scenario(), 60))
