"""``swarmd`` commands forked from a process that has already imported everything.

A ``python -m swarmd join`` spends seconds importing torch, py-libp2p, sympy and the rest
before it does anything; the test suite starts about a hundred such processes. The zygote is
one interpreter that imports them once and then forks each command: a real process with its
own pid, stdio, environment, working directory, signals and exit status, running
``swarmd.cli.main`` as ``python -m swarmd`` does, over the real network stack. Nothing is
shared after the fork.

Forking is only safe from a process with one thread and no event loop: the zygote only
imports (and checks it still has one thread before each fork); a command creates its threads,
event loops and torch's thread pools after the fork (``limits.cpu_threads``, read after the
fork, sets torch's). One difference from a fresh interpreter: numpy's OpenBLAS, which starts
its threads when numpy is imported, runs on one thread (``OPENBLAS_NUM_THREADS=1`` in the
zygote); swarmd does its math in torch.

``SWARMD_LOCAL_ZYGOTE=1`` makes :func:`swarmd_popen` (and so ``swarmd.local.swarm``'s
daemons) use a zygote of this process, started on first use; the processes it starts find it
again through ``SWARMD_ZYGOTE_SOCKET``. Unset or ``0``: real interpreters. The test suite sets
it (tests/conftest.py); ``swarmd demo`` and the benchmarks run real interpreters.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import select
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any, Sequence

#: the ``swarmd`` package's directory (this module is ``swarmd/local/zygote.py``)
SWARMD_DIR = Path(__file__).resolve().parents[1]

ENABLE_ENV = "SWARMD_LOCAL_ZYGOTE"
SOCKET_ENV = "SWARMD_ZYGOTE_SOCKET"

#: imported in the zygote besides every module of swarmd and transport: what torch imports
#: lazily on a daemon's first model build and optimizer (seconds each, in every process)
PRELOAD = ("torch", "torch._dynamo", "torch._refs", "torch._prims_common", "torch.optim",
           "torch.fx.experimental.symbolic_shapes", "sympy", "uvloop", "trio", "libp2p",
           "transformers", "safetensors.torch", "tokenizers")

_MAX_REQUEST = 1 << 20


def enabled() -> bool:
    return os.environ.get(ENABLE_ENV, "0") not in ("", "0", "off", "false", "no")


def swarmd_popen(args: Sequence[str], **kwargs: Any) -> Any:
    """``subprocess.Popen([python, "-m", "swarmd", *args], **kwargs)``, forked from the zygote
    when it is enabled (:class:`Forked` has the Popen methods the launcher and tests use)."""
    if enabled():
        return Forked(list(args), **kwargs)
    return subprocess.Popen([sys.executable, "-m", "swarmd", *args], **kwargs)


def swarmd_run(args: Sequence[str], *, timeout: float | None = None, check: bool = False,
               capture_output: bool = False, **kwargs: Any) -> subprocess.CompletedProcess[Any]:
    """``subprocess.run`` of ``python -m swarmd *args``, through :func:`swarmd_popen`."""
    if capture_output:
        kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc = swarmd_popen(args, **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    if check:
        done.check_returncode()
    return done


# ---------------------------------------------------------------------------------- client

class _Owner:
    """The zygote this process started (one per process, closed at exit)."""

    lock = threading.Lock()
    proc: subprocess.Popen[bytes] | None = None
    path: str | None = None


def prestart() -> None:
    """Start this process's zygote now, without waiting for its imports (they overlap with
    whatever runs next); a no-op when one runs or it is disabled."""
    if enabled() and not _inherited():
        with _Owner.lock:
            _start()


def _inherited() -> str | None:
    path = os.environ.get(SOCKET_ENV)
    return path if path and os.path.exists(path) and _Owner.path != path else None


def _start() -> None:
    if _Owner.proc is None or _Owner.proc.poll() is not None:
        directory = tempfile.mkdtemp(prefix="swarmd-zygote-")
        path = os.path.join(directory, "socket")
        # stdin is a pipe from this process: the zygote exits when it closes (we exit)
        _Owner.proc = subprocess.Popen(
            [sys.executable, "-m", "swarmd.local.zygote", path], stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL, env={**os.environ, SOCKET_ENV: path})
        _Owner.path = path
        atexit.register(_close_owned, _Owner.proc, directory)


def _zygote_path() -> str:
    """The socket of the zygote to ask: the one a parent process passed down, else ours
    (started if needed; waits for its imports)."""
    inherited = _inherited()
    if inherited:
        return inherited
    with _Owner.lock:
        _start()
        proc, path = _Owner.proc, _Owner.path
        assert proc is not None and path is not None
        deadline = time.monotonic() + 300
        while not os.path.exists(path):
            if proc.poll() is not None:
                raise RuntimeError(f"the zygote exited with {proc.returncode}")
            if time.monotonic() > deadline:
                raise TimeoutError("the zygote did not start within 300 s")
            time.sleep(0.05)
        os.environ[SOCKET_ENV] = path  # what this process starts finds it too
        return path


def _close_owned(proc: subprocess.Popen[bytes], directory: str) -> None:
    if proc.stdin is not None:
        proc.stdin.close()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
    for name in os.listdir(directory):
        os.unlink(os.path.join(directory, name))
    os.rmdir(directory)


def _fd_for(spec: Any, default: int, mode: str) -> tuple[int, int | None]:
    """(fd to give the child, our end of a pipe or None) for a Popen-style stdio spec."""
    if spec is None:
        return default, None
    if spec == subprocess.DEVNULL:
        return os.open(os.devnull, os.O_RDWR), None
    if spec == subprocess.PIPE:
        r, w = os.pipe()
        return (r, w) if mode == "w" else (w, r)
    if isinstance(spec, int):
        return spec, None
    return spec.fileno(), None


class Forked:
    """A ``swarmd`` command forked from the zygote, with the part of ``subprocess.Popen``'s
    interface the launcher and the tests use (``pid``, ``returncode``, ``stdin``/``stdout``/
    ``stderr``, ``poll``, ``wait``, ``communicate``, ``send_signal``, ``terminate``,
    ``kill``). ``netns``: the path of a network namespace (``/run/netns/NAME``) the command
    runs in, as under ``ip netns exec NAME`` (the WAN lab's hosts)."""

    def __init__(self, args: list[str], *, stdin: Any = None, stdout: Any = None,
                 stderr: Any = None, env: dict[str, str] | None = None,
                 cwd: str | Path | None = None, text: bool = False,
                 universal_newlines: bool = False, netns: str | None = None) -> None:
        self.args = [sys.executable, "-m", "swarmd", *args]
        self.returncode: int | None = None
        text = text or universal_newlines
        specs = [(stdin, 0, "w"), (stdout, 1, "r"), (stderr, 2, "r")]
        if stderr == subprocess.STDOUT:
            specs[2] = (None, -1, "r")
        given, ours = [], []
        try:
            for spec, default, mode in specs:
                fd, mine = _fd_for(spec, default, mode)
                given.append(fd)
                ours.append(mine)
            if stderr == subprocess.STDOUT:
                given[2] = given[1]
            path = _zygote_path()  # first: sets SOCKET_ENV, which the command inherits
            request = json.dumps({
                "args": list(args), "cwd": str(cwd) if cwd is not None else os.getcwd(),
                "env": dict(os.environ if env is None else env), "netns": netns}).encode()
            self._report, theirs = socket.socketpair()
            control = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                control.connect(path)
                socket.send_fds(control, [request], [theirs.fileno(), *given])
            finally:
                control.close()
                theirs.close()
            self._buffer = b""
            line = self._line(None) or ""
            if not line.startswith("pid "):
                raise RuntimeError(f"the zygote did not start {args[:1]}: {line.strip()}")
            self.pid = int(line.split()[1])
        finally:
            for (spec, _, _), fd in zip(specs, given):
                if spec in (subprocess.DEVNULL, subprocess.PIPE):
                    os.close(fd)
        streams: list[IO[Any] | None] = []
        for (_, _, mode), mine in zip(specs, ours):
            if mine is None:
                streams.append(None)
            elif text:
                streams.append(open(mine, mode, encoding="utf-8", errors="replace"))
            else:
                streams.append(open(mine, mode + "b", buffering=0 if mode == "w" else -1))
        self.stdin, self.stdout, self.stderr = streams

    def _line(self, timeout: float | None) -> str | None:
        """The zygote's next line about this process; None when none came within
        ``timeout`` (its "pid" and "exit" lines may arrive in one read: kept in a buffer of
        our own, which a select on the socket cannot see into)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            readable, _, _ = select.select([self._report], [], [], left)
            if not readable:
                return None
            data = self._report.recv(4096)
            if not data:  # the zygote is gone
                line, self._buffer = self._buffer, b""
                return line.decode()
            self._buffer += data
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line.decode()

    def poll(self) -> int | None:
        if self.returncode is None:
            line = self._line(0)
            if line is not None:
                self._exited(line)
        return self.returncode

    def _exited(self, line: str) -> None:
        if not line.startswith("exit "):
            raise RuntimeError(f"the zygote lost process {self.pid}: {line.strip()!r}")
        self.returncode = int(line.split()[1])
        self._report.close()

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            line = self._line(timeout)
            if line is None:
                raise subprocess.TimeoutExpired(self.args, timeout)  # type: ignore[arg-type]
            self._exited(line)
        assert self.returncode is not None
        return self.returncode

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[Any, Any]:
        """Like Popen's: write ``input``, read stdout and stderr to their end, wait."""
        if self.stdin is not None:
            if input:
                self.stdin.write(input)
            self.stdin.close()
        deadline = None if timeout is None else time.monotonic() + timeout
        chunks: dict[Any, list[Any]] = {}
        with selectors.DefaultSelector() as sel:
            for stream in (self.stdout, self.stderr):
                if stream is not None and not stream.closed:
                    sel.register(stream, selectors.EVENT_READ)
                    chunks[stream] = []
            while sel.get_map():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(self.args, timeout)  # type: ignore[arg-type]
                for key, _ in sel.select(left):
                    stream = key.fileobj
                    data = os.read(stream.fileno(), 1 << 16)  # type: ignore[union-attr]
                    if data:
                        chunks[stream].append(data)
                    else:
                        sel.unregister(stream)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        self.wait(left)
        out = []
        for stream in (self.stdout, self.stderr):
            if stream is None:
                out.append(None)
                continue
            data = b"".join(chunks.get(stream, []))
            out.append(data.decode("utf-8", "replace") if "b" not in stream.mode else data)
            stream.close()
        return out[0], out[1]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __enter__(self) -> "Forked":
        return self

    def __exit__(self, *exc: Any) -> None:
        for stream in (self.stdin, self.stdout, self.stderr):
            if stream is not None:
                stream.close()
        self.wait()


# ---------------------------------------------------------------------------------- server

def _preload() -> None:
    import importlib
    import pkgutil

    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # else numpy's import starts threads

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # an optional library: the command imports it (or fails) itself
            pass
    # every module of both packages, found on disk: the program's, not this module's imports
    import transport

    for name, path in (("swarmd", str(SWARMD_DIR)), ("transport", *transport.__path__)):
        for info in pkgutil.walk_packages([path], name + "."):
            if info.name.endswith("__main__") or info.name == "swarmd.local.zygote":
                continue
            try:
                importlib.import_module(info.name)
            except Exception:
                pass


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def serve(path: str) -> None:
    """Import everything, listen at ``path``, fork each command asked for, report each exit;
    return when stdin closes (the process that started the zygote is gone)."""
    _preload()
    # the children's garbage collections leave the preloaded objects alone: their pages stay
    # shared with the zygote instead of being copied into every child on its first collection
    gc.collect()
    gc.freeze()
    if _threads() != 1:
        raise SystemExit(f"zygote: {_threads()} threads after the imports; cannot fork safely")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # the client waits for the path: ready once it exists
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "listener")
    sel.register(sys.stdin.fileno(), selectors.EVENT_READ, "owner")
    children: dict[int, tuple[int, socket.socket]] = {}  # pidfd: (pid, report)

    def close_in_child() -> None:
        sel.close()
        listener.close()
        for pidfd, (_, report) in children.items():
            os.close(pidfd)
            report.close()

    while True:
        for key, _ in sel.select():
            if key.data == "owner":
                if not os.read(sys.stdin.fileno(), 4096):
                    return  # the children go on, as processes started with Popen would
            elif key.data == "listener":
                conn, _ = listener.accept()
                with conn:
                    msg, fds, _, _ = socket.recv_fds(conn, _MAX_REQUEST, 4)
                if len(fds) != 4 or not msg:
                    for fd in fds:
                        os.close(fd)
                    continue
                report = socket.socket(fileno=fds[0])
                request = json.loads(msg)
                if _threads() != 1:
                    report.sendall(f"error the zygote has {_threads()} threads\n".encode())
                    report.close()
                    for fd in fds[1:]:
                        os.close(fd)
                    continue
                pid = os.fork()
                if pid == 0:
                    report.close()
                    close_in_child()
                    _child(request, fds[1:])  # never returns
                for fd in fds[1:]:
                    os.close(fd)
                pidfd = os.pidfd_open(pid)
                children[pidfd] = (pid, report)
                sel.register(pidfd, selectors.EVENT_READ, "child")
                try:
                    report.sendall(f"pid {pid}\n".encode())
                except OSError:
                    pass  # the asker is gone; the child is reaped all the same
            else:
                pidfd = key.fd
                pid, report = children.pop(pidfd)
                sel.unregister(pidfd)
                os.close(pidfd)
                _, status = os.waitpid(pid, 0)
                try:
                    report.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
                except OSError:
                    pass  # nobody waits for it any more
                report.close()


def _child(request: dict[str, Any], stdio: list[int]) -> None:
    """In the forked process: become ``python -m swarmd *args`` and exit as it would."""
    code = 1
    try:
        if request.get("netns"):
            _enter_netns(request["netns"])
        for target, fd in enumerate(stdio):
            if fd != target:
                os.dup2(fd, target)
        for fd in set(stdio):
            if fd > 2:
                os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sys.argv = [str(SWARMD_DIR / "__main__.py"), *request["args"]]
        code = _run(request["args"])
    finally:
        os._exit(code)


def _enter_netns(path: str) -> None:
    """This process into the network namespace at ``path`` (interfaces, routes and
    ``/proc/net`` follow it), what ``ip netns exec`` does for the network."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
            raise OSError(ctypes.get_errno(), f"setns {path}")
    finally:
        os.close(fd)


def _run(args: list[str]) -> int:
    """The ``swarmd`` command with ``args``, run as ``python -m swarmd`` runs it (its
    ``__main__``: the process's program, not a module this one imports), then what the
    interpreter does at exit: wait for the threads that are not daemons, run the atexit
    functions, flush stdout and stderr."""
    import atexit as exits
    import runpy
    import traceback

    status: Any
    try:
        sys.argv[1:] = args
        runpy.run_module("swarmd", run_name="__main__")
        status = 0
    except SystemExit as exc:
        status = exc.code
    except KeyboardInterrupt:
        traceback.print_exc()
        status = 130
    except BaseException:
        traceback.print_exc()
        status = 1
    if status is None:
        status = 0
    elif not isinstance(status, int):
        print(status, file=sys.stderr)
        status = 1
    try:
        threading._shutdown()  # type: ignore[attr-defined]
    except BaseException:
        traceback.print_exc()
    exits._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    return status


if __name__ == "__main__":
    serve(sys.argv[1])
