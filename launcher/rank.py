"""Per-rank wrapper used by shoalrun: runs the rank's command, forwards its output in whole
lines, and, if it fails, records which rank failed and how, so shoalrun can say which rank
died first.

    python rank.py [--tag-output] STATUS_DIR command...

The command runs as a child that dies with this wrapper (PR_SET_PDEATHSIG), so killing the
job never leaves a rank behind; SIGTERM, SIGINT and SIGHUP are passed on to it; stdin and
every other file descriptor stay inherited (MPI's process manager needs them).

Whole lines: the child's stdout and stderr are pipes read here, and only complete lines go
on, whatever the child's buffering (with PYTHONUNBUFFERED=1 Python writes a line in pieces).
They go to shoalrun's collector (output.py: one TCP connection per rank, each batch of lines
one record that shoalrun writes in one piece), so lines of different ranks never splice,
whatever the MPI launcher. Where the collector cannot be reached (from
another host) they go to this wrapper's stdout and stderr, the MPI launcher's pipes, each batch
in one write of at most PIPE_BUF bytes, which a pipe keeps in one piece: whole under Hydra
for lines up to 64 KiB (what it reads at once), while Open MPI may cut any line. A line ends
at "\\n", "\\r\\n" or a lone "\\r" (progress bars redraw with "\\r"); one longer than MAX_LINE is
forwarded in pieces. A trailing partial line is written at EOF, ended with "\\n". So a prompt
without a newline (input(), pdb) shows only once its line ends. --tag-output prefixes every
line with "[R]<stdout>:" or "[R]<stderr>:" (horovodrun's form).

The child finds STATUS_DIR in SHOAL_STATUS_DIR: Shoal's runtime writes its own record there
(write_status) before it aborts the job, since the launcher may kill this wrapper before it
sees the child end. The wrapper writes one when the child ends non-zero and no record for the
rank exists. Records are one line, "<unix time> <rank> <status> <description>". The
wrapper also records its host and pids (write_pids): if the MPI launcher leaves ranks running
after a failure (Hydra's clean-up races with a rank's exit), shoalrun ends them.

With SHOAL_GPU_BIND=1 (and CUDA_VISIBLE_DEVICES unset) the rank sees one GPU: local_rank %
device_count (several ranks share a GPU when they outnumber the GPUs). Off by default, as
with mpirun and horovodrun: Horovod and BlueFog scripts choose their device themselves with
torch.cuda.set_device(local_rank()), which fails when only one GPU is visible.

Only the standard library is used, and only os, re, signal, sys and time at import: the
runtime imports write_status from here on its way out.
"""
import os
import re
import signal
import sys
import time

PIPE_BUF = 4096        # POSIX minimum and Linux's value: pipe writes up to this size are atomic
MAX_LINE = 1 << 20     # a longer "line" is forwarded in pieces (bounds memory, e.g. binary output)
READ_SIZE = 1 << 16
EXIT_GRACE = 1.0       # s to wait for EOF once the child has exited (its own children may hold the pipes)
COLLECTOR_ENV = "SHOAL_OUTPUT_COLLECTOR"  # where shoalrun's collector of output is (output.py)
RECORD_HEADER = 5  # a record to the collector: stream (1 or 2), data length (4 bytes, big-endian), data


def record(fd, data):
    """One record of the collector's wire format (output.py reads it)."""
    return bytes([fd]) + len(data).to_bytes(RECORD_HEADER - 1, "big") + bytes(data)


def status_path(status_dir, rank):
    return os.path.join(status_dir, f"rank{rank}.status")


def pid_path(status_dir, rank):
    return os.path.join(status_dir, f"rank{rank}.pid")


def write_pids(status_dir, rank, child_pid):
    """Record "<host> <wrapper pid> <child pid>" in STATUS_DIR/rank{rank}.pid, so shoalrun can
    end this rank itself if the MPI launcher fails to after another rank failed."""
    tmp = os.path.join(status_dir, f".rank{int(rank)}.pid.tmp")
    with open(tmp, "w") as f:
        f.write(f"{os.uname().nodename} {os.getpid()} {child_pid}\n")
    os.replace(tmp, pid_path(status_dir, int(rank)))


def write_status(status_dir, rank, status, description, when=None):
    """Record how a rank ended, for `shoalrun`'s "first failure: rank R <description>".

    Writes STATUS_DIR/rank{rank}.status as the single line
    "{time.time():.6f} {rank} {status} {description}\\n" — status an int (exit status, or
    -signal), description free text (whitespace, newlines included, collapses to single
    spaces) — atomically: a temporary file in the same directory, then os.replace, so a
    reader never sees a partial record. An existing record is replaced (the wrapper checks
    for one first). `when`: the record's time (default now). One writer per process at a
    time (the temporary file is named by pid). Returns the path; raises OSError if the
    directory cannot be written.
    """
    path = status_path(status_dir, int(rank))
    tmp = os.path.join(status_dir, f".rank{int(rank)}.status.{os.getpid()}.tmp")
    when = time.time() if when is None else when
    line = f"{when:.6f} {int(rank)} {int(status)} {' '.join(str(description).split())}\n"
    try:
        with open(tmp, "w") as f:
            f.write(line)
        os.replace(tmp, path)
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


def read_status(path):
    """(time, rank, description) of one record, or None if it is unreadable or too short to
    name a rank; a record cut short after the status gets a description from the status."""
    try:
        with open(path) as f:
            parts = f.read().split(None, 3)
        t, rank = float(parts[0]), int(parts[1])
    except (OSError, ValueError, IndexError):
        return None
    if len(parts) == 4:
        return t, rank, parts[3].strip()
    try:
        return t, rank, describe(int(parts[2]))
    except (ValueError, IndexError):
        return t, rank, "failed"


def _die_with_parent():
    import ctypes
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def rank_from_env():
    for key in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"):
        if key in os.environ:
            return int(os.environ[key])
    return -1


def size_from_env():
    for key in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE"):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    return 1


def local_rank_from_env(env):
    for key in ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMI_LOCAL_RANK", "SLURM_LOCALID"):
        if env.get(key, "").isdigit():
            return int(env[key])
    return None


def gpu_count():
    """GPUs on this host, without loading CUDA: nvidia-smi (what this container sees),
    else the driver's /proc entries; 0 without a driver."""
    import subprocess
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
        if out.returncode == 0:
            return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


def bind_gpu(env, count=gpu_count):
    """With SHOAL_GPU_BIND=1, set CUDA_VISIBLE_DEVICES=local_rank % count in env unless the
    user chose devices."""
    if "CUDA_VISIBLE_DEVICES" in env or env.get("SHOAL_GPU_BIND") != "1":
        return None
    local = local_rank_from_env(env)
    n = count() if local is not None else 0
    if n > 0:
        env["CUDA_VISIBLE_DEVICES"] = str(local % n)
        return env["CUDA_VISIBLE_DEVICES"]
    return None


def describe(status):
    if status < 0:
        sig = -status
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return f"killed by signal {sig} ({name})"
    return f"exited with status {status}"


def _line_end(buf, start):
    """End of the last complete line in buf (0 if none), looking from start on. A "\\r" as
    the last byte is not an end yet: a "\\n" may follow."""
    nl = buf.rfind(b"\n", start) + 1
    cr = buf.rfind(b"\r", max(nl, start), len(buf) - 1) + 1
    return max(nl, cr)


_SEGMENT = re.compile(rb"[^\r\n]*(?:\r\n|\n|\r)|[^\r\n]+")


def _segments(data):
    """data split after each line end ("\\r\\n", "\\n" or "\\r"); the last piece may be partial."""
    return _SEGMENT.findall(data)


class LineForwarder:
    """Forwards one byte stream to the file descriptor `out` in whole lines.

    feed(bytes) keeps a partial last line until its end arrives; close() writes what is left,
    ended with a newline. Lines are batched up to `limit` bytes per write; a longer line is
    written alone, in one call. With a prefix (bytes), every line starts with it. After a
    failed write (EPIPE: the launcher's end is gone) the rest of the stream is dropped, so
    the child is never blocked on a full pipe.
    """

    def __init__(self, out, prefix=b"", write=os.write, limit=PIPE_BUF, max_line=MAX_LINE, watch=None):
        self.out, self.prefix, self._write, self.limit, self.max_line = out, prefix, write, limit, max_line
        self.watch = watch  # called with each batch of complete lines before they go on
        self.pending = bytearray()
        self.at_line_start = True
        self.broken = False

    def feed(self, data):
        start = max(len(self.pending) - 1, 0)  # only a held trailing "\r" precedes new data
        self.pending += data
        end = _line_end(self.pending, start)
        if len(self.pending) - end >= self.max_line:
            end = len(self.pending)  # an over-long line goes on in pieces
        if end:
            complete = bytes(self.pending[:end])
            del self.pending[:end]
            if self.watch:
                self.watch(complete)
            self._emit(complete)

    def close(self):
        if self.pending:
            tail = bytes(self.pending)
            if not tail.endswith(b"\r"):
                tail += b"\n"  # so that whatever comes next (another rank's line) starts a line
            self.pending.clear()
            self._emit(tail)

    def _emit(self, data):
        if not self.prefix and len(data) <= self.limit:
            self._send(data)
            return
        batch = bytearray()
        for seg in _segments(data):
            if self.at_line_start:
                seg = self.prefix + seg
            self.at_line_start = seg.endswith((b"\n", b"\r"))
            if batch and len(batch) + len(seg) > self.limit:
                self._send(bytes(batch))
                batch.clear()
            batch += seg
        if batch:
            self._send(bytes(batch))

    def _send(self, data):
        view = memoryview(data)
        while view and not self.broken:
            try:
                view = view[self._write(self.out, view):]  # more than one call only after a signal
            except OSError:  # the launcher's end is gone (EPIPE): keep draining the child
                self.broken = True


# What MPICH and Open MPI print from a process that calls MPI_Abort.
_ABORT = re.compile(rb"MPI_Abort\(\w+, (-?\d+)\)|MPI_ABORT was invoked on rank \d+ in communicator \S+\s+with errorcode (-?\d+)")


class EndRecord:
    """This wrapper's failure record for its rank, written by two threads one at a time: the
    moment the child ends non-zero (`ended`, from the thread that waits for it: a peer of a
    killed rank can crash inside MPI within milliseconds, UCX over TCP: SIGSEGV in
    MPI_Isend, and the MPI launcher may kill this wrapper once that peer's wrapper exits, so
    a later record would name the crash, or be lost), and MPICH's or Open MPI's MPI_Abort
    line in its output (`watch`, a LineForwarder watch: the launcher then kills every
    wrapper at once, maybe before the child's end is seen). An abort names the cause even
    when seen after the end, at the end's time. A record the rank wrote itself is kept."""

    def __init__(self, status_dir, rank):
        import threading
        self.status_dir, self.rank, self.lock = status_dir, rank, threading.Lock()
        self.written = None  # (time, description) of this wrapper's record

    def _write(self, status, description, when):
        if self.written is None and os.path.exists(status_path(self.status_dir, self.rank)):
            return  # the rank's own record
        try:
            write_status(self.status_dir, self.rank, status, description, when)
            self.written = (when, description)
        except OSError:
            pass

    def ended(self, status):
        with self.lock:
            if status != 0 and self.written is None:
                self._write(status, describe(status), time.time())

    def watch(self, data):
        m = _ABORT.search(data)
        if m:
            with self.lock:
                if self.written is None or not self.written[1].startswith("called MPI_Abort"):
                    code = (m.group(1) or m.group(2)).decode()
                    self._write(1, f"called MPI_Abort (error code {code})",
                                time.time() if self.written is None else self.written[0])


def pump(streams, child_exited_fd, grace=EXIT_GRACE):
    """Read every (fd, LineForwarder) until EOF; once child_exited_fd is readable, stop waiting
    for EOF after `grace` s (a process the child started may keep its pipes open)."""
    import selectors
    sel = selectors.DefaultSelector()
    for fd, fwd in streams:
        sel.register(fd, selectors.EVENT_READ, fwd)
    sel.register(child_exited_fd, selectors.EVENT_READ, None)
    open_streams, deadline = len(streams), None
    while open_streams and (deadline is None or time.monotonic() < deadline):
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        for key, _ in sel.select(timeout):
            if key.data is None:
                sel.unregister(key.fd)
                deadline = time.monotonic() + grace
                continue
            data = os.read(key.fd, READ_SIZE)
            if data:
                key.data.feed(data)
            else:
                sel.unregister(key.fd)
                key.data.close()
                open_streams -= 1
    for key in list(sel.get_map().values()):
        if key.data is not None:
            key.data.close()
    sel.close()


def tee(path, inner=os.write):
    """A write for LineForwarder that also appends what `inner` writes to the file `path`
    (shoalrun --output-filename: <dir>/rank.<R>/stdout and stderr)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    f = open(path, "ab", buffering=0)  # noqa: SIM115 - open until the process ends

    def write(fd, data):
        n = inner(fd, data)
        f.write(data[:n])
        return n
    return write


def collector_write(spec, fallback=os.write):
    """A write for LineForwarder that sends each batch of lines, as one record, to shoalrun's
    collector (output.py) at `spec` (SHOAL_OUTPUT_COLLECTOR), or None if it cannot be
    reached. If a send fails (shoalrun's end is gone), the rest goes through `fallback`."""
    import socket
    try:
        host, addresses, port, secret = spec.split(";")
        port = int(port)
    except ValueError:
        return None
    here = ["127.0.0.1"] if host == os.uname().nodename else []
    conn = None
    for address in dict.fromkeys(here + [a for a in addresses.split(",") if a]):
        try:
            if address.startswith("unix:"):  # the collector of an emulated cluster (same host)
                conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                conn.settimeout(5)
                conn.connect(address[len("unix:"):])
            else:
                conn = socket.create_connection((address, port), timeout=5)
            conn.settimeout(None)
            conn.sendall(secret.encode())
            break
        except OSError:
            conn = None
    if conn is None:
        return None
    state = [conn]

    def write(fd, data):
        if state[0] is not None:
            try:
                state[0].sendall(record(fd, data))
                return len(data)
            except OSError:
                state[0] = None
        return fallback(fd, data)
    return write


def launch_path(env):
    """The child's PATH: shoalrun's (SHOAL_LAUNCH_PATH, run.py's worker_env) first, then what
    this host adds (an MPI prefix, module-loaded tools), each folder once."""
    launch = [d for d in env.pop("SHOAL_LAUNCH_PATH", "").split(os.pathsep) if d]
    here = env.get("PATH", os.defpath).split(os.pathsep)
    return os.pathsep.join(dict.fromkeys(launch + [d for d in here if d]))


def main(argv):
    import subprocess
    import threading
    tag = argv[:1] == ["--tag-output"]
    if tag:
        argv = argv[1:]
    status_dir, cmd = argv[0], argv[1:]
    rank = rank_from_env()
    env = dict(os.environ)
    env["SHOAL_STATUS_DIR"] = status_dir
    env.pop(COLLECTOR_ENV, None)  # the wrapper's, not the command's
    env["PATH"] = launch_path(env)
    bind_gpu(env)
    child = subprocess.Popen(cmd, close_fds=False, preexec_fn=_die_with_parent, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda s, _f: child.send_signal(s))
    try:
        write_pids(status_dir, rank, child.pid)
    except OSError:
        pass
    exited_r, exited_w = os.pipe()

    record = EndRecord(status_dir, rank)

    def wait_child():
        try:
            record.ended(child.wait())
        finally:
            os.write(exited_w, b"x")
    waiter = threading.Thread(target=wait_child, daemon=True)
    waiter.start()
    # Through shoalrun's collector (output.py) when it can be reached: records of any size
    # arrive whole there; else through the MPI launcher's pipes, PIPE_BUF at a time.
    collector = collector_write(os.environ.get(COLLECTOR_ENV, ""))
    base, limit = (collector, READ_SIZE) if collector else (os.write, PIPE_BUF)
    out_dir = os.environ.get("SHOAL_OUTPUT_DIR")
    writes = {name: tee(os.path.join(out_dir, f"rank.{rank:0{len(str(max(size_from_env() - 1, 0)))}d}", name),
                        base) if out_dir else base for name in ("stdout", "stderr")}
    streams = [(child.stdout.fileno(), LineForwarder(1, f"[{rank}]<stdout>:".encode() if tag else b"",
                                                     write=writes["stdout"], limit=limit)),
               (child.stderr.fileno(), LineForwarder(2, f"[{rank}]<stderr>:".encode() if tag else b"",
                                                     write=writes["stderr"], limit=limit,
                                                     watch=record.watch))]
    pump(streams, exited_r)
    waiter.join()
    status = child.returncode
    if status != 0 and os.environ.get("SHOAL_FAULT_TOLERANT") == "1":
        # PRRTE 3.0 (Open MPI 5.0) counts a rank's non-zero exit twice toward the job's end
        # (fixed upstream later), so a job that had lost half its ranks was torn down under
        # its survivors; a death by signal counts once. The record keeps the real status.
        os.kill(os.getpid(), signal.SIGKILL)
    return 128 - status if status < 0 else status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
