"""Errors of swarmd. Each carries a short machine-readable ``code`` and the process exit status
the CLI uses for it; the message is one line meant for the operator (what is wrong, where, and
what to do)."""

from __future__ import annotations


class SwarmdError(Exception):
    """Base of every error raised by ``swarmd`` (not ``transport``)."""

    #: short machine-readable code (JSON error replies, metrics labels)
    code = "swarmd_error"
    #: exit status of the CLI when this error ends a command: 1 other failure, 2 config/usage
    exit_status = 1


class ConfigError(SwarmdError):
    """The configuration (file, environment variable or flag) is invalid; names key and source."""

    code = "config"
    exit_status = 2


class DataError(SwarmdError):
    """The training data is unusable: the path is missing, holds no text, or is too short."""

    code = "data"
    exit_status = 2


class HomeError(SwarmdError):
    """The home directory is missing, not initialised or unusable."""

    code = "home"


class BadPeerMessage(SwarmdError):
    """A message from a remote peer is unusable; the peer (or a relay) is at fault, not us.

    ``reason`` is a short machine-readable cause, used as the key of drop counters. The message
    is dropped and counted; nothing else changes.
    """

    code = "bad_peer_message"

    def __init__(self, reason: str, detail: str = "") -> None:
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}" if detail else reason)


class BadAnnouncement(BadPeerMessage):
    """A membership announcement was forged, unsigned, stale, oversized or malformed."""

    code = "bad_announcement"


class BadPullMessage(BadPeerMessage):
    """A membership pull request or page (view exchange between neighbours) is unusable."""

    code = "bad_pull_message"


class ListenError(SwarmdError):
    """A local server could not bind its address (in use, not on this machine, no permission)."""

    code = "listen"


class InternalError(SwarmdError):
    """A bug in swarmd itself: nothing the operator or a peer did wrong. Please report it."""

    code = "internal_error"


class DaemonUnreachable(SwarmdError):
    """The CLI found a daemon's address in ``<home>/api`` but nothing answers there."""

    code = "daemon_unreachable"


class DaemonReplyError(SwarmdError):
    """The daemon answered the CLI with an error (or with something that is not its API)."""

    code = "daemon_error"

    def __init__(self, message: str, *, status: int | None = None,
                 reply_code: str | None = None) -> None:
        super().__init__(message)
        #: the HTTP status of the reply, None if the reply was not HTTP at all
        self.status = status
        #: the ``error.code`` of the daemon's JSON reply, if it had one
        self.reply_code = reply_code


class BadActivation(BadPeerMessage):
    """Activations or gradients a peer sent are unusable (shape, dtype, NaN/Inf, stage)."""

    code = "bad_activation"


class UnknownMicrobatch(SwarmdError):
    """A backward for a microbatch this peer never saw, already did, or has expired."""

    code = "unknown_microbatch"


class StageBusy(SwarmdError):
    """This peer holds as many microbatches as it may: the sender should route elsewhere."""

    code = "busy"


class WrongStage(SwarmdError):
    """A request for a stage (or a model) this peer does not serve: route it elsewhere."""

    code = "wrong_stage"


class StageUnavailable(SwarmdError):
    """No peer of a stage took the work: the stage is missing or every peer of it failed."""

    code = "stage_unavailable"


class ModelMismatch(SwarmdError):
    """A request for another model (name or architecture hash) than this peer trains."""

    code = "model_hash_mismatch"


class NotOnPath(BadPeerMessage):
    """A result, gradient or backward from a peer that is not the one the microbatch went to
    along its path (or for a microbatch that did not go that way): refused, nothing changes."""

    code = "not_on_path"


class OutputRefused(SwarmdError):
    """The next peer refused what this side produced (bad activation, too large, codec): our
    bug or our weights went bad, never that peer's fault. Nobody is banned for it; a sender
    before us in the chain judges the peer that says this as failed."""

    code = "output_refused"


class TrainerUnreachable(SwarmdError):
    """The last stage could not reach the microbatch's trainer at the addresses the trainer
    announced (or it announced none yet): not this stage's fault; the trainer restarts it."""

    code = "trainer_unreachable"


class ModelError(SwarmdError):
    """The model cannot be built or loaded: an unsupported architecture, a bad ``config.json``,
    a weights file with a missing or misshapen tensor, a tokenizer that does not fit the model,
    or a ``model.factory`` that does not resolve. Names the file, what is wrong and what is
    supported."""

    code = "model"
    exit_status = 2


class BadRoundMessage(BadPeerMessage):
    """A message of a stage's round protocol (progress, prepare, start) that is malformed or
    not the sender's to send (a ``start`` from a peer that does not lead the stage, a group
    of peers that are not the stage's, a claimed sample count beyond what a peer can do)."""

    code = "bad_round_message"


class ExportTargetError(SwarmdError):
    """``swarmd export --out DIR`` cannot be written: DIR is not empty, is a file, or its
    parent is not writable. Nothing was downloaded; choose another directory."""

    code = "export_target"
    exit_status = 2


class InconsistentCut(SwarmdError):
    """The stages of an export were not all at one step before its deadline; names the stage
    that lags. Export again (once training paused), wait longer, or accept a mixed cut."""

    code = "inconsistent_cut"


class PartUnverified(SwarmdError):
    """No peer of a stage (or no trainer) gave weights that pass an export's checks: the
    transfer's chunk checksums and digest, the round digest the part's peers report for that
    step, the model's names and shapes. Those peers are at fault; names the part, each peer
    and why."""

    code = "part_unverified"


class BadManifest(BadPeerMessage):
    """A swarm manifest a peer sent is unusable: over its size limit (``oversized``), not
    canonical or not a valid configuration (``malformed``), sent without that peer's own
    signed announcement (``bad_announcement``), not the one the announcement names
    (``hash_mismatch``), or naming a tokenizer.json whose bytes do not have the manifest's
    sha256 (``tokenizer_mismatch``). That peer is at fault: the joiner counts it and asks
    another."""

    code = "bad_manifest"


class ManifestConflict(ConfigError):
    """This peer's own settings differ from its swarm's manifest: one line per differing key,
    with this peer's value and the swarm's. Set them as the swarm does, or remove them from
    this peer's configuration to take the swarm's."""

    code = "manifest_conflict"


class ManifestUnavailable(SwarmdError):
    """No bootstrap peer gave a manifest that passes the checks (each peer and why named)."""

    code = "manifest_unavailable"
    exit_status = 2
