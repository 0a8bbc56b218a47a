"""``swarmd export``'s gathering and writing, between real libp2p hosts in this process.

Stage peers are ``StateServer`` s over a tiny built-in GPT's stages (as daemons serve them:
snapshot and ``state_digest``), the trainers' parts one more at ``TRAINERS_STAGE``; the
exporter sees them through a fake view. The whole model is exported and sampled from; a peer
whose weights do not match the digest it reports, one whose chunks do not match their
checksums, a stage nobody serves and a stage that lags each end the export with a typed error
naming the stage, and nothing in the target directory."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable

import pytest
import torch
import uvloop

from swarmd.config import load_config
from swarmd.errors import InconsistentCut, PartUnverified, StageUnavailable
from swarmd.export.collect import CollectSettings
from swarmd.export.run import export_model
from swarmd.export.trainer_parts import RemoteTrainers
from swarmd.protocols import Protocols
from swarmd.state.encoding import capture
from swarmd.state.round_digest import round_digest_of
from swarmd.state.serve import StateServer
from swarmd.state.transfer import _NONE
from swarmd.state.trainer_state import TRAINERS_STAGE
from transport import identity
from transport.frames import Message
from transport.host import Host, HostOptions
from swarmd.models.registry import model_hash_of, model_seam_of

pytestmark = pytest.mark.integration

CONFIG = load_config(None, {}, {"swarm.name": "export-test", "swarm.stages": 2,
                                "model.width": 16, "model.heads": 2, "model.layers": 2,
                                "model.seq_len": 16})
SEAM = model_seam_of(CONFIG)[0]
FAST = CollectSettings(deadline_s=1.0, poll_s=0.05, transfer_timeout_s=20.0)


def run(scenario: Callable[[], Awaitable[Any]]) -> Any:
    async def main() -> Any:
        return await asyncio.wait_for(scenario(), 90)

    return uvloop.run(main())


class Part:
    """One peer's module (a stage's or the trainers' parts), trained a little so that it is
    not the initial weights, at ``step``."""

    def __init__(self, stage: int, step: int, seed: int = 1) -> None:
        torch.manual_seed(seed)
        self.stage = stage
        self.module = (SEAM.build_trainer() if stage == TRAINERS_STAGE
                       else SEAM.build_stage(stage, 2))
        with torch.no_grad():
            for p in self.module.parameters():
                p.add_(torch.randn_like(p) * 0.01)
        self.optimizer = torch.optim.AdamW(self.module.parameters())
        self.step = step
        #: what this peer claims in ``state_digest`` (None: the truth)
        self.claimed: str | None = None

    async def snapshot(self) -> Any:
        return capture(self.module, self.optimizer, stage=self.stage, step=self.step,
                       model_hash=model_hash_of(CONFIG))

    async def digest(self) -> tuple[int, str]:
        return self.step, self.claimed or round_digest_of(self.module.parameters())


class View:
    def __init__(self) -> None:
        self.stages: dict[int, list[tuple[str, tuple[str, ...]]]] = {}
        self.trainer_peers: dict[str, tuple[str, ...]] = {}

    def state_sources(self, stage: int) -> list[tuple[str, tuple[str, ...]]]:
        return list(self.stages.get(stage, ()))

    def trainers(self) -> dict[str, tuple[str, ...]]:
        return dict(self.trainer_peers)


@contextlib.asynccontextmanager
async def swarm(parts: list[Part]) -> AsyncIterator[tuple[Host, View, list[StateServer]]]:
    """A host serving each part, and the exporter's host with its view of them."""
    view = View()
    async with contextlib.AsyncExitStack() as stack:
        hosts = [await stack.enter_async_context(Host(identity.generate(),
                                                      HostOptions(pubsub=None)))
                 for _ in range(len(parts) + 1)]
        servers = []
        for host, part in zip(hosts[1:], parts):
            server = StateServer(host, Protocols(CONFIG.swarm.name).state, part.snapshot,
                                 stage=part.stage, model_hash=model_hash_of(CONFIG),
                                 step=lambda part=part: part.step, weights_digest=part.digest,
                                 chunk_bytes=4096)
            server.start()
            servers.append(server)
            entry = (host.peer_id, tuple(host.addrs))
            if part.stage == TRAINERS_STAGE:
                view.trainer_peers[host.peer_id] = entry[1]
            else:
                view.stages.setdefault(part.stage, []).append(entry)
        yield hosts[0], view, servers


async def export(client: Host, view: View, out: Path, **options: Any) -> Any:
    return await export_model(client, view, CONFIG, out, parts=RemoteTrainers(
        view.trainers, wait_s=0.5, poll_s=0.05), settings=options.pop("settings", FAST),
        **options)


def test_the_whole_model_is_exported_at_one_step_and_sampled_from(tmp_path: Path) -> None:
    from swarmd.export.sample import sample
    from swarmd.models.weights import Checkpoint

    parts = [Part(0, 7, seed=1), Part(1, 7, seed=2), Part(TRAINERS_STAGE, 7, seed=3)]
    out = tmp_path / "export"

    async def scenario() -> Any:
        async with swarm(parts) as (client, view, _):
            shown: list[tuple[str, int, int]] = []
            result = await export(client, view, out, dtype="bfloat16",
                                  progress=lambda *a: shown.append(a))
            assert {p for p, _, _ in shown} == {"stage 0", "stage 1", "trainers"}
            return result

    result = run(scenario)
    assert result.step == 7 and result.kind == "builtin" and result.dtype == "bfloat16"
    assert [(p.part, p.step, p.verified) for p in result.parts] == [
        ("stage 0", 7, True), ("stage 1", 7, True), ("trainers", 7, True)]
    manifest = json.loads((out / "swarmd-export.json").read_text())
    assert manifest["step"] == 7 and manifest["tokenizer"] == "bytes"
    # the weights written are the parts' own, by the built-in model's checkpoint names
    weights = Checkpoint(out)
    stage1 = SEAM.build_stage(1, 2, weights=weights)
    for mine, theirs in zip(stage1.parameters(), parts[1].module.parameters()):
        assert torch.equal(mine, theirs.to(torch.bfloat16).float())
    from safetensors import safe_open

    dtypes = {}
    for file in out.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            dtypes.update({k: f.get_slice(k).get_dtype() for k in f.keys()})
    assert dtypes["embedding.wte.weight"] == "BF16"
    text = sample(out, "the ", max_new_tokens=5, temperature=0.0)
    assert text.tokens == 5 and sample(out, "the ", max_new_tokens=5, temperature=0.0) == text
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left


def test_a_peer_whose_weights_do_not_match_its_digest_is_named(tmp_path: Path) -> None:
    liar = Part(1, 5, seed=2)
    liar.claimed = "0" * 32
    out = tmp_path / "export"

    async def scenario() -> None:
        async with swarm([Part(0, 5), liar, Part(TRAINERS_STAGE, 5)]) as (client, view, _):
            peer = view.stages[1][0][0]
            with pytest.raises(PartUnverified) as caught:
                await export(client, view, out)
            message = str(caught.value)
            assert "stage 1" in message and peer in message and "round digest" in message

    run(scenario)
    assert not out.exists()


def test_chunks_that_do_not_match_their_checksums_are_refused(tmp_path: Path) -> None:
    out = tmp_path / "export"

    async def scenario() -> None:
        async with swarm([Part(0, 5), Part(1, 5), Part(TRAINERS_STAGE, 5)]) as (
                client, view, servers):
            honest = servers[1].serve

            async def forging(message: Message, peer: str) -> Message:
                reply = await honest(message, peer)
                if reply.kind == "state_chunk":
                    data = reply.tensors[0].clone()
                    data[0] ^= 0xFF
                    reply = Message(kind=reply.kind, meta=reply.meta, tensors=(data,))
                return reply

            servers[1].host.set_request_handler(servers[1].protocol, forging, codec=_NONE)
            with pytest.raises(PartUnverified) as caught:
                await export(client, view, out)
            assert "stage 1" in str(caught.value) and "checksum" in str(caught.value)

    run(scenario)
    assert not out.exists()


def test_a_stage_nobody_serves_is_named(tmp_path: Path) -> None:
    out = tmp_path / "export"

    async def scenario() -> None:
        async with swarm([Part(0, 5), Part(TRAINERS_STAGE, 5)]) as (client, view, _):
            with pytest.raises(StageUnavailable, match=r"stage 1 has no peer serving it"):
                await export(client, view, out)

    run(scenario)
    assert not out.exists()


def test_a_lagging_stage_is_named_or_taken_at_its_own_step(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with swarm([Part(0, 6), Part(1, 5), Part(TRAINERS_STAGE, 6)]) as (
                client, view, _):
            with pytest.raises(InconsistentCut, match=r"stage 1 at step 5 lags behind step 6"):
                await export(client, view, tmp_path / "strict")
            mixed = CollectSettings(deadline_s=0.3, poll_s=0.05, mixed=True)
            result = await export(client, view, tmp_path / "mixed", settings=mixed)
            assert result.step is None
            assert [(p.part, p.step) for p in result.parts] == [
                ("stage 0", 6), ("stage 1", 5), ("trainers", 6)]

    run(scenario)
    assert not (tmp_path / "strict").exists() and (tmp_path / "mixed").is_dir()


def test_a_stage_that_catches_up_is_waited_for(tmp_path: Path) -> None:
    behind = Part(1, 4)

    async def scenario() -> Any:
        async with swarm([Part(0, 5), behind, Part(TRAINERS_STAGE, 5)]) as (
                client, view, servers):
            async def catch_up() -> None:  # once the exporter saw it behind, twice
                while servers[1].counters.get("digests", 0) < 2:
                    await asyncio.sleep(0.01)
                behind.step = 5

            settings = CollectSettings(deadline_s=20.0, poll_s=0.05)
            async with asyncio.TaskGroup() as tg:
                tg.create_task(catch_up())
                done = tg.create_task(export(client, view, tmp_path / "out",
                                             settings=settings))
            return done.result()

    assert run(scenario).step == 5


def test_with_no_trainer_training_the_parts_saved_in_its_home_are_taken(tmp_path: Path) -> None:
    from swarmd.export.trainer_parts import SavedParts
    from swarmd.state import trainer_state

    saved = Part(TRAINERS_STAGE, 9, seed=4)
    home = tmp_path / "trainer"
    trainer_state.save(home, trainer_state.TrainerState(
        step=9, model_hash=model_hash_of(CONFIG), params=saved.module.state_dict(),
        optimizer=saved.optimizer.state_dict()))

    async def scenario() -> Any:
        async with swarm([Part(0, 5), Part(1, 5)]) as (client, view, _):
            with pytest.raises(StageUnavailable, match="no trainer is training now"):
                await export(client, view, tmp_path / "none")
            return await export_model(client, view, CONFIG, tmp_path / "out", settings=FAST,
                                      parts=RemoteTrainers(view.trainers, wait_s=0.2,
                                                           fallback=SavedParts(home)))

    result = run(scenario)
    assert result.parts[-1].part == "trainers" and result.parts[-1].step == 9
    assert result.parts[-1].source == str(trainer_state.state_path(home))
    assert not (tmp_path / "none").exists()
