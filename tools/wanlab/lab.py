"""The lab: hosts in network namespaces behind one router namespace.

Each host ``h`` gets a namespace with one veth (``eth0``, MTU 9000, address
``198.18.<i+1>.2/24``, a route to 198.18.0.0/15 and nothing else) to the router, whose side
is called ``v<i>``. Shaping:

* the host's download: tbf on the router's ``v<i>`` (egress toward the host);
* the host's upload: tbf on the host's own ``eth0`` (rate on a sender's egress is harmless);
* delay, loss, stalls and partitions: in the router, where the FORWARD chain sends the
  packets of every host that needs it to NFQUEUE 0 and the delayer (one process, inside the
  router namespace) holds them. Delay is never on a sender's own interface: TCP small
  queues would count held packets against the socket and collapse its rate.

Teardown (``__exit__``, ``close()``, an atexit hook, a SIGTERM handler) kills every process
in the lab's namespaces and deletes them; ``python -m tools.wanlab --cleanup`` removes the
namespaces of labs whose process died.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

from tools.wanlab import netns
from tools.wanlab.spec import (LAB_MTU, HostSpec, LabError, Link, LinkState, encode_control,
                               gateway_inside_addr, host_addr, namespace_names, needs_queue,
                               private_addr, router_addr, tbf_args, validate_hosts)

REPO = Path(__file__).resolve().parents[2]
QUEUE = 0
DELAYER_START_S = 20.0
DELAYER_ANSWER_S = 10.0
STOP_GRACE_S = 5.0
_UNSET: Any = object()

#: where a gateway that is down drops packets: forwarded ones and its own (a restarting
#: router neither forwards nor answers)
_GATEWAY_CHAINS = ("FORWARD", "INPUT", "OUTPUT")
_live: list["WanLab"] = []
_checked: set[str] = set()
_live_lock = threading.Lock()
_serial = 0
_hooks_installed = False
_previous_sigterm: Any = None


class WanLab:
    """``with WanLab(hosts=[HostSpec(name="s0", link=Link(delay_ms=25, down_mbit=200,
    up_mbit=200)), ...]) as lab:`` builds the lab; ``lab.addr("s0")`` is a host's address,
    ``lab.run("s0", argv)`` starts a process inside it, ``lab.set_link(...)``, ``stall``,
    ``partition`` and ``heal`` change links while it runs, ``gateway_outage`` restarts a NAT
    gateway. Also usable with ``async with``."""

    def __init__(self, hosts: Sequence[HostSpec], *, python: str = sys.executable,
                 seed: int = 0) -> None:
        validate_hosts(hosts)
        global _serial
        with _live_lock:
            _serial += 1
            serial = _serial
        self.hosts = {h.name: h for h in hosts}
        self.links: dict[str, Link] = {h.name: h.link for h in hosts}
        self.index = {h.name: i for i, h in enumerate(hosts)}
        self.ns = namespace_names(os.getpid(), serial, hosts)
        self.python = python
        self.seed = seed
        self._procs: list[subprocess.Popen[Any]] = []
        self._queued: dict[str, bool] = {name: False for name in self.hosts}
        self._faulted: dict[str, bool] = {name: False for name in self.hosts}
        self._blocked: dict[str, bool] = {name: False for name in self.hosts}
        self._gateway_down: set[str] = set()
        self._timers: list[threading.Timer] = []
        self._gateway_lock = threading.Lock()
        self._accounted: set[tuple[str, str]] = set()
        self._delayer: subprocess.Popen[bytes] | None = None
        #: whether the delayer holds GSO packets whole (``tools.wanlab.delayer``)
        self.whole_gso = False
        self._delayer_lock = threading.Lock()
        self._control_seq = 0
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._closed = False

    # ---- lifecycle -------------------------------------------------------------------------

    @staticmethod
    def check(python: str = sys.executable) -> None:
        """Raise :class:`LabUnavailable` with the reason when this machine cannot run a lab."""
        netns.check_host(python)

    def __enter__(self) -> "WanLab":
        if self.python not in _checked:  # once per process and interpreter
            self.check(self.python)
            _checked.add(self.python)
        _install_hooks()
        with _live_lock:
            _live.append(self)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    async def __aenter__(self) -> "WanLab":
        import asyncio

        return await asyncio.get_running_loop().run_in_executor(None, self.__enter__)

    async def __aexit__(self, *exc: Any) -> None:
        import asyncio

        await asyncio.get_running_loop().run_in_executor(None, self.close)

    def close(self) -> None:
        """Stop every process of the lab and delete its namespaces. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for timer in self._timers:
            timer.cancel()
        for proc in self._procs:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in self._procs:
            try:
                proc.wait(max(0.05, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
        self._stop_delayer()
        for ns in self.ns.values():
            netns.delete_namespace(ns)
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)
        with _live_lock:
            if self in _live:
                _live.remove(self)
        if self._tmp is not None:
            self._tmp.cleanup()

    def _build(self) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="swl-")
        r = self.ns["r"]
        netns.add_namespace(r)
        netns.in_ns(r, ["sysctl", "-qw", "net.ipv4.ip_forward=1"])
        for name, i in self.index.items():
            h = self.ns[name]
            netns.add_namespace(h)
            # each connection starts afresh: no ssthresh remembered from an earlier one
            netns.in_ns(h, ["sysctl", "-qw", "net.ipv4.tcp_no_metrics_save=1"])
            edge = self.ns.get(f"{name}-gw", h)  # the namespace on the router's link
            if edge != h:
                netns.add_namespace(edge)
            _veth(r, f"v{i}", router_addr(i), edge, "eth0", host_addr(i))
            netns.sh(["ip", "-n", edge, "route", "add", "198.18.0.0/15", "via", router_addr(i)])
            if edge != h:  # the host behind its NAT gateway
                _veth(edge, "lan0", gateway_inside_addr(i), h, "eth0", private_addr(i))
                netns.sh(["ip", "-n", h, "route", "add", "198.18.0.0/15", "via",
                          gateway_inside_addr(i)])
                netns.in_ns(edge, ["sysctl", "-qw", "net.ipv4.ip_forward=1"])
                netns.in_ns(edge, [netns.IPTABLES, "-w", "-t", "nat", "-A", "POSTROUTING",
                                   "-o", "eth0", "-j", "MASQUERADE"])
                # like most home routers: a connection attempt from outside that no mapping
                # expects is dropped silently, not answered with a reset (hole punching is
                # measured against that; it also worked with resets, see test_nat_punch)
                netns.in_ns(edge, [netns.IPTABLES, "-w", "-A", "INPUT", "-i", "eth0", "-p",
                                   "tcp", "--syn", "-j", "DROP"])
        self._start_delayer()
        for name in self.hosts:
            self._apply(name, self.links[name], rates=True)

    # ---- using it --------------------------------------------------------------------------

    def addr(self, host: str) -> str:
        """The host's own lab address (198.18.x.2; behind NAT: its private 198.19.x.2)."""
        i = self._index(host)
        return private_addr(i) if self.hosts[host].nat else host_addr(i)

    def public_addr(self, host: str) -> str:
        """The address others see the host's packets come from (its NAT gateway's, if any)."""
        return host_addr(self._index(host))

    def namespace(self, host: str) -> str:
        """The host's network namespace name (``"r"``: the router's, ``"<host>-gw"``: a NAT
        gateway's)."""
        if host not in self.ns:
            raise LabError(f"no host {host!r} in this lab (namespaces: {sorted(self.ns)})")
        return self.ns[host]

    def run(self, host: str, argv: Sequence[str], **popen: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside ``host`` (``ip netns exec``); the lab stops it at teardown.
        With ``SWARMD_LOCAL_ZYGOTE=1`` a ``python -m swarmd`` command is forked from the
        zygote into the host's namespace instead (``swarmd.local.zygote``)."""
        from swarmd.local import zygote

        self._alive()
        proc: Any
        if list(argv[:3]) == [sys.executable, "-m", "swarmd"] and zygote.enabled():
            # a swarmd command forked in the namespace from the preloaded zygote (the tests)
            proc = zygote.Forked(list(argv[3:]), netns=os.path.join(netns.NETNS_DIR,
                                                                   self.namespace(host)), **popen)
        else:
            proc = subprocess.Popen(["ip", "netns", "exec", self.namespace(host), *argv], **popen)
        self._procs.append(proc)
        return proc

    @contextmanager
    def inside(self, host: str) -> Iterator[None]:
        """This thread inside ``host``'s namespace for the body: sockets made there stay
        there (see :func:`tools.wanlab.netns.entered`)."""
        self._alive()
        with netns.entered(self.namespace(host)):
            yield

    def set_link(self, host: str, *, rate_down: Any = _UNSET, rate_up: Any = _UNSET,
                 delay_ms: Any = _UNSET, loss: Any = _UNSET) -> Link:
        """Change ``host``'s link while the lab runs; rates in Mbit/s, None: unshaped.
        Returns the new link."""
        self._alive()
        self._index(host)
        old = self.links[host]
        changes = {k: v for k, v in (("down_mbit", rate_down), ("up_mbit", rate_up),
                                     ("delay_ms", delay_ms), ("loss", loss)) if v is not _UNSET}
        new = dataclasses.replace(old, **changes)
        self.links[host] = new
        self._apply(host, new, rates=new.down_mbit != old.down_mbit or new.up_mbit != old.up_mbit)
        return new

    def stall(self, host: str, seconds: float) -> None:
        """Drop every packet to and from ``host`` for ``seconds``, then carry on as before."""
        self._faulted[host] = True
        self._sync_queue(host)
        self._control([self._state(host, stall_s=seconds)])

    def partition(self, host: str) -> None:
        """Cut ``host`` off (every packet to or from it dropped) until :meth:`heal`; link
        changes meanwhile keep it cut off."""
        self._faulted[host] = True
        self._blocked[host] = True
        self._sync_queue(host)
        self._control([self._state(host)])

    def heal(self, host: str) -> None:
        """End a partition of ``host`` (a stall still running runs to its end)."""
        self._blocked[host] = False
        self._control([self._state(host)])

    def gateway_down(self, host: str) -> None:
        """``host``'s NAT gateway stops forwarding (every packet through it, to it and from it
        is dropped) and forgets its NAT mappings, as a home router that restarts; until
        :meth:`gateway_up`."""
        gw = self._gateway_ns(host)
        with self._gateway_lock:
            if host in self._gateway_down:
                return
            for chain in _GATEWAY_CHAINS:
                netns.in_ns(gw, [netns.IPTABLES, "-w", "-I", chain, "1", "-j", "DROP"])
            self._gateway_down.add(host)
            netns.flush_conntrack(gw)

    def gateway_up(self, host: str) -> None:
        """``host``'s NAT gateway is back, with an empty NAT table: connections through it
        that outlived the outage meet a router that knows nothing of them."""
        gw = self._gateway_ns(host)
        with self._gateway_lock:
            if host not in self._gateway_down or self._closed:
                return
            netns.flush_conntrack(gw)
            for chain in _GATEWAY_CHAINS:
                netns.in_ns(gw, [netns.IPTABLES, "-w", "-D", chain, "-j", "DROP"])
            self._gateway_down.discard(host)

    def gateway_outage(self, host: str, seconds: float) -> None:
        """:meth:`gateway_down` now and :meth:`gateway_up` after ``seconds`` (in a timer
        thread; the lab's teardown cancels it). Returns at once."""
        if not 0 < seconds <= 3600:
            raise LabError(f"a gateway outage lasts 0-3600 s, not {seconds}")
        self.gateway_down(host)
        timer = threading.Timer(seconds, self._gateway_up_quietly, args=(host,))
        timer.daemon = True
        self._timers.append(timer)
        timer.start()

    def gateway_is_down(self, host: str) -> bool:
        return host in self._gateway_down

    def bytes_between(self, a: str, b: str) -> int:
        """Bytes the router forwarded between hosts ``a`` and ``b`` directly (both ways, IP
        headers included), counted from the first call for this pair: traffic between them
        through a third host (a relay) is not counted."""
        self._alive()
        src, dst = self.public_addr(a), self.public_addr(b)
        pair = tuple(sorted((src, dst)))
        with self._gateway_lock:
            if pair not in self._accounted:
                for x, y in ((src, dst), (dst, src)):
                    netns.in_ns(self.ns["r"], [netns.IPTABLES, "-w", "-I", "FORWARD", "1",
                                               "-s", x, "-d", y])  # no target: counts only
                self._accounted.add(pair)
        out = netns.in_ns(self.ns["r"], [netns.IPTABLES, "-w", "-L", "FORWARD", "-v", "-x",
                                         "-n"])
        total = 0
        for line in out.splitlines():
            cols = line.split()
            # pkts bytes target prot opt in out source destination (no target: one fewer)
            if len(cols) >= 7 and cols[0].isdigit() and {cols[-2], cols[-1]} == {src, dst}:
                total += int(cols[1])
        return total

    def counters(self) -> dict[str, Any]:
        """The delayer's counters: passed, held, released, lost, blocked, overflow, and how
        late held packets left (``late_us`` in all, ``late_max_us``, ``late_over_1ms``)."""
        return self._control([], stats=True)

    @property
    def delayer_pid(self) -> int | None:
        """The delayer's process (``ip netns exec`` runs it in place): the CPU it uses is
        the lab's, taken from the cores the hosts under test share."""
        return None if self._delayer is None else self._delayer.pid

    # ---- internals -------------------------------------------------------------------------

    def _index(self, host: str) -> int:
        if host not in self.index:
            raise LabError(f"no host {host!r} in this lab (hosts: {sorted(self.index)})")
        return self.index[host]

    def _gateway_ns(self, host: str) -> str:
        self._alive()
        self._index(host)
        if not self.hosts[host].nat:
            raise LabError(f"host {host!r} is not behind a NAT gateway")
        return self.ns[f"{host}-gw"]

    def _gateway_up_quietly(self, host: str) -> None:
        try:
            self.gateway_up(host)
        except LabError as exc:  # the lab closed meanwhile
            if not self._closed:
                print(f"wanlab: bringing {host}'s gateway back failed: {exc}", file=sys.stderr)

    def _alive(self) -> None:
        if self._closed:
            raise LabError("the lab is closed")

    def _state(self, host: str, **extra: Any) -> LinkState:
        link = self.links[host]
        return LinkState(host=self.public_addr(host), delay_ms=link.delay_ms, loss=link.loss,
                         blocked=self._blocked[host], **extra)

    def _apply(self, host: str, link: Link, *, rates: bool) -> None:
        i = self._index(host)
        if rates:
            _shape(self.ns["r"], f"v{i}", link.down_mbit)
            _shape(self.ns.get(f"{host}-gw", self.ns[host]), "eth0", link.up_mbit)
        self._control([self._state(host)])
        self._sync_queue(host)

    def _sync_queue(self, host: str) -> None:
        """Send the host's forwarded packets to the delayer iff its link or a fault needs it."""
        want = needs_queue(self.links[host], self._faulted[host])
        if want == self._queued[host]:
            return
        op = "-A" if want else "-D"
        i = self._index(host)
        for side in ("-i", "-o"):
            netns.in_ns(self.ns["r"], [netns.IPTABLES, "-w", op, "FORWARD", side, f"v{i}", "-j",
                                      "NFQUEUE", "--queue-num", str(QUEUE)])
        self._queued[host] = want

    def _start_delayer(self) -> None:
        assert self._tmp is not None
        log = open(Path(self._tmp.name) / "delayer.stderr", "wb")
        env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
        self._delayer = subprocess.Popen(
            ["ip", "netns", "exec", self.ns["r"], self.python, "-m", "tools.wanlab.delayer",
             "--queue", str(QUEUE), "--seed", str(self.seed)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, cwd=REPO, env=env)
        log.close()
        reply = self._read_delayer(DELAYER_START_S)
        if not reply.get("ready"):
            raise LabError(f"the delayer did not start: {reply}")
        self.whole_gso = bool(reply.get("whole_gso"))

    def _read_delayer(self, seconds: float) -> dict[str, Any]:
        proc = self._delayer
        assert proc is not None and proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            if not sel.select(seconds):
                raise LabError(f"the delayer gave no answer within {seconds:.0f} s"
                               f"{self._delayer_stderr()}")
            line = proc.stdout.readline()
        if not line:
            raise LabError(f"the delayer exited ({proc.poll()}){self._delayer_stderr()}")
        return json.loads(line)

    def _delayer_stderr(self) -> str:
        if self._tmp is None:
            return ""
        path = Path(self._tmp.name) / "delayer.stderr"
        text = path.read_text(errors="replace")[-2000:] if path.exists() else ""
        return f": {text}" if text else ""

    def _control(self, links: list[LinkState], stats: bool = False) -> dict[str, Any]:
        self._alive()
        with self._delayer_lock:
            proc = self._delayer
            if proc is None or proc.stdin is None or proc.poll() is not None:
                raise LabError(f"the delayer is not running{self._delayer_stderr()}")
            self._control_seq += 1
            seq = self._control_seq
            proc.stdin.write(encode_control(seq, links, stats))
            proc.stdin.flush()
            reply = self._read_delayer(DELAYER_ANSWER_S)
            if reply.get("ack") != seq:
                raise LabError(f"the delayer answered {reply} to control message {seq}")
            return reply

    def _stop_delayer(self) -> None:
        proc, self._delayer = self._delayer, None
        if proc is None:
            return
        if proc.stdin is not None:
            try:
                proc.stdin.close()  # the delayer exits on EOF
            except OSError:
                pass
        try:
            proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        if proc.stdout is not None:
            proc.stdout.close()


def _veth(ns_a: str, dev_a: str, addr_a: str, ns_b: str, dev_b: str, addr_b: str) -> None:
    """A veth pair between two namespaces, MTU 9000, each end with its /24 address, up."""
    netns.sh(["ip", "-n", ns_a, "link", "add", dev_a, "mtu", str(LAB_MTU), "type", "veth",
              "peer", "name", dev_b, "netns", ns_b, "mtu", str(LAB_MTU)])
    for ns, dev, addr in ((ns_a, dev_a, addr_a), (ns_b, dev_b, addr_b)):
        netns.sh(["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev])
        netns.sh(["ip", "-n", ns, "link", "set", dev, "up"])


def _shape(ns: str, dev: str, mbit: float | None) -> None:
    if mbit is None:
        netns.sh(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
    else:
        netns.sh(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", *tbf_args(mbit)])


# ---- teardown on exit and on SIGTERM ---------------------------------------------------------

def close_all() -> None:
    """Tear down every lab this process still holds."""
    with _live_lock:
        labs = list(_live)
    for lab in labs:
        try:
            lab.close()
        except Exception as exc:  # keep closing the others
            print(f"wanlab: teardown of {lab.ns['r']} failed: {exc}", file=sys.stderr)


def _on_sigterm(signum: int, frame: Any) -> None:
    close_all()
    previous = _previous_sigterm
    if callable(previous):
        previous(signum, frame)
    elif previous != signal.SIG_IGN:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


def _install_hooks() -> None:
    global _hooks_installed, _previous_sigterm
    if _hooks_installed:
        return
    atexit.register(close_all)
    if threading.current_thread() is threading.main_thread():
        _previous_sigterm = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, _on_sigterm)
    _hooks_installed = True
