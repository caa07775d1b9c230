"""Plain TCP relaying for the tests' own stand-in hops (a load balancer, an upstream's front)."""

import contextlib
import socket
import threading


def pipe(source: socket.socket, sink: socket.socket) -> None:
    """Copy ``source`` to ``sink`` until either ends, then shut both down (the other direction's pipe ends too)."""
    source.settimeout(None)
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        for s in (source, sink):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)


def relay(a: socket.socket, b: socket.socket) -> None:
    """Both directions between two connected sockets, each in a daemon thread."""
    for source, sink in ((a, b), (b, a)):
        threading.Thread(target=pipe, args=(source, sink), daemon=True).start()
