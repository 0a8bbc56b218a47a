"""What serving one stage is built of: its ``StageServer`` (forward, backward, averaging) and
its ``StageKeeper`` (state from checkpoints and peers), wired to the daemon's membership.

The daemon (``swarmd.node.daemon``) owns their lifecycle; this module only builds them, and
says when a joiner waits for its stage's mates before it decides where its state comes from
(``mates_expected``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from swarmd.config import Config
from swarmd.node.host_options import apply_stage_limits, codec_spec


def mates_expected(membership: Any, stage: int, *, bootstrapping: bool) -> Callable[[], bool]:
    """For ``StageKeeper``: whether a joiner of ``stage`` with no mate among its state
    sources yet should wait for one. It should while no view has been pulled though a
    bootstrap was given (nothing is known yet), and while the view shows another peer holding
    the stage's state (``View.stage_has_state``: online, or at a step > 0). A first peer of a
    stage, whose view shows nobody holding it, decides at once."""
    def expected() -> bool:
        return ((bootstrapping and not membership.has_view.is_set())
                or membership.stage_has_state(stage))

    return expected


def build_server(config: Config, host: Any, *, stage: int, seam: Any, module: Any, device: Any,
                 dtype: Any, membership: Any, averager: Any, keeper: Callable[[], Any],
                 addrs_of: Callable[[str], tuple[str, ...]], trainers: Any = None) -> Any:
    """The ``StageServer`` of ``stage`` around ``module`` (built by ``seam``); ``keeper()`` is
    the stage's keeper (built after the server), told when a mate is ahead or the stage
    drifted; ``trainers`` (a ``TrainerBook``) keeps what trainers tell of their runs. A stage
    that does not fit this machine's limits is refused here (``apply_stage_limits``)."""
    from swarmd.models.registry import model_hash_of
    from swarmd.averaging.stage_sync import SyncSettings
    from swarmd.pipeline.server import MAX_BATCH, StageServer
    from swarmd.state.replay import ReplayLog
    from swarmd.training.swarm_optim import OptimSettings

    c = config
    server = StageServer(
        host, swarm=c.swarm.name, stage=stage, num_stages=c.swarm.stages,
        seam=seam, model_hash=model_hash_of(c), codec=codec_spec(c),
        lr=c.training.lr, seed=c.training.seed, peers_of=membership.peers_of,
        max_tokens=4 * c.training.batch_size * min(seam.max_seq_len, c.model.seq_len),
        device=device, dtype=dtype, optim=OptimSettings.from_config(c.training),
        target_batch_size=c.target_batch_size(), averager=averager,
        sync=SyncSettings(compression=c.averaging.compression,
                          aggregator=c.averaging.aggregator,
                          timeout_s=c.averaging.timeout_s),
        on_behind=lambda peer, step: keeper().behind(peer, step), module=module,
        on_diverged=lambda peer, step: keeper().diverged(peer, step),
        max_batch=c.serving.max_batch(device.type, MAX_BATCH),
        step_drains=c.serving.drains(stage), addrs_of=addrs_of,
        replay=ReplayLog(max_steps=c.state.replay_steps, max_bytes=c.state.replay_max_bytes),
        trainers=trainers)
    apply_stage_limits(c, server)
    return server


def build_keeper(config: Config, host: Any, server: Any, *, home: Path, membership: Any,
                 stage: int, bootstrapping: bool) -> Any:
    """The ``StageKeeper`` of ``server``'s stage: its state sources and announced steps are
    the view's, and it waits for mates the view shows (``mates_expected``)."""
    from swarmd.models.registry import model_hash_of
    from swarmd.state.keeper import StageKeeper

    return StageKeeper(
        host, server, swarm=config.swarm.name, home=home, model_hash=model_hash_of(config),
        every_steps=config.checkpoint.every_steps,
        sources=lambda: membership.state_sources(stage),
        mates_expected=mates_expected(membership, stage, bootstrapping=bootstrapping),
        announced_steps=lambda: membership.steps_of(stage),
        weights_digest=lambda: server.run_exclusive(
            lambda: (server.stepper.weights_step, server.stepper.round_digest())))
