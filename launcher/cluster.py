"""The emulated cluster behind `shoalrun --machines M --link RATE` (docs/emulated-cluster.md).

M machines on this host, each a network namespace with a hostname of its own (every process
tree started there gets a fresh UTS namespace named `node<i>`), joined by one veth link each
to a bridge that lives in a switch namespace of its own. Each link is shaped by `tbf` in both
directions (the machine's end shapes what it sends, the switch's end what it receives), so a
machine's ranks share its link as on a real node. Between machines MPI goes over TCP through
the links; within a machine MPICH keeps its shared memory (its node is the Hydra proxy).

Nothing of it sits in the host's namespace: names are `shoal-<pid>.<start>-...` (shoalrun's
pid and start time), the veth ends are created directly inside the switch and machine
namespaces, addresses are in 198.18.0.0/15 (RFC 2544's range for benchmarking, reachable only
inside the job's own namespaces). A reaper process tears the set-up down if shoalrun dies
without doing so, and every start removes the set-ups of shoalruns that no longer exist.

Only the standard library: the reaper runs this file by path (`cluster.py --reap PREFIX`).
"""
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

NETNS_DIR = "/run/netns"
PREFIX = "shoal-"
SUBNET = "198.18.0.0/15"  # RFC 2544: set aside for benchmarking network devices
TOOLS = ("ip", "tc", "nsenter", "unshare", "hostname", "mount", "bash")
DONE = b"done"  # what shoalrun tells its reaper once it has removed the set-up itself
_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
          "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9}


class ClusterError(RuntimeError):
    """The emulated cluster cannot be set up here (what is missing is in the message)."""


def parse_rate(text):
    """Bits per second of a tc rate: '1gbit', '200mbit', '500kbit', '12.5mbps' (bytes/s).
    Raises ValueError for anything else."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]+)\s*", str(text))
    unit = m and m.group(2).lower()
    if not m or unit not in _UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"link rate {text!r}: expected a positive number with a unit of "
                         f"{', '.join(_UNITS)} (e.g. 1gbit, 200mbit)")
    return float(m.group(1)) * _UNITS[unit]


def format_rate(bits):
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits >= scale:
            return f"{bits / scale:g} {unit}"
    return f"{bits:g} bit/s"


def placement(ranks, machines):
    """Ranks per machine, in blocks as a hostfile places them: the first ranks % machines
    machines hold one more."""
    base, extra = divmod(ranks, machines)
    return [base + (i < extra) for i in range(machines)]


def _run(*cmd, check=True):
    res = subprocess.run(cmd, capture_output=True, text=True)
    if check and res.returncode != 0:
        raise ClusterError(f"{shlex.join(cmd)} failed: {res.stderr.strip() or res.returncode}")
    return res


def _start_time(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]  # field 22: start time in ticks
    except (OSError, IndexError):
        return None


def _cgroup_root():
    """The cgroup folder where a machine's cpu group is made: v1's cpu controller, or v2's
    root when it delegates cpu; None when neither is writable."""
    for root in ("/sys/fs/cgroup/cpu", "/sys/fs/cgroup/cpu,cpuacct"):
        if os.path.isfile(os.path.join(root, "cpu.cfs_quota_us")) and os.access(root, os.W_OK):
            return root
    try:
        with open("/sys/fs/cgroup/cgroup.subtree_control") as f:
            if "cpu" in f.read().split() and os.access("/sys/fs/cgroup", os.W_OK):
                return "/sys/fs/cgroup"
    except OSError:
        pass
    return None


def _set_cpu_limit(group, cores):
    period = 100_000
    quota = max(1000, int(cores * period))
    if os.path.exists(os.path.join(group, "cpu.max")):  # cgroup v2
        with open(os.path.join(group, "cpu.max"), "w") as f:
            f.write(f"{quota} {period}")
    else:
        with open(os.path.join(group, "cpu.cfs_period_us"), "w") as f:
            f.write(str(period))
        with open(os.path.join(group, "cpu.cfs_quota_us"), "w") as f:
            f.write(str(quota))


def teardown(prefix):
    """Remove everything named `prefix`: end the processes in its namespaces, delete the
    namespaces (their veth ends and the bridge go with them) and its cpu groups. Safe to
    repeat; touches nothing else."""
    names = [n for n in _netns_names() if n.startswith(prefix + "-")]
    for _ in range(50):  # a process may fork while we kill: repeat until none is left
        pids = set()
        for name in names:
            out = _run("ip", "netns", "pids", name, check=False).stdout.split()
            pids.update(int(p) for p in out if p.isdigit() and int(p) != os.getpid())
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.05)
    for name in sorted(names, key=lambda n: n.endswith("-sw")):  # machines first
        _run("ip", "netns", "delete", name, check=False)
    root = _cgroup_root()
    if root:
        for entry in os.listdir(root):
            if entry.startswith(prefix + "-"):
                for _ in range(100):  # rmdir fails while its last processes are still exiting
                    try:
                        os.rmdir(os.path.join(root, entry))
                        break
                    except FileNotFoundError:
                        break
                    except OSError:
                        time.sleep(0.05)


def _netns_names():
    try:
        return os.listdir(NETNS_DIR)
    except OSError:
        return []


def stale_prefixes():
    """Prefixes of set-ups whose shoalrun no longer runs (crashed or killed)."""
    found = set()
    root = _cgroup_root()
    entries = _netns_names() + (os.listdir(root) if root else [])
    for entry in entries:
        m = re.match(r"(shoal-(\d+)\.(\d+))-", entry)
        if m and _start_time(m.group(2)) != m.group(3):
            found.add(m.group(1))
    return sorted(found)


MACHINE_SCRIPT = """#!/bin/sh
# Runs a command on machine HOST of this emulated cluster, as ssh would: $0 [-opts] HOST CMD...
# (Hydra's and PRRTE's launchers call it so; the command is one shell string, which may set
# variables first, or words joined by spaces). bash, not sh: it replaces itself with the
# last command even after assignments, so the launcher's pid is the command's (signals).
while [ "${1#-}" != "$1" ]; do shift; done
host=$1; shift
case $host in
%s
*) echo "emulated cluster: no machine $host" >&2; exit 255;;
esac
[ -n "$cg" ] && echo $$ > "$cg/cgroup.procs"
# A mount namespace of its own, where the cluster's hosts file covers /etc/hosts (the host's
# file is untouched): the machines' names resolve, as a cluster's DNS would have them.
exec nsenter --net=%s/$ns unshare --uts --mount --propagation private sh -c \
  'hostname "$0" && mount --bind "$1" /etc/hosts && shift && exec bash -c "$*"' "$name" %s "$@"
"""


class Cluster:
    """M emulated machines for one shoalrun job; `up()` builds them, `down()` removes them
    (also done by a reaper process if shoalrun dies first).

    ranks: ranks per machine (`placement`); link: rate in bits/s of each machine's link, each
    way (None: unshaped veth); straggler: CPU fraction (0, 1] of the last machine, a share of
    `cores / machines` cores for its ranks together (None: no straggler).
    """

    def __init__(self, ranks, link=None, straggler=None, workdir=None):
        self.ranks, self.link, self.straggler = list(ranks), link, straggler
        self.machines = len(self.ranks)
        self.prefix = f"{PREFIX}{os.getpid()}.{_start_time(os.getpid())}"
        self.script = os.path.join(workdir or ".", "machine")  # written by up()
        self.folders = []  # shoalrun's temporary folders, removed by the reaper if shoalrun dies
        self._reaper = None
        self._started = None

    def fair_cores(self, i):
        """Cores machine i's ranks get on a fair share of this host: one per rank, or fewer
        when the ranks outnumber the cores this process may run on."""
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return self.ranks[i] * min(1.0, cores / sum(self.ranks))

    def namespace(self, i):
        return f"{self.prefix}-m{i}"

    @property
    def switch(self):
        return f"{self.prefix}-sw"

    @staticmethod
    def address(i):
        return f"198.18.{(i + 1) >> 8}.{(i + 1) & 255}"

    @staticmethod
    def hostname(i):
        return f"node{i}"

    def cgroup(self, i):
        if self.straggler is None or i != self.machines - 1:
            return ""
        return os.path.join(_cgroup_root(), f"{self.prefix}-m{i}")

    def check(self):
        """Raise ClusterError naming what this host lacks, before anything is created."""
        missing = [t for t in TOOLS if not shutil.which(t)]
        if missing:
            raise ClusterError(f"--machines needs {', '.join(missing)} (iproute2, util-linux, hostname) on PATH")
        if os.geteuid() != 0:
            raise ClusterError("--machines needs root (network namespaces, veth links and tc shaping "
                               "are privileged); run shoalrun as root")
        if not os.path.exists("/proc/self/ns/net") or not os.path.exists("/proc/self/ns/uts"):
            raise ClusterError("--machines needs a kernel with network and UTS namespaces")
        probe = _run("unshare", "--net", "--uts", "--mount", "true", check=False)
        if probe.returncode != 0:
            raise ClusterError("--machines needs to create network, UTS and mount namespaces (root with "
                               f"CAP_NET_ADMIN and CAP_SYS_ADMIN): {probe.stderr.strip()}")
        if self.straggler is not None and _cgroup_root() is None:
            raise ClusterError("--straggler needs the cgroup cpu controller (cgroup v1 'cpu' or v2 with "
                               "cpu delegated at /sys/fs/cgroup) and write access to it")

    def up(self):
        """Build the switch, machines, links and shaping; on any failure remove what was made
        and raise ClusterError."""
        for prefix in stale_prefixes():
            teardown(prefix)
        self._start_reaper()
        try:
            self._build()
        except BaseException:
            self.down()
            raise
        self._started = time.monotonic()

    def _build(self):
        sw = self.switch
        _run("ip", "netns", "add", sw)
        _run("ip", "-n", sw, "link", "set", "lo", "up")
        _run("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", sw, "link", "set", "br0", "up")
        for i in range(self.machines):
            ns = self.namespace(i)
            _run("ip", "netns", "add", ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "-n", sw, "link", "add", f"m{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            _run("ip", "-n", sw, "link", "set", f"m{i}", "master", "br0")
            _run("ip", "-n", sw, "link", "set", f"m{i}", "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.address(i)}/15", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            if self.link:
                for where, dev in ((ns, "eth0"), (sw, f"m{i}")):
                    self._shape(where, dev)
            if self.cgroup(i):
                os.mkdir(self.cgroup(i))
                _set_cpu_limit(self.cgroup(i), self.straggler * self.fair_cores(i))
        cases = "\n".join(f"{self.address(i)}|{self.hostname(i)}) ns={self.namespace(i)} "
                          f"name={self.hostname(i)} cg={self.cgroup(i)};;" for i in range(self.machines))
        hosts = os.path.join(os.path.dirname(self.script), "hosts")
        with open(hosts, "w") as f:
            f.write("127.0.0.1 localhost\n" + "".join(f"{self.address(i)} {self.hostname(i)}\n"
                                                     for i in range(self.machines)))
        with open(self.script, "w") as f:
            f.write(MACHINE_SCRIPT % (cases, NETNS_DIR, shlex.quote(hosts)))
        os.chmod(self.script, 0o755)

    def _shape(self, ns, dev):
        # Bucket: 5 ms of the rate (at least 64 KiB, a GSO segment); queue up to 50 ms more.
        burst = max(64 << 10, int(self.link / 8 * 0.005))
        res = _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                   "rate", f"{int(self.link)}bit", "burst", str(burst), "latency", "50ms", check=False)
        if res.returncode != 0:
            raise ClusterError(f"cannot shape the link with tc's tbf qdisc ({res.stderr.strip()}); "
                               "the kernel needs sch_tbf")

    def _start_reaper(self):
        """A process in a session of its own that tears the set-up down once shoalrun is gone
        (it reads the end of a pipe only shoalrun holds)."""
        read_end, self._reaper = os.pipe()
        subprocess.Popen([sys.executable, os.path.abspath(__file__), "--reap", self.prefix, *self.folders],
                         stdin=read_end, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)
        os.close(read_end)

    def down(self):
        teardown(self.prefix)
        if self._reaper is not None:  # done: the reaper leaves shoalrun's folders to shoalrun
            os.write(self._reaper, DONE)
            os.close(self._reaper)
            self._reaper = None

    def end_processes(self):
        """SIGKILL every process on the emulated machines (the job, not the set-up)."""
        for i in range(self.machines):
            for pid in _run("ip", "netns", "pids", self.namespace(i), check=False).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (OSError, ValueError):
                    pass

    def command(self, machine, argv):
        """argv run on `machine` (its namespace, hostname and cpu group)."""
        return [self.script, self.address(machine), shlex.join(argv)]

    def hosts(self):
        """Hydra's -hosts value: address:slots per machine."""
        return ",".join(f"{self.address(i)}:{n}" for i, n in enumerate(self.ranks))

    @staticmethod
    def env():
        """Settings that make MPI cross machines by TCP over the links and keep it inside a
        machine by MPICH's shared memory: UCX restricted to tcp (it would otherwise find
        shared memory across namespaces), eager for every size (its rendezvous protocol over
        TCP ran at half the link rate in one 24 MiB exchange of two at 1 Gbit/s). Not
        libfabric's tcp provider: there an Isend to a peer that had already finalized blocked
        inside MPI_Isend (a leaving rank's notices; one shutdown in five hung)."""
        return {"MPIR_CVAR_CH4_NETMOD": "ucx", "UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "eth0",
                "UCX_RNDV_THRESH": "inf", "UCX_WARN_UNUSED_ENV_VARS": "n",
                # A rank that leaves tells every peer; peers leaving too finalize without
                # reading it, and UCX warns of each such message ("not matched").
                "UCX_LOG_LEVEL": "error",
                "GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth0"}

    def counters(self):
        """Per machine: bytes it sent and received over its link (the switch end's counters,
        seen from the other side)."""
        out = _run("ip", "-j", "-s", "-n", self.switch, "link", "show").stdout
        by_dev = {d["ifname"]: d.get("stats64", {}) for d in json.loads(out)}
        rows = []
        for i in range(self.machines):
            s = by_dev.get(f"m{i}", {})
            rows.append({"machine": i, "host": self.hostname(i), "address": self.address(i),
                         "ranks": self.ranks[i], "sent_bytes": s.get("rx", {}).get("bytes", 0),
                         "received_bytes": s.get("tx", {}).get("bytes", 0)})
        return rows

    def report(self):
        """(text, record) of what each link carried since up()."""
        elapsed = time.monotonic() - self._started
        rows = self.counters()
        first = 0
        lines = [f"shoalrun: emulated cluster: {self.machines} machines, links "
                 f"{format_rate(self.link) + ' each way' if self.link else 'unshaped'}"
                 + (f", machine {self.machines - 1} a straggler at {self.straggler:g} of its CPU share"
                    if self.straggler is not None else "") + f"; {elapsed:.1f} s",
                 "  machine  host     ranks    sent MiB  recv MiB  sent Mbit/s  recv Mbit/s"]
        for r in rows:
            span = f"{first}-{first + r['ranks'] - 1}" if r["ranks"] > 1 else str(first)
            first += r["ranks"]
            lines.append(f"  {r['machine']:<7}  {r['host']:<7}  {span:<7}  {r['sent_bytes'] / 2**20:8.1f}  "
                         f"{r['received_bytes'] / 2**20:8.1f}  {r['sent_bytes'] * 8 / elapsed / 1e6:11.1f}  "
                         f"{r['received_bytes'] * 8 / elapsed / 1e6:11.1f}")
        record = {"machines": self.machines, "link_bits_per_s": self.link, "straggler": self.straggler,
                  "seconds": elapsed, "links": rows}
        return "\n".join(lines), record


def _reap(prefix, folders):
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    said = b""
    try:
        while True:
            data = os.read(0, 4096)
            if not data:
                break
            said += data
    except OSError:
        pass
    if said == DONE:  # shoalrun tore the set-up down itself
        return
    teardown(prefix)
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__" and sys.argv[1:2] == ["--reap"]:
    _reap(sys.argv[2], sys.argv[3:])
