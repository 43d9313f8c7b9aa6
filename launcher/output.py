"""shoalrun's end of the ranks' output: whole lines, whatever the MPI launcher.

MPI launchers forward a rank's output in the pieces they happen to read: Hydra (MPICH) up
to 64 KiB at a time; Open MPI's mpirun a few hundred bytes to 4 KiB, stdout through a
pseudo-terminal. With several ranks writing, a line can be cut and another rank's text land
inside it. So each rank's wrapper (rank.py, `collector_write`) sends its whole lines over a
TCP connection (a Unix socket for emulated machines) to the `Collector` here, in records (stream: 1 or 2, length, bytes), and
shoalrun writes each record to its own stdout or stderr in one piece. A wrapper that cannot
connect (a host that cannot reach shoalrun's) forwards through the MPI launcher as before.

Where the collector is, and a secret per job, reach the wrappers in SHOAL_OUTPUT_COLLECTOR
("<host>;<addresses>;<port>;<secret>"), passed to the MPI launcher by name, not on its
command line; a connection that does not start with the secret, or sends a record over
MAX_RECORD bytes, is closed. Jobs on this host only listen on 127.0.0.1. At the job's end
the collector writes out everything the wrappers sent, however slowly its stdout drains; it
stops waiting once no connection has sent anything for `grace` seconds.
"""
import hmac
import os
import secrets
import shutil
import tempfile
import select
import selectors
import socket
import threading
import time

from .rank import RECORD_HEADER as HEADER  # the wire format is rank.record's

MAX_RECORD = 4 << 20  # rank.py sends lines in records of at most MAX_LINE plus one read


def _addresses():
    """This host's IPv4 addresses other ranks' hosts may reach (its name's, loopback aside)."""
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)
    except OSError:
        return []
    return list(dict.fromkeys(i[4][0] for i in infos if not i[4][0].startswith("127.")))


def _write_all(fd, data):
    """Write all of `data` to `fd`; False once the reader is gone (EPIPE)."""
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view):]
        except BlockingIOError:  # a non-blocking stdout (shared with another process): wait
            select.select([], [fd], [], 1.0)
        except OSError:
            return False
    return True


class _Connection:
    """One wrapper's stream of records; feed() writes the complete ones out and returns
    False when the connection must be dropped (wrong secret, malformed record)."""

    def __init__(self, secret, broken):
        self.secret, self.trusted, self.buf = secret, False, bytearray()
        self.broken = broken  # called when our stdout or stderr is gone

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
            if fd not in (1, 2) or n > MAX_RECORD:
                return False
            if len(self.buf) < HEADER + n:
                break
            if not _write_all(fd, bytes(self.buf[HEADER:HEADER + n])):
                self.broken()
            del self.buf[:HEADER + n]
        return True


class Collector:
    """Listens (a thread) for the wrappers of one job; `spec` is SHOAL_OUTPUT_COLLECTOR's
    value. close() stops taking connections and returns once every wrapper's connection has
    ended (they end with the job), or once none has sent anything for `grace` seconds.
    `on_broken` (set by shoalrun) is called once when its stdout or stderr is gone."""

    def __init__(self, remote, unix=False):
        self._secret = secrets.token_hex(16).encode()
        self._dir = self.folder = None
        if unix:  # ranks in other network namespaces of this host (emulated machines)
            self._dir = self.folder = tempfile.mkdtemp(prefix="shoalrun-output-")
            path = os.path.join(self._dir, "collector")
            self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._server.bind(path)
            self._server.listen(1024)
            addresses, port = f"unix:{path}", 0
        else:
            self._server = socket.create_server(("" if remote else "127.0.0.1", 0), backlog=1024)
            addresses, port = ",".join(_addresses()) if remote else "", self._server.getsockname()[1]
        self._server.setblocking(False)
        self.spec = f"{os.uname().nodename};{addresses};{port};{self._secret.decode()}"
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._server, selectors.EVENT_READ)
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        self._grace = None
        self.on_broken, self._broke = None, False
        self._thread = threading.Thread(target=self._serve, name="shoalrun-output", daemon=True)
        self._thread.start()

    def close(self, grace=5.0):
        if self._grace is not None:
            return
        self._grace = grace
        self._wake_w.send(b"x")
        self._thread.join()

    def _broken(self):
        if not self._broke:
            self._broke = True
            if self.on_broken:
                self.on_broken()

    def _accept(self, conns):
        """Accept one waiting connection; False if none waits."""
        try:
            conn, _ = self._server.accept()
        except OSError:  # BlockingIOError: none waits
            return False
        conn.setblocking(False)
        conns[conn] = _Connection(self._secret, self._broken)
        self._sel.register(conn, selectors.EVENT_READ)
        return True

    def _serve(self):
        conns, busy = {}, time.monotonic()
        # Closing: on until the wake-up was seen (what waits to be accepted is taken then: a
        # rank may have connected and sent everything before this thread ran), then while any
        # connection still sends (however slowly stdout drains).
        while self._grace is None or self._server is not None or (conns and time.monotonic() - busy < self._grace):
            events = self._sel.select(None if self._grace is None else 0.1)
            for key, _ in events:
                sock = key.fileobj
                if sock is self._wake_r:
                    sock.recv(16)
                    if self._server is not None:  # closing: take what waits to be accepted, then no more
                        while self._accept(conns):
                            pass
                        self._sel.unregister(self._server)
                        self._server.close()
                        self._server = None
                elif sock is self._server:
                    self._accept(conns)
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
            if events:
                busy = time.monotonic()
        for sock in conns:
            sock.close()
        if self._server is not None:
            self._server.close()
        self._sel.close()
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
