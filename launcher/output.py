"""shoalrun's end of the ranks' output: whole lines, whatever the MPI launcher.

MPI launchers forward a rank's output in the pieces they happen to read: Hydra (MPICH) up
to 64 KiB at a time; Open MPI's mpirun a few hundred bytes to 4 KiB, stdout through a
pseudo-terminal. With several ranks writing, a line can be cut and another rank's text land
inside it. So each rank's wrapper (rank.py, `collector_write`) sends its whole lines over a
TCP connection to the `Collector` here, in records (stream: 1 or 2, length, bytes), and
shoalrun writes each record to its own stdout or stderr in one piece. A wrapper that cannot
connect (a host that cannot reach shoalrun's) forwards through the MPI launcher as before.

Where the collector is, and a secret per job, reach the wrappers in SHOAL_OUTPUT_COLLECTOR
("<host>;<addresses>;<port>;<secret>"); a connection that does not start with the secret is
closed, so nothing else can write into the job's output. Jobs on this host only listen on
127.0.0.1.
"""
import hmac
import os
import secrets
import selectors
import socket
import threading
import time

HEADER = 5  # bytes before a record's data: the stream (1 or 2), then its length (4 bytes, big-endian)


def _addresses():
    """This host's IPv4 addresses other ranks' hosts may reach (its name's, loopback aside)."""
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)
    except OSError:
        return []
    return list(dict.fromkeys(i[4][0] for i in infos if not i[4][0].startswith("127.")))


def _write_all(fd, data):
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view):]
        except OSError:  # our stdout is gone (EPIPE): nothing more can be shown
            return


class _Connection:
    """One wrapper's stream of records; feed() writes the complete ones out and returns
    False when the connection must be dropped (wrong secret, malformed record)."""

    def __init__(self, secret):
        self.secret, self.trusted, self.buf = secret, False, bytearray()

    def feed(self, data):
        self.buf += data
        if not self.trusted:
            if len(self.buf) < len(self.secret):
                return True
            if not hmac.compare_digest(bytes(self.buf[:len(self.secret)]), self.secret):
                return False
            del self.buf[:len(self.secret)]
            self.trusted = True
        while len(self.buf) >= HEADER:
            fd, n = self.buf[0], int.from_bytes(self.buf[1:HEADER], "big")
            if fd not in (1, 2):
                return False
            if len(self.buf) < HEADER + n:
                break
            _write_all(fd, bytes(self.buf[HEADER:HEADER + n]))
            del self.buf[:HEADER + n]
        return True


class Collector:
    """Listens (a thread) for the wrappers of one job; `spec` is SHOAL_OUTPUT_COLLECTOR's
    value. close() stops taking connections and returns once every wrapper's connection has
    ended (they end with the job) or after `grace` seconds."""

    def __init__(self, remote):
        self._secret = secrets.token_hex(16).encode()
        self._server = socket.create_server(("" if remote else "127.0.0.1", 0))
        self._server.setblocking(False)
        addresses = ",".join(_addresses()) if remote else ""
        self.spec = f"{os.uname().nodename};{addresses};{self._server.getsockname()[1]};{self._secret.decode()}"
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._server, selectors.EVENT_READ)
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        self._deadline = None
        self._thread = threading.Thread(target=self._serve, name="shoalrun-output", daemon=True)
        self._thread.start()

    def close(self, grace=5.0):
        if self._deadline is not None:
            return
        self._deadline = time.monotonic() + grace
        self._wake_w.send(b"x")
        self._thread.join(grace + 1.0)

    def _serve(self):
        conns = {}
        while self._deadline is None or (conns and time.monotonic() < self._deadline):
            timeout = None if self._deadline is None else max(0.0, self._deadline - time.monotonic())
            for key, _ in self._sel.select(timeout):
                sock = key.fileobj
                if sock is self._wake_r:
                    sock.recv(16)
                    if self._server is not None:  # closing: no new connections
                        self._sel.unregister(self._server)
                        self._server.close()
                        self._server = None
                elif sock is self._server:
                    try:
                        conn, _ = sock.accept()
                    except OSError:
                        continue
                    conn.setblocking(False)
                    conns[conn] = _Connection(self._secret)
                    self._sel.register(conn, selectors.EVENT_READ)
                else:
                    try:
                        data = sock.recv(1 << 16)
                    except BlockingIOError:
                        continue
                    except OSError:
                        data = b""
                    if not data or not conns[sock].feed(data):
                        self._sel.unregister(sock)
                        sock.close()
                        del conns[sock]
        for sock in conns:
            sock.close()
        if self._server is not None:
            self._server.close()
        self._sel.close()
