"""How a configuration key is declared, converted and validated (used by ``swarmd.config``).

A key is a field of a section dataclass made with :func:`_opt`: its default, a one-line doc,
what a valid value looks like and a validator. :class:`_Section` converts and checks every
field when a section is built, so a section object is always valid.
"""

from __future__ import annotations

import dataclasses
import difflib
import ipaddress
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from swarmd.errors import ConfigError

# --------------------------------------------------------------------------- field declarations

class _Invalid(Exception):
    """Raised by a validator; ``args[0]``, if any, is a detail shown in the error message."""


@dataclass(frozen=True)
class FieldSpec:
    """What one configuration key is: its doc line, what a valid value looks like, its check."""

    doc: str
    #: completes "expected ...", e.g. "an integer from 1 to 22"
    expected: str
    #: raises ``_Invalid`` for a value of the right type that is still not acceptable
    check: Callable[[Any], None] | None = None
    #: for a key of more than one type (``"off"`` or a number): takes any value (TOML, or the
    #: text of an environment variable) and returns the normalised one or raises ``_Invalid``;
    #: replaces the type check that the default's type implies
    convert: Callable[[Any], Any] | None = None


def _opt(default: Any, doc: str, expected: str, check: Callable[[Any], None] | None = None,
         *, convert: Callable[[Any], Any] | None = None) -> Any:
    """Declare a configuration key: its default, doc line, expectation and validator."""
    if isinstance(default, list):
        default = tuple(default)
    return field(default=default, metadata={"spec": FieldSpec(doc, expected, check, convert)})


def _int_range(lo: int, hi: int | None = None) -> Callable[[Any], None]:
    def check(value: int) -> None:
        if value < lo or (hi is not None and value > hi):
            raise _Invalid("out of range")
    return check


def _positive(value: float) -> None:
    if not value > 0:
        raise _Invalid("must be greater than 0")


_positive_seconds = _positive


def _one_of(choices: tuple[str, ...]) -> Callable[[Any], None]:
    def check(value: str) -> None:
        if value not in choices:
            close = difflib.get_close_matches(value, choices, n=1)
            raise _Invalid(f'did you mean "{close[0]}"?' if close else None)
    return check


def _power_of_two(lo: int, hi: int) -> Callable[[Any], None]:
    def check(value: int) -> None:
        if not lo <= value <= hi:
            raise _Invalid("out of range")
        if value & (value - 1):
            raise _Invalid("not a power of two")
    return check


_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def _swarm_name(value: str) -> None:
    if not _NAME_RE.fullmatch(value):
        raise _Invalid(None)


def _multiaddrs(*, need_peer_id: bool) -> Callable[[Any], None]:
    def check(values: tuple[str, ...]) -> None:
        from multiaddr import Multiaddr  # ~20 ms, only when there is an address to check

        for index, text in enumerate(values, 1):
            try:
                addr = Multiaddr(text)
            except Exception as exc:  # multiaddr raises several types, all ValueError-like
                detail = str(exc).split(" (string:")[0]
                raise _Invalid(f"entry {index} {_show(text)} is not a multiaddr: {detail}") from None
            protocols = list(addr.protocols())
            if not protocols:
                raise _Invalid(f"entry {index} {_show(text)} is not a multiaddr: it names no "
                               f"protocol (e.g. /ip4/1.2.3.4/tcp/31337)")
            if need_peer_id and protocols[-1].name != "p2p":
                raise _Invalid(f"entry {index} {_show(text)} does not end in /p2p/<peer id>")
    return check


def split_host_port(value: str) -> tuple[str, int]:
    """``"127.0.0.1:8411"`` -> ``("127.0.0.1", 8411)``; ``"[::1]:80"`` -> ``("::1", 80)``."""
    host, sep, port_text = value.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise _Invalid("not of the form host:port")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise _Invalid("write an IPv6 address in brackets, like [::1]:8411")
    port = int(port_text)
    if port > 65535:
        raise _Invalid("port out of range")
    if host != "localhost":
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise _Invalid(f"{_show(host)} is not an IP address or localhost") from None
    return host, port


_DEVICE_RE = re.compile(r"auto|cpu|cuda(:[0-9]+)?")


def _device(value: str) -> None:
    if not _DEVICE_RE.fullmatch(value):
        raise _Invalid(None)


def _host_port(value: str) -> None:
    split_host_port(value)


def _is_loopback(host: str) -> bool:
    return host == "localhost" or ipaddress.ip_address(host).is_loopback


# --------------------------------------------------------------------------------- the sections

class _Section:
    """Shared behaviour of the section dataclasses: normalise and validate on construction."""

    #: the TOML table name
    SECTION: ClassVar[str]
    #: the comment above the table in the default file
    DOC: ClassVar[str]

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            raw = getattr(self, f.name)
            try:
                value = _convert(f, raw)
            except _Invalid as exc:
                raise ConfigError(_invalid_message(
                    f"{type(self).__name__}(...)", f"{self.SECTION}.{f.name}", raw, f, exc
                )) from None
            if value is not raw:
                object.__setattr__(self, f.name, value)


# ---------------------------------------------------------------------------- value conversion

_TYPE_NAMES = {str: "a string", bool: "a boolean", int: "an integer", float: "a float",
               list: "an array", tuple: "an array", dict: "a table"}


def _type_name(value: Any) -> str:
    for t, name in _TYPE_NAMES.items():
        if type(value) is t:
            return name
    return "a date/time" if type(value).__module__ == "datetime" else type(value).__name__


def _convert(f: dataclasses.Field, value: Any) -> Any:
    """Check the type of a typed value (TOML, override, constructor), normalise it, validate it."""
    default = f.default
    kind = type(default)
    spec: FieldSpec = f.metadata["spec"]
    if spec.convert is not None:
        value = spec.convert(value)
        if spec.check is not None:
            spec.check(value)
        return value
    wrong = _Invalid(f"it is {_type_name(value)}")
    if kind is bool:
        if not isinstance(value, bool):
            raise wrong
    elif kind is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise wrong
    elif kind is float:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise wrong
        value = float(value)
        if not math.isfinite(value):
            raise _Invalid("not a finite number")
    elif kind is str:
        if not isinstance(value, str):
            raise wrong
    elif kind is tuple:
        if not isinstance(value, (list, tuple)):
            raise wrong
        for index, item in enumerate(value, 1):
            if not isinstance(item, str):
                raise _Invalid(f"entry {index} is {_type_name(item)}, not a string")
        value = tuple(value)
    else:  # pragma: no cover - a declaration with an unsupported default type
        raise TypeError(f"unsupported config type {kind}")
    if spec.check is not None:
        spec.check(value)
    return value


_TRUE = frozenset({"true", "1", "yes", "on"})
_FALSE = frozenset({"false", "0", "no", "off"})


def _parse_text(f: dataclasses.Field, text: str) -> Any:
    """Parse an environment variable (or a textual flag) into the key's type, then validate."""
    kind = type(f.default)
    value: Any = text
    if kind is bool:
        lowered = text.strip().lower()
        if lowered not in _TRUE | _FALSE:
            raise _Invalid("not a boolean (true/false/1/0/yes/no)")
        value = lowered in _TRUE
    elif kind is int:
        try:
            value = int(text.strip(), 10)
        except ValueError:
            raise _Invalid("not an integer") from None
    elif kind is float:
        try:
            value = float(text.strip())
        except ValueError:
            raise _Invalid("not a number") from None
    elif kind is tuple:
        value = tuple(part.strip() for part in text.split(",") if part.strip())
    return _convert(f, value)


# ------------------------------------------------------------------------ TOML values, messages

_TOML_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f",
                 "\r": "\\r"}


def _toml_str(text: str) -> str:
    out = []
    for ch in text:
        if ch in _TOML_ESCAPES:
            out.append(_TOML_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04X}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return {math.inf: "inf", -math.inf: "-inf"}.get(value, "nan")
        return repr(value)
    if isinstance(value, str):
        return _toml_str(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot render {type(value).__name__} as TOML")



def _show(value: Any) -> str:
    """A value as it would be written in TOML, shortened."""
    text = _toml_value(value) if isinstance(value, (str, bool, int, float, list, tuple)) else repr(value)
    return text if len(text) <= 100 else text[:97] + "..."


def _invalid_message(source: str, key: str, raw: Any, f: dataclasses.Field, exc: _Invalid) -> str:
    detail = exc.args[0] if exc.args and exc.args[0] else ""
    spec: FieldSpec = f.metadata["spec"]
    return (f"{source}: {key} = {_show(raw)} is invalid"
            + (f" ({detail})" if detail else "") + f"; expected {spec.expected}")
