"""wanlab: an emulated internet for tests and benchmarks, in network namespaces.

Hosts live in their own network namespaces behind one router namespace; each host's link has
its own download and upload rate (tbf), one-way delay and loss (an NFQUEUE delayer in the
router), and can be stalled, partitioned and changed while the lab runs::

    from tools.wanlab import HostSpec, Link, WanLab

    with WanLab(hosts=[HostSpec(name="a", link=Link(delay_ms=25, down_mbit=200, up_mbit=200)),
                       HostSpec(name="b", link=Link(delay_ms=25, down_mbit=200, up_mbit=200))]
                ) as lab:
        proc = lab.run("b", ["python", "-m", "http.server", "--bind", lab.addr("b"), "8000"])
        lab.set_link("a", rate_down=50, loss=0.01)    # a rate change and loss, mid-run
        lab.stall("a", 3.0)                           # 100% loss for 3 s, then recovered
        lab.partition("b"); lab.heal("b")
        with lab.inside("a"):                         # sockets made here live in a's netns
            sock = socket.create_connection((lab.addr("b"), 8000))

Facts it is built on (this kernel): no netem; tbf works (its burst needs about rate/HZ);
NFQUEUE works through iptables-legacy and netfilterqueue gives exact delays; delay packets in
the router, never on the sender's own egress (TCP small queues collapse the sender's rate);
a Python delayer handles about 17,000 packets/s, hence MTU 9000 on lab links; one TCP
connection's send buffer is capped at 4 MiB, about 25-40 MB/s at 100 ms RTT.

``HostSpec(name=..., nat=True)`` puts a host behind its own NAT gateway (a namespace that
masquerades): ``lab.addr(h)`` is then its private 198.19.<i+1>.2, which no other host can
reach, and ``lab.public_addr(h)`` the gateway's 198.18.<i+1>.2 that others see.

Addresses: host i is 198.18.<i+1>.2 (198.18.0.0/15, benchmarking space); hosts have a route to
198.18.0.0/15 through the router and no other route; nothing leaves the lab. Namespaces are
named ``swl-<pid>-<serial>-<host>`` (``-r``: the router), so labs never collide.

Needs root, iproute2, iptables (iptables-legacy), libnetfilter-queue-dev and the
netfilterqueue package (``tools/setup.sh --test`` installs them when run as root or on CI).
:meth:`WanLab.check` raises :class:`LabUnavailable` saying what is missing. Leftovers of a
killed process: ``python -m tools.wanlab --cleanup``.
"""

from tools.wanlab.lab import WanLab, close_all
from tools.wanlab.spec import HostSpec, LabError, LabUnavailable, Link

__all__ = ["WanLab", "HostSpec", "Link", "LabError", "LabUnavailable", "close_all"]
