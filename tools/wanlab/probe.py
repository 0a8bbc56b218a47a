"""Measurements through a running lab, from this process: sockets are made inside the hosts'
namespaces (:meth:`WanLab.inside`) and driven from threads here, so no helper process runs.

Every loop is bounded in count and time; every socket has a timeout; MB = 10**6 bytes.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

CHUNK = 1 << 20


def _listener(lab: Any, host: str, kind: int = socket.SOCK_STREAM) -> socket.socket:
    with lab.inside(host):
        s = socket.socket(socket.AF_INET, kind)
    s.bind((lab.addr(host), 0))
    if kind == socket.SOCK_STREAM:
        s.listen(64)
    s.settimeout(10.0)
    return s


def _client(lab: Any, host: str, kind: int = socket.SOCK_STREAM,
            timeout: float = 10.0) -> socket.socket:
    with lab.inside(host):
        s = socket.socket(socket.AF_INET, kind)
    s.settimeout(timeout)
    return s


def connect_rtt_ms(lab: Any, src: str, dst: str, count: int = 5) -> list[float]:
    """TCP connect times from ``src`` to ``dst`` in ms: one round trip each (SYN, SYN-ACK)."""
    ls = _listener(lab, dst)
    port = ls.getsockname()[1]
    out = []
    try:
        for _ in range(count):
            c = _client(lab, src)
            try:
                t = time.perf_counter()
                c.connect((lab.addr(dst), port))
                out.append((time.perf_counter() - t) * 1e3)
            finally:
                c.close()
            ls.accept()[0].close()
    finally:
        ls.close()
    return out


def can_connect(lab: Any, src: str, dst: str, timeout: float = 1.0) -> bool:
    """Whether a TCP connection from ``src`` to ``dst`` completes within ``timeout``."""
    ls = _listener(lab, dst)
    c = _client(lab, src, timeout=timeout)
    try:
        c.connect((lab.addr(dst), ls.getsockname()[1]))
        return True
    except OSError:
        return False
    finally:
        c.close()
        ls.close()


def tcp_stream_MBps(lab: Any, src: str, dst: str, *, seconds: float = 3.0,
                    max_bytes: int = 4 << 30) -> dict[str, float]:
    """One TCP connection from ``src`` to ``dst``: send for ``seconds`` (or ``max_bytes``),
    then close; the rate is bytes received over the time from connect until the receiver saw
    the end. Also the rate over the second half of the run (past slow start)."""
    ls = _listener(lab, dst)
    ls.settimeout(seconds + 30.0)
    marks: list[tuple[float, int]] = []
    errors: list[BaseException] = []

    def receive() -> None:
        try:
            s, _ = ls.accept()
            s.settimeout(seconds + 30.0)
            buf = bytearray(CHUNK)
            got = 0
            with s:
                while (n := s.recv_into(buf)) > 0:
                    got += n
                    marks.append((time.perf_counter(), got))
        except BaseException as exc:  # reported by the caller
            errors.append(exc)

    th = threading.Thread(target=receive, name="wanlab-probe-recv", daemon=True)
    th.start()
    c = _client(lab, src, timeout=seconds + 30.0)
    data = bytes(CHUNK)
    sent = 0
    try:
        t0 = time.perf_counter()
        c.connect((lab.addr(dst), ls.getsockname()[1]))
        while time.perf_counter() - t0 < seconds and sent < max_bytes:
            c.sendall(data)
            sent += len(data)
        c.shutdown(socket.SHUT_WR)
        th.join(seconds + 60.0)
    finally:
        c.close()
        ls.close()
    if errors or not marks:
        raise RuntimeError(f"the stream from {src} to {dst} failed: {errors}")
    t_end, total = marks[-1]
    half = next((m for m in marks if m[0] >= t0 + (t_end - t0) / 2), marks[0])
    late = (total - half[1]) / max(1e-9, t_end - half[0]) / 1e6
    return {"MBps": total / (t_end - t0) / 1e6, "second_half_MBps": late,
            "bytes": float(total), "seconds": t_end - t0}


def udp_delivery(lab: Any, src: str, dst: str, *, count: int = 400,
                 interval_s: float = 0.002, wait_s: float = 1.0) -> float:
    """Send ``count`` small UDP datagrams from ``src`` to ``dst``; the share that arrived."""
    rx = _listener(lab, dst, socket.SOCK_DGRAM)
    tx = _client(lab, src, socket.SOCK_DGRAM)
    got = 0
    try:
        target = (lab.addr(dst), rx.getsockname()[1])
        for i in range(count):
            tx.sendto(i.to_bytes(4, "big"), target)
            time.sleep(interval_s)
        rx.settimeout(0.05)
        deadline = time.monotonic() + wait_s
        while got < count and time.monotonic() < deadline:
            try:
                rx.recv(64)
                got += 1
            except socket.timeout:
                continue
    finally:
        rx.close()
        tx.close()
    return got / count
