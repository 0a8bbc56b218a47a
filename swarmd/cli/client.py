"""Commands that ask the running daemon (through ``<home>/api``): status, peers, swarm, stop."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from swarmd.cli.common import add_home_argument, home_from_args


#: how long ``swarmd stop`` waits when the daemon does not say how much grace it has left
STOP_TIMEOUT_S = 15.0
#: waited beyond the grace the daemon reports (its watchdog's margin, and a little more)
STOP_SLACK_S = 3.0


def _daemon_arguments(parser: argparse.ArgumentParser) -> None:
    add_home_argument(parser)


def _client(args: argparse.Namespace):
    from swarmd.api.client import DaemonClient

    return DaemonClient.for_home(home_from_args(args))


def _table(rows: list[list[str]], indent: str = "", right: frozenset[int] = frozenset(),
           widths: list[int] | None = None) -> str:
    """Rows as aligned columns (the first row is the header); ``right`` columns align right.

    ``widths`` (from :func:`_widths`) lines up several tables with one another."""
    widths = widths or _widths(rows)
    lines = []
    for row in rows:
        cells = [cell.rjust(w) if i in right else cell.ljust(w)
                 for i, (cell, w) in enumerate(zip(row, widths))]
        lines.append((indent + "  ".join(cells)).rstrip())
    return "\n".join(lines)


def _widths(rows: list[list[str]]) -> list[int]:
    return [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]


def _rate(value: float) -> str:
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def _duration(seconds: float) -> str:
    s = max(0, int(seconds))
    d, h, m, s = s // 86400, s % 86400 // 3600, s % 3600 // 60, s % 60
    if d:
        return f"{d}d {h}h {m:02d}m"
    if h:
        return f"{h}h {m:02d}m {s:02d}s"
    return f"{m}m {s:02d}s" if m else f"{s}s"


def _stage(stage: int | None) -> str:
    return "-" if stage is None else str(stage)


def cmd_status(args: argparse.Namespace):
    return _client(args).status()


def text_status(st) -> str:
    lines = [f"peer id     {st.peer_id}",
             f"swarm       {st.swarm}",
             f"version     {st.version}",
             f"state       {st.state}" + (f" ({st.grace_left_s:.1f} s of grace left)"
                                             if st.grace_left_s is not None else ""),
             f"stage       {'none' if st.stage is None else st.stage}",
             f"manifest    {st.manifest or 'unknown'}"
             + (f" ({st.manifest_from})" if st.manifest_from else ""),
             f"model       {st.model or 'unknown'}",
             f"uptime      {_duration(st.uptime_s)}",
             f"connected   {st.connected_peers} peer{'' if st.connected_peers == 1 else 's'}",
             f"throughput  {_rate(st.throughput)} samples/s",
             f"queue       {st.queue}",
             f"reachable   {st.reachability}"
             + (f" (relays: {', '.join(r[-8:] for r in st.relays)})" if st.relays else "")]
    if st.reachability_hint:
        lines.append(f"            {st.reachability_hint}")
    if st.observed_addrs:
        lines.append(f"observed    {', '.join(st.observed_addrs)}")
    for i, addr in enumerate(st.announced_addrs):
        lines.append(f"{'announces' if i == 0 else '':<12}{addr}")
    lines += _limits_lines(st.limits)
    for i, trainer in enumerate(st.trainers):
        lines.append(f"{'trainers' if i == 0 else '':<12}{trainer_line(trainer)}")
    if st.counters:
        width = max(len(name) for name in st.counters)
        for i, (name, value) in enumerate(sorted(st.counters.items())):
            lines.append(f"{'counters' if i == 0 else '':<12}{name:<{width}}  {value}")
    else:
        lines.append("counters    (none)")
    return "\n".join(lines)


def trainer_line(t) -> str:
    """One trainer of ``StatusInfo.trainers``: short peer id, step, loss, validation loss
    (and its step), shard and epoch, and how long ago it told."""
    def loss(x: float | None) -> str:
        return "-" if x is None else f"{x:.4f}"

    val = loss(t.val_loss) + (f" (step {t.val_step})" if t.val_step is not None else "")
    return (f"…{t.peer_id[-8:]}  step {t.step}  loss {loss(t.loss)}  val {val}  "
            f"shard {t.shard or '-'}  epoch {'-' if t.epoch is None else t.epoch}  "
            f"{_duration(t.heard_s)} ago")


def _size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def _limits_lines(limits: dict) -> list[str]:
    """``[limits]`` as status shows it: each cap (or off) and what it throttled."""
    if not limits:
        return []
    parts = []
    for direction in ("upload", "download"):
        d = limits.get(direction) or {}
        if not d.get("bytes_s"):
            parts.append(f"{direction} off")
            continue
        throttled = _size(d.get("throttled_bytes", 0))
        text = (f"{direction} {_size(d['bytes_s'])}/s (throttled {throttled}, waited "
                f"{d.get('waited_s', 0):.1f} s")
        parts.append(text + ")")
    if "announced_throughput" in limits:
        parts.append(f"announcing {_rate(limits['announced_throughput'])} of "
                     f"{_rate(limits.get('measured_throughput', 0))} samples/s measured")
    saved = limits.get("saved_activations") or {}
    cap = saved.get("bytes")
    second = [f"saved activations {_size(cap) if cap else 'off'}"
              + (f" (kept {_size(saved.get('kept_bytes', 0))}, refused {saved.get('refused', 0)})"
                 if cap else "")]
    memory = limits.get("device_memory_bytes")
    second.append(f"device memory {_size(memory) if memory else 'off'}")
    threads = limits.get("cpu_threads") or {}
    second.append(f"cpu threads {threads.get('set') or 'off'}"
                  + (f" (torch uses {threads['torch']})" if threads.get("torch") else ""))
    return [f"limits      {', '.join(parts)}", f"            {'; '.join(second)}"]


def cmd_peers(args: argparse.Namespace):
    return _client(args).peers()


def text_peers(peers) -> str:
    if not peers:
        return "no connected peers"
    routed = any(getattr(p, "routing", None) for p in peers)
    wired = any(getattr(p, "rate", None) is not None for p in peers)
    relayed = any(getattr(p, "path", None) == "relayed" for p in peers)  # else: all direct
    rows = [["PEER ID", "STAGE", "STATE", *(["PATH"] if relayed else []),
             *(["ROUTING"] if routed else []), *(["WIRING"] if wired else [])]]
    rows += [[p.peer_id, _stage(p.stage), p.state or "-",
              *([getattr(p, "path", None) or "-"] if relayed else []),
              *([_routing(p)] if routed else []), *([_wiring(p)] if wired else [])]
             for p in sorted(peers, key=lambda p: (p.stage is None, p.stage or 0, p.peer_id))]
    connected = sum(1 for p in peers if getattr(p, "connected", True))
    more = len(peers) - connected
    return (_table(rows) + f"\n{connected} connected peer{'' if connected == 1 else 's'}"
            + (f", {more} more our router knows" if more else ""))


def _routing(p) -> str:
    """ok, paused, slow, or banned with its reason and time left (``-``: not routed to)."""
    if not p.routing:
        return "-"
    if p.routing != "banned":
        return p.routing
    left = f", {p.ban_left_s:.0f} s left" if p.ban_left_s is not None else ""
    return f"banned ({p.ban_reason or '?'}{left})"


def _wiring(p) -> str:
    """The rate routing uses, samples/s, and the ceiling behind it: ``capped`` when the ceiling
    (announced x compute share) binds (``-``: not routed to)."""
    rate = getattr(p, "rate", None)
    if rate is None:
        return "-"
    text = f"{rate:.1f}/s" + ("" if p.measured else " (unmeasured)")
    if p.ceiling is not None and p.routing_ceiling is not None:
        text += (f", {'capped' if p.capped else 'ceiling'} {p.ceiling:.1f} x "
                 f"{p.compute_share:.2f} = {p.routing_ceiling:.1f}")
    if p.compute_s is not None:
        text += f", compute {p.compute_s * 1000:.1f} ms"
    return text


def cmd_swarm(args: argparse.Namespace):
    return _client(args).swarm()


def text_swarm(sw) -> str:
    head = (f"swarm {sw.swarm}: {sw.num_stages} stage{'' if sw.num_stages == 1 else 's'}, "
            f"{sw.peers_total} peer{'' if sw.peers_total == 1 else 's'}")
    if sw.bottleneck is not None:
        slowest = next((s for s in sw.stages if s.stage == sw.bottleneck), None)
        rate = f" ({_rate(slowest.total_throughput)} samples/s)" if slowest else ""
        head += f"; bottleneck: stage {sw.bottleneck}{rate}"
    header = ["PEER ID", "STATE", "STEP", "SAMPLES/S", "QUEUE", "AGE", "NOTE"]
    tables = [[header] + [[p.peer_id, p.state, str(p.step), _rate(p.throughput), str(p.queue),
                           f"{p.age_s:.1f}s",
                           "" if p.routable else f"not routed: {p.reason or 'no reason given'}"]
                          for p in row.peers]
              for row in sw.stages]
    widths = _widths([line for table in tables for line in table]) if tables else None
    blocks = [head]
    for row, table in zip(sw.stages, tables):
        mark = "   <== BOTTLENECK" if row.stage == sw.bottleneck else ""
        lines = [f"stage {row.stage}  {_rate(row.total_throughput)} samples/s  "
                 f"{row.routable_peers} of {len(row.peers)} peer"
                 f"{'' if len(row.peers) == 1 else 's'} routable{mark}"]
        if row.peers:
            lines.append(_table(table, indent="  ", right=frozenset({2, 3, 4, 5}),
                                widths=widths))
        else:
            lines.append("  (no peers)")
        blocks.append("\n".join(lines))
    if not sw.stages:
        blocks.append("no stages known yet")
    if sw.excluded:
        rows = [["PEER ID", "STATE", "STAGE", "REASON"]]
        rows += [[p.peer_id, p.state, _stage(p.stage), p.reason or "no reason given"]
                 for p in sw.excluded]
        blocks.append(f"excluded from routing ({len(sw.excluded)}):\n"
                      + _table(rows, indent="  "))
    return "\n\n".join(blocks)


@dataclass(frozen=True)
class StopResult:
    #: the daemon's HTTP API
    url: str
    #: True: the daemon removed its api file (it has exited)
    stopped: bool


def _stop_arguments(parser: argparse.ArgumentParser) -> None:
    add_home_argument(parser)
    parser.add_argument("--timeout", metavar="SECONDS", type=float, default=None,
                        help=f"how long to wait for the daemon to exit (default: the grace it "
                             f"has left, node.shutdown_grace_s, plus {STOP_SLACK_S:g} s)")


def cmd_stop(args: argparse.Namespace) -> StopResult:
    from swarmd.api.client import api_file_path, wait_gone
    from swarmd.api.token import read_token
    from swarmd.errors import DaemonReplyError

    home = home_from_args(args)
    client = _client(args)
    client.stop(read_token(home))
    timeout = args.timeout if args.timeout is not None else _grace_left(client) + STOP_SLACK_S
    if not wait_gone(api_file_path(home), timeout):
        raise DaemonReplyError(
            f"the daemon at {client.url} accepted the stop request but has not exited within "
            f"{timeout:g} s ({api_file_path(home)} is still there): wait a little and run "
            f"`swarmd status --home {home}`; if it hangs, stop it with Ctrl-C or `kill`")
    return StopResult(url=client.url, stopped=True)


def _grace_left(client) -> float:
    """The grace the stopping daemon says it has left (it finishes its microbatches and saves
    its checkpoint within it); ``STOP_TIMEOUT_S`` when it does not say."""
    try:
        left = client.status().grace_left_s
    except Exception:  # gone already, or a daemon too old to say: the fixed wait
        return STOP_TIMEOUT_S
    return float(left) if left is not None else STOP_TIMEOUT_S


def text_stop(result: StopResult) -> str:
    return "stopped"


# ------------------------------------------------------------------------------------- join
