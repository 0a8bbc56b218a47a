"""The daemon's local HTTP API: JSON endpoints, Prometheus metrics and a status page.

One :class:`HttpApi` serves one :class:`swarmd.api.types.DaemonApi`, the same functions the CLI
prints (``swarmd status`` is ``GET /api/v0/status``)::

    token = create_token(home)
    async with HttpApi(daemon, listen=config.http.listen, token=token,
                       allow_non_loopback=config.http.allow_non_loopback) as http:
        write_api_file(home, http.url)   # swarmd.runfiles: the CLI finds the daemon by it
        ...

Routes::

    GET  /api/v0/id       IdInfo
    GET  /api/v0/status   StatusInfo
    GET  /api/v0/swarm    SwarmInfo
    GET  /api/v0/peers    [ConnectedPeer]: connected peers and those our router knows, with
                          how it treats them (ok/paused/slow/banned, a ban's reason and time
                          left, protocol violations) and their budget refusals here
    GET  /api/v0/training TrainingInfo: the trainers this stage serves, with their loss curves
    POST /api/v0/stop     202, then the daemon shuts down; needs ``Authorization: Bearer <token>``
    GET  /metrics         Prometheus text format 0.0.4 (with each trainer's step, loss and
                          validation loss: ``swarmd_trainer_*{trainer=...}``)
    GET  /                the page (swarmd/api/page.html), which polls status and swarm every 2 s

Every error is JSON ``{"error": {"code": ..., "message": ...}}``: 404 ``not_found``, 405
``method_not_allowed`` (with ``Allow``), 401 ``unauthorized`` (no token), 403 ``forbidden``
(wrong token), 503 when the daemon raises a :class:`SwarmdError` (``error.code`` is its code)
or does not answer within :data:`HANDLER_TIMEOUT_S`, and 500 ``internal_error`` for any other
exception: a bug in swarmd, logged with its traceback. Each error response is counted by status
in ``swarmd_http_errors_total``.
"""

from __future__ import annotations

import asyncio
import errno
import hmac
import ipaddress
import json
import logging
from collections.abc import Awaitable, Callable, Iterator
from importlib.resources import files
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from prometheus_client import CollectorRegistry, Counter, ProcessCollector
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest

from swarmd.api.metrics import counter_families, histogram_families
from swarmd.api.types import PEER_STATES, DaemonApi, StatusInfo, SwarmInfo, to_json
from swarmd.errors import ConfigError, InternalError, ListenError, SwarmdError

__all__ = ["HttpApi", "HANDLER_TIMEOUT_S", "BUG_REPORT_HINT", "parse_listen"]

log = logging.getLogger(__name__)

#: a daemon function that takes longer is answered with 503 (below the CLI's 5 s timeout)
HANDLER_TIMEOUT_S = 4.0
#: what a 500 reply and the log say after the exception
BUG_REPORT_HINT = ("this is a bug in swarmd, not something you did: please report it on the "
                   "swarmd issue tracker with the daemon's log, which has the traceback")
#: no endpoint reads a body; a client that sends a large one is cut off early
CLIENT_MAX_SIZE = 16 * 1024
#: request line, one header, number of headers
MAX_LINE_SIZE = 4096
MAX_FIELD_SIZE = 8190
MAX_HEADERS = 64
#: seconds the exit of ``async with HttpApi`` waits for requests in flight
SHUTDOWN_TIMEOUT_S = 5.0

_JSON_HEADERS = {"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"}
_PAGE_HEADERS = {
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
    # the page is self-contained: inline script and style, data: favicon, fetches to itself
    "Content-Security-Policy": ("default-src 'none'; script-src 'unsafe-inline'; "
                                "style-src 'unsafe-inline'; img-src data:; connect-src 'self'; "
                                "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"),
    "Referrer-Policy": "no-referrer",
}


def parse_listen(listen: str) -> tuple[str, int]:
    """``"127.0.0.1:8411"`` -> ``("127.0.0.1", 8411)``, ``"[::1]:0"`` -> ``("::1", 0)``.

    ``localhost`` becomes ``127.0.0.1`` (binding a name may bind two sockets with two ports).
    """
    host, sep, port_text = listen.rpartition(":")
    problem = None
    if not sep or not host or not port_text.isdigit() or int(port_text) > 65535:
        problem = "not of the form host:port with a port from 0 to 65535"
    elif host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        problem = "write an IPv6 address in brackets, like [::1]:8411"
    if problem is None and host != "localhost":
        try:
            ipaddress.ip_address(host)
        except ValueError:
            problem = f'"{host}" is not an IP address or localhost'
    if problem is not None:
        raise ConfigError(f'http.listen = "{listen}" is invalid: {problem}')
    return ("127.0.0.1" if host == "localhost" else host), int(port_text)


def _is_loopback(host: str) -> bool:
    return ipaddress.ip_address(host).is_loopback


def _url_host(host: str) -> str:
    """The host part of a URL that reaches a server bound to ``host``."""
    address = ipaddress.ip_address(host)
    if address.is_unspecified:  # bound to every interface: reach it through loopback
        address = ipaddress.ip_address("::1" if address.version == 6 else "127.0.0.1")
    return f"[{address}]" if address.version == 6 else str(address)


class _HttpError(Exception):
    """An error reply decided by a handler (not a bug)."""

    def __init__(self, status: int, code: str, message: str,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers or {}


def _json_body(value: Any) -> bytes:
    # allow_nan=False: NaN/Infinity are not JSON (a browser's JSON.parse rejects them); a
    # daemon value holding one is a bug, reported as such
    return json.dumps(value, allow_nan=False, separators=(",", ":")).encode()


def _json_response(value: Any, status: int = 200, headers: dict[str, str] | None = None
                   ) -> web.Response:
    return web.Response(body=_json_body(value), status=status, content_type="application/json",
                        headers={**_JSON_HEADERS, **(headers or {})})


class _ClientErrorLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """aiohttp's server log, where a request aiohttp could not parse (garbage, an oversized
    header: aiohttp answers 400 itself) is one INFO line instead of an ERROR with traceback.
    Anything else aiohttp logs as an exception is passed on unchanged."""

    def exception(self, msg: object, *args: object, exc_info: Any = True, **kw: Any) -> None:
        if isinstance(exc_info, HttpProcessingError):
            detail = " ".join(str(exc_info).split())[:200]
            self.info("refused a malformed HTTP request: %s", detail)
        else:
            self.error(msg, *args, exc_info=exc_info, **kw)


# ------------------------------------------------------------------------------------- metrics

class _DaemonCollector:
    """Prometheus families built from one (StatusInfo, SwarmInfo) snapshot taken at scrape time.

    :class:`HttpApi` sets :attr:`snapshot` and renders the registry in the same event-loop step,
    so concurrent scrapes never see each other's snapshot.
    """

    def __init__(self) -> None:
        self.snapshot: tuple[StatusInfo, SwarmInfo] | None = None

    def describe(self) -> list[Metric]:
        return []  # nothing to check for name clashes at registration

    def collect(self) -> Iterator[Metric]:
        if self.snapshot is None:
            return
        status, swarm = self.snapshot

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, value=value)

        yield gauge("swarmd_up", "1 while the daemon answers its HTTP API", 1)
        info = GaugeMetricFamily("swarmd_info", "Constant 1, labelled with this daemon's identity",
                                 labels=["peer_id", "swarm", "version"])
        info.add_metric([status.peer_id, status.swarm, status.version], 1)
        yield info
        yield gauge("swarmd_uptime_seconds", "Seconds since the daemon started", status.uptime_s)
        yield gauge("swarmd_stage", "The pipeline stage this peer serves; -1 if none",
                    -1 if status.stage is None else status.stage)
        state = GaugeMetricFamily("swarmd_state", "1 for this peer's current lifecycle state",
                                  labels=["state"])
        states = PEER_STATES if status.state in PEER_STATES else (*PEER_STATES, status.state)
        for name in states:
            state.add_metric([name], 1 if name == status.state else 0)
        yield state
        yield gauge("swarmd_connected_peers", "libp2p peers connected now",
                    status.connected_peers)
        yield gauge("swarmd_throughput_samples_per_second",
                    "This peer's measured throughput, samples per second", status.throughput)
        yield gauge("swarmd_queue_length", "Microbatches waiting for this peer's compute",
                    status.queue)
        yield from _reachability_metrics(status)
        yield from _trainer_metrics(status)
        yield from counter_families(status.counters)
        yield from histogram_families(status.histograms)

        stage_tp = GaugeMetricFamily("swarmd_stage_throughput",
                                     "Sum of a stage's routable peers' throughput, samples per "
                                     "second", labels=["stage"])
        stage_peers = GaugeMetricFamily("swarmd_stage_peers",
                                        "Peers in a stage (routable or not)", labels=["stage"])
        stage_routable = GaugeMetricFamily("swarmd_stage_routable_peers",
                                           "Routable peers in a stage", labels=["stage"])
        for row in swarm.stages:
            label = [str(row.stage)]
            stage_tp.add_metric(label, row.total_throughput)
            stage_peers.add_metric(label, len(row.peers))
            stage_routable.add_metric(label, row.routable_peers)
        yield stage_tp
        yield stage_peers
        yield stage_routable
        yield gauge("swarmd_bottleneck_stage",
                    "The stage with the lowest total throughput; -1 if none",
                    -1 if swarm.bottleneck is None else swarm.bottleneck)
        yield gauge("swarmd_swarm_stages", "Number of pipeline stages", swarm.num_stages)
        yield gauge("swarmd_swarm_peers", "Peers in this daemon's view, itself included",
                    swarm.peers_total)
        yield gauge("swarmd_excluded_peers", "Peers kept out of routing whose stage is unknown",
                    len(swarm.excluded))


# ------------------------------------------------------------------------------------- the API

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class HttpApi:
    """The local HTTP API of one daemon, as an async context manager.

    Construction checks the address (:class:`ConfigError` naming ``http.listen`` and
    ``http.allow_non_loopback``); entering binds it (:class:`ListenError` if it cannot) and only
    then is :attr:`url` known, with the real port when ``listen`` asks for port 0; leaving stops
    listening, waits up to :data:`SHUTDOWN_TIMEOUT_S` for requests in flight, and frees the port.
    """

    def __init__(self, api: DaemonApi, *, listen: str, token: str,
                 allow_non_loopback: bool = False) -> None:
        host, port = parse_listen(listen)
        if not allow_non_loopback and not _is_loopback(host):
            raise ConfigError(
                f'http.listen = "{listen}" is not a loopback address: the HTTP API shows this '
                f"peer's state to anyone who can reach it, so listen on 127.0.0.1, or set "
                f"http.allow_non_loopback = true to expose it anyway")
        if not token:
            raise ValueError("HttpApi needs the daemon's API token (see swarmd.api.token)")
        self._api = api
        self._listen = listen
        self._host = host
        self._port = port
        self._token = token.encode()
        self._page = files("swarmd.api").joinpath("page.html").read_bytes()
        self._registry = CollectorRegistry(auto_describe=False)
        self._collector = _DaemonCollector()
        self._registry.register(self._collector)  # type: ignore[arg-type]
        # the daemon's own CPU seconds, memory and open files (process_*; Linux only)
        ProcessCollector(registry=self._registry)
        self._http_errors = Counter("swarmd_http_errors", "HTTP error responses of the local "
                                    "API, by status", ["status"], registry=self._registry)
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None

    # -------------------------------------------------------------------------- lifecycle

    @property
    def url(self) -> str:
        """``http://HOST:PORT`` with the bound port; only inside ``async with``."""
        return f"http://{_url_host(self._host)}:{self.port}"

    @property
    def port(self) -> int:
        if self._site is None:
            raise RuntimeError("HttpApi is bound only inside `async with HttpApi(...)`")
        return self._site.port

    async def __aenter__(self) -> HttpApi:
        if self._runner is not None:
            raise RuntimeError("HttpApi is already running")
        app = web.Application(client_max_size=CLIENT_MAX_SIZE, middlewares=[self._errors])
        app.router.add_get("/", self._page_handler)
        app.router.add_get("/favicon.ico", self._favicon)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/api/v0/id", self._id)
        app.router.add_get("/api/v0/status", self._status)
        app.router.add_get("/api/v0/swarm", self._swarm)
        app.router.add_get("/api/v0/stage", self._stage)
        app.router.add_get("/api/v0/peers", self._peers)
        app.router.add_get("/api/v0/training", self._training)
        app.router.add_post("/api/v0/stop", self._stop)
        runner = web.AppRunner(
            app, handle_signals=False, access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S,
            max_line_size=MAX_LINE_SIZE, max_field_size=MAX_FIELD_SIZE, max_headers=MAX_HEADERS,
            keepalive_timeout=75.0, lingering_time=1.0,
            logger=_ClientErrorLog(logging.getLogger(f"{__name__}.server"), {}))
        await runner.setup()
        site = web.TCPSite(runner, self._host, self._port)
        try:
            await site.start()
        except OSError as exc:
            await runner.cleanup()
            raise ListenError(self._bind_message(exc)) from None
        except BaseException:
            await runner.cleanup()
            raise
        self._runner, self._site = runner, site
        log.info("HTTP API listening on %s", self.url)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        runner, self._runner, self._site = self._runner, None, None
        if runner is not None:
            await runner.cleanup()

    def _bind_message(self, exc: OSError) -> str:
        where = f"cannot listen on {self._listen} (http.listen) for the HTTP API"
        if exc.errno == errno.EADDRINUSE:
            return (f"{where}: the address is already in use, by another swarmd daemon or "
                    f"another program: stop it, or set http.listen to a free port (port 0 "
                    f"picks one)")
        if exc.errno == errno.EADDRNOTAVAIL:
            return (f"{where}: {self._host} is not an address of this machine: set http.listen "
                    f"to one of its addresses, such as 127.0.0.1:8411")
        if exc.errno == errno.EACCES:
            return (f"{where}: permission denied (ports below 1024 need privileges): set "
                    f"http.listen to a port from 1024 up")
        return f"{where}: {exc.strerror or exc}"

    # ----------------------------------------------------------------------------- errors

    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            response = await handler(request)
        except _HttpError as exc:
            response = self._error_response(exc.status, exc.code, exc.message, exc.headers)
        except web.HTTPException as exc:  # raised by the router: 404, 405
            response = self._router_error(request, exc)
        except asyncio.CancelledError:
            raise
        except InternalError as exc:
            log.error("%s %s failed: %s", request.method, request.path, exc, exc_info=exc)
            response = self._bug_response(exc)
        except SwarmdError as exc:
            # the daemon says it cannot answer now (and why); not a bug
            log.warning("%s %s: %s", request.method, request.path, exc)
            response = self._error_response(503, exc.code, str(exc))
        except Exception as exc:
            log.error("%s %s failed: %s", request.method, request.path, BUG_REPORT_HINT,
                      exc_info=exc)
            response = self._bug_response(exc)
        if response.status >= 400:
            self._http_errors.labels(str(response.status)).inc()
        return response

    def _error_response(self, status: int, code: str, message: str,
                        headers: dict[str, str] | None = None) -> web.Response:
        return _json_response({"error": {"code": code, "message": message}}, status, headers)

    def _bug_response(self, exc: BaseException) -> web.Response:
        return self._error_response(
            500, InternalError.code,
            f"internal error in the daemon ({type(exc).__name__}: {exc}); {BUG_REPORT_HINT}")

    def _router_error(self, request: web.Request, exc: web.HTTPException) -> web.Response:
        if isinstance(exc, web.HTTPMethodNotAllowed):
            allowed = sorted(exc.allowed_methods)
            return self._error_response(
                405, "method_not_allowed",
                f"{request.path} does not take {request.method}; it takes {', '.join(allowed)}",
                {"Allow": ", ".join(allowed)})
        if isinstance(exc, web.HTTPNotFound):
            return self._error_response(
                404, "not_found",
                f"no endpoint {request.path}: the API is /api/v0/id, /api/v0/status, "
                f"/api/v0/swarm, /api/v0/stage, /api/v0/peers, /api/v0/training and POST "
                f"/api/v0/stop; metrics are at /metrics "
                f"and the status page at /")
        if exc.status < 400:
            raise exc
        return self._error_response(exc.status, f"http_{exc.status}", exc.reason,
                                    {k: v for k, v in exc.headers.items() if k == "Allow"})

    async def _call(self, what: str, result: Awaitable[Any]) -> Any:
        """Await a daemon function, bounded by :data:`HANDLER_TIMEOUT_S`."""
        try:
            async with asyncio.timeout(HANDLER_TIMEOUT_S):
                return await result
        except TimeoutError:
            raise _HttpError(503, "daemon_busy", f"the daemon did not produce its {what} within "
                             f"{HANDLER_TIMEOUT_S:g} s; it may be overloaded, try again") from None

    def _check_token(self, request: web.Request) -> None:
        hint = ("send the header `Authorization: Bearer <token>` with the token from "
                "<home>/api_token (`swarmd stop --home <home>` does)")
        scheme, _, value = request.headers.get("Authorization", "").strip().partition(" ")
        value = value.strip()
        if scheme.lower() != "bearer" or not value:
            raise _HttpError(401, "unauthorized",
                             f"{request.method} {request.path} needs the daemon's API token: "
                             f"{hint}", {"WWW-Authenticate": 'Bearer realm="swarmd"'})
        if not hmac.compare_digest(value.encode("utf-8", "replace"), self._token):
            raise _HttpError(403, "forbidden",
                             f"wrong API token for {request.method} {request.path}: the token "
                             f"must match this daemon's <home>/api_token")

    # ---------------------------------------------------------------------------- handlers

    async def _id(self, request: web.Request) -> web.Response:
        return _json_response(to_json(self._api.id_info()))

    async def _status(self, request: web.Request) -> web.Response:
        return _json_response(to_json(await self._call("status", self._api.status())))

    async def _swarm(self, request: web.Request) -> web.Response:
        return _json_response(to_json(self._api.swarm()))

    async def _stage(self, request: web.Request) -> web.Response:
        return _json_response(to_json(await self._call("stage", self._api.stage_info())))

    async def _peers(self, request: web.Request) -> web.Response:
        return _json_response(to_json(await self._call("peer list", self._api.peers())))

    async def _training(self, request: web.Request) -> web.Response:
        return _json_response(to_json(self._api.training()))

    async def _stop(self, request: web.Request) -> web.Response:
        self._check_token(request)
        log.info("stop requested through the HTTP API by %s", request.remote)
        await self._call("stop", self._api.stop())
        return _json_response({"stopping": True}, status=202)

    async def _metrics(self, request: web.Request) -> web.Response:
        status = await self._call("status", self._api.status())
        swarm = self._api.swarm()
        # no await between setting the snapshot and rendering: no other scrape can interleave
        self._collector.snapshot = (status, swarm)
        try:
            body = generate_latest(self._registry)
        finally:
            self._collector.snapshot = None
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_PLAIN_0_0_4,
                                                "Cache-Control": "no-store"})

    async def _page_handler(self, request: web.Request) -> web.Response:
        return web.Response(body=self._page, content_type="text/html", charset="utf-8",
                            headers=_PAGE_HEADERS)

    async def _favicon(self, request: web.Request) -> web.Response:
        return web.Response(status=204)


def _trainer_metrics(status: Any) -> Iterator[Metric]:
    """Per trainer this stage serves (at most ``swarmd.pipeline.progress.MAX_TRAINERS``), what
    it last told: its step, its last step's loss, its latest validation loss."""
    families = {name: GaugeMetricFamily(f"swarmd_trainer_{name}", doc, labels=["trainer"])
                for name, doc in (("step", "Steps a trainer this stage serves took, as it told"),
                                  ("loss", "The mean loss of a trainer's last step, as it told"),
                                  ("val_loss", "A trainer's latest validation loss, as it told"))}
    for t in status.trainers:
        for name, value in (("step", t.step), ("loss", t.loss), ("val_loss", t.val_loss)):
            if value is not None:
                families[name].add_metric([t.peer_id], value)
    yield from families.values()


def _reachability_metrics(status: Any) -> Iterator[Metric]:
    reach = GaugeMetricFamily("swarmd_reachability", "1 for the reachability peers' dial-backs "
                              "found (public, private, unknown)", labels=["state"])
    for state in ("public", "private", "unknown"):
        reach.add_metric([state], float(status.reachability == state))
    yield reach
    yield GaugeMetricFamily("swarmd_relay_reservations", "Relays this daemon holds a "
                            "reservation on", value=len(status.relays))
