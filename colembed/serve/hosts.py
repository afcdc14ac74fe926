"""Which `Host` and `Origin` values are this server's own. Standard library only (the CLI checks
`--allowed-host` values before importing the web framework).

DNS rebinding points an attacker's name at this server's address, so a page of the attacker's
becomes same-origin with the API: the `Host` header then carries the attacker's name. A request
is answered only when its `Host` names this server:

- bound to a loopback address (or `localhost`): `localhost`, `127.0.0.1`, `[::1]`, and the bound
  address itself;
- bound to one address: that address (an IP literal involves no name lookup, so it cannot be
  rebound);
- bound to every address (`0.0.0.0`, `::`): any IP literal and `localhost`;
- bound to a host name: that name;
- and every `--allowed-host NAME[:PORT]` (the names a reverse proxy or users reach it by).

Names compare case-insensitively with one trailing dot ignored. The port is not compared for the
bound address's forms (an SSH tunnel or a container's port mapping changes it; rebinding changes
the name); an `--allowed-host` given with a port matches that port only.

A browser's `Origin` (sent with every cross-origin request and every POST) is this server's when
it is the request's own `scheme://Host`, names an `--allowed-host`, or is a `--cors-origin`.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Iterable

from ..errors import ColembedError

DEFAULT_PORTS = {"http": 80, "https": 443}
_NAME = re.compile(r"[a-z0-9_-]+(\.[a-z0-9_-]+)*")  # DNS labels (underscore: some LAN names)
_PORT = re.compile(r"[0-9]{1,5}")
_LOOPBACK_IPS = (ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1"))
_WILDCARDS = ("", "0.0.0.0", "::")

IP = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True)
class Authority:
    """`host[:port]` normalised: a name in lower case without its trailing dot, or an IP."""

    host: str | IP
    port: int | None = None

    @property
    def is_ip(self) -> bool:
        return not isinstance(self.host, str)


def parse_authority(text: str) -> Authority:
    """`name`, `name:port`, `1.2.3.4[:port]` or `[v6][:port]` (RFC 3986 authority without
    user info); ValueError otherwise (a raw IPv6 without brackets, a bad port, odd characters)."""
    text = text.strip().lower()
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise ValueError(f"{text!r}: unclosed '['")
        literal, rest = text[1:end], text[end + 1 :]
        if "%" in literal:
            raise ValueError(f"{text!r}: a zone id is not a Host")
        host: str | IP = ipaddress.IPv6Address(literal)
    else:
        name, colon, port = text.partition(":")
        rest = colon + port
        name = name[:-1] if name.endswith(".") else name
        try:
            host = ipaddress.IPv4Address(name)
        except ValueError:
            if not _NAME.fullmatch(name):
                raise ValueError(f"{text!r}: not a host name or address") from None
            host = name
    port_number = None
    if rest:
        if not rest.startswith(":"):
            raise ValueError(f"{text!r}: text after the address")
        if rest[1:]:  # `host:` with an empty port is allowed by RFC 3986
            if not _PORT.fullmatch(rest[1:]) or int(rest[1:]) > 65535:
                raise ValueError(f"{text!r}: not a port")
            port_number = int(rest[1:])
    return Authority(host, port_number)


def parse_origin(value: str) -> tuple[str, Authority] | None:
    """(scheme, authority with its port filled in) of an `Origin` header; None for `null`, a
    scheme other than http(s) or anything malformed."""
    scheme, sep, rest = value.strip().lower().partition("://")
    if not sep or scheme not in DEFAULT_PORTS or "/" in rest or "@" in rest:
        return None
    try:
        authority = parse_authority(rest)
    except ValueError:
        return None
    return scheme, Authority(authority.host, authority.port or DEFAULT_PORTS[scheme])


class AllowedHosts:
    """The rule above for a server bound to `bind`, plus `extra` (`--allowed-host` values)."""

    def __init__(self, bind: str, extra: Iterable[str] = (), cors_origins: Iterable[str] = ()):
        self.any_ip = bind.strip("[]") in _WILDCARDS
        self.names: set[str] = set()
        self.ips: set[IP] = set()
        if not self.any_ip:
            bound = parse_authority(
                bind if ":" not in bind or bind.startswith("[") else f"[{bind}]"
            )
            if bound.is_ip:
                self.ips.add(bound.host)
            else:
                self.names.add(bound.host)
            if bound.host == "localhost" or (bound.is_ip and bound.host.is_loopback):
                self.names.add("localhost")
                self.ips.update(_LOOPBACK_IPS)
        else:
            self.names.add("localhost")
        self.extra: list[Authority] = []
        for value in extra:
            try:
                self.extra.append(parse_authority(value))
            except ValueError as e:
                raise ColembedError(
                    f"--allowed-host {value}: {e} (give NAME or NAME:PORT)"
                ) from None
        self.cors_origins = {o.strip().rstrip("/").lower() for o in cors_origins}

    def allows(self, authority: Authority) -> bool:
        if any(a.host == authority.host and a.port in (None, authority.port) for a in self.extra):
            return True
        if authority.is_ip:
            return self.any_ip or authority.host in self.ips
        return authority.host in self.names

    def is_cors_origin(self, origin: str) -> bool:
        return origin.strip().rstrip("/").lower() in self.cors_origins

    def allows_origin(self, origin: str, host: Authority) -> bool:
        """Whether a browser's `Origin` is this server's own for a request whose (allowed) Host
        is `host`: same scheme://host:port, an --allowed-host, or a --cors-origin."""
        if self.is_cors_origin(origin):
            return True
        parsed = parse_origin(origin)
        if parsed is None:
            return False
        scheme, authority = parsed
        if authority == Authority(host.host, host.port or DEFAULT_PORTS[scheme]):
            return True
        return any(
            a.host == authority.host and a.port in (None, authority.port) for a in self.extra
        )
