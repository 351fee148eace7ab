"""The server's listening sockets, bound before the model loads.

``triollm serve`` binds its address first, so that a port already in use, a port it
may not take or a host that is not this machine's is reported at once, in one line,
instead of after minutes of loading. The sockets are bound but do not listen until
hypercorn starts serving on them (``ServerOptions.listen_fds``, handed over as
hypercorn's ``fd://`` binds): while the model loads, a client that connects is refused
at once, as if nothing were there, rather than queued unanswered. The port is held from
the start, so no other process can take it in between. (Two servers started at the same
instant on one port can both bind it; the second one's error comes when it starts
listening, in the same one line: ``listen_error``.)
"""

from __future__ import annotations

import errno
import os
import socket

__all__ = ["ListenError", "bind_listening_sockets", "listen_address", "listen_error"]

_REASONS = {
    errno.EADDRINUSE: "address already in use",
    errno.EACCES: "permission denied",
    errno.EADDRNOTAVAIL: "not an address of this machine",
}


class ListenError(ValueError):
    """The server cannot listen on its address; the message names it and says why."""


def listen_address(host: str, port: int, uds: str | None) -> str:
    """hypercorn's bind string for a host and port, or for a Unix domain socket."""
    if uds is not None:
        return f"unix:{uds}"
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def bind_listening_sockets(host: str, port: int, uds: str | None) -> tuple[int, ...]:
    """Bind (not yet listen on) the server's sockets as hypercorn binds them; their
    file descriptors, for ``ServerOptions.listen_fds``. Raises ``ListenError``."""
    from hypercorn.config import Config

    config = Config()
    config.bind = [listen_address(host, port, uds)]
    try:
        sockets = config.create_sockets()
    except OSError as error:
        address = uds if uds is not None else config.bind[0]
        low_port = uds is None and port < 1024 and os.geteuid() != 0
        raise ListenError(_message(address, error, low_port)) from None
    return tuple(sock.detach() for sock in sockets.insecure_sockets)


def listen_error(error: BaseException) -> ListenError | None:
    """The one-line error for a failure to listen anywhere inside ``error`` (an
    exception group from the server's task tree), or None."""
    if isinstance(error, BaseExceptionGroup):
        found = (listen_error(inner) for inner in error.exceptions)
        return next((e for e in found if e is not None), None)
    if isinstance(error, OSError) and error.errno == errno.EADDRINUSE:
        return ListenError(f"cannot listen: {_REASONS[errno.EADDRINUSE]} (another server "
                           f"took the address as this one started)")
    return None


def _message(address: str, error: OSError, low_port: bool) -> str:
    if isinstance(error, socket.gaierror):
        reason = f"unknown host ({error.strerror})"
    elif error.errno in _REASONS:
        reason = _REASONS[error.errno]
    else:
        reason = (error.strerror or str(error)).lower()
    if error.errno == errno.EACCES and low_port:
        reason += " (ports below 1024 need root)"
    return f"cannot listen on {address}: {reason}"
