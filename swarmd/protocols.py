"""Every libp2p protocol id and gossip topic swarmd speaks, built in this one place.

The swarm's name is part of each, so two swarms never exchange a message; the ``1`` is the
protocol's version (a peer answers only what it speaks). Pure: strings in, strings out.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Protocols", "VERSION", "MANIFEST"]

VERSION = 1
#: the swarm manifest (``swarmd.manifest``): the one id without a swarm name, since a joiner
#: asks it before it knows the swarm's name
MANIFEST = f"/swarmd/manifest/{VERSION}"


@dataclass(frozen=True, slots=True)
class Protocols:
    """The ids of one swarm: ``Protocols("my-swarm").forward == "/swarmd/my-swarm/1/forward"``."""

    swarm: str

    def _id(self, name: str) -> str:
        return f"/swarmd/{self.swarm}/{VERSION}/{name}"

    # the pipeline (swarmd.pipeline): activations down, gradients up, answers to the trainer
    @property
    def forward(self) -> str:
        return self._id("forward")

    @property
    def backward(self) -> str:
        return self._id("backward")

    @property
    def result(self) -> str:
        return self._id("result")

    @property
    def grad(self) -> str:
        return self._id("grad")

    @property
    def abandon(self) -> str:
        return self._id("abandon")

    @property
    def step_report(self) -> str:
        """A stage's report of its step to the trainer (``swarmd.pipeline.exact``)."""
        return self._id("step")

    @property
    def norm_note(self) -> str:
        """A part's squared norm of a trainer's step, to the stage peers stepping with it
        (``swarmd.pipeline.exact``, "Norm notes")."""
        return self._id("norm")

    @property
    def flush(self) -> str:
        """A trainer's request that a stage step now on what it holds of that trainer's
        earlier steps (``swarmd.pipeline.exact``)."""
        return self._id("flush")

    # a stage's step (swarmd.averaging): progress, prepare and start, then the all-reduce
    @property
    def round(self) -> str:
        return self._id("round")

    @property
    def allreduce(self) -> str:
        return self._id("allreduce")

    # reachability (swarmd.node.dialback): "can you dial me back?"
    @property
    def dialback(self) -> str:
        return self._id("dialback")

    # a stage's state for joiners (swarmd.state)
    @property
    def state(self) -> str:
        return self._id("state")

    # a checkpoint of a stage a peer no longer serves, offered to that stage's peers
    # (swarmd.state.offer): the offer, and the offered state (the state protocol's messages)
    @property
    def offer(self) -> str:
        return self._id("offer")

    @property
    def offered_state(self) -> str:
        return self._id("offered-state")

    # the model a peer trains, to say what differs from ours (swarmd.pipeline.model_info)
    @property
    def model(self) -> str:
        return self._id("model")

    # membership (swarmd.membership): pull anti-entropy, push of one announcement, gossip
    @property
    def view(self) -> str:
        return self._id("view")

    @property
    def announce(self) -> str:
        return self._id("announce")

    @property
    def announce_topic(self) -> str:
        return f"swarmd/{self.swarm}/announce/{VERSION}"

    def pipeline(self) -> dict[str, str]:
        """The pipeline's ids keyed by message kind."""
        return {"forward": self.forward, "backward": self.backward, "result": self.result,
                "grad": self.grad, "abandon": self.abandon, "step_report": self.step_report,
                "flush": self.flush, "norm_note": self.norm_note}
