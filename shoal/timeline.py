"""Read, merge and summarise Shoal's per-rank timelines (SHOAL_TIMELINE=prefix).

    python -m shoal.timeline PREFIX [-o merged.json]

Each rank writes `PREFIX<rank>.json`, a Chrome-trace / Perfetto event array with one
event per line. A file of a running job (or of one that died) has no closing bracket and
maybe a cut last line; `load` repairs both. `merge` writes one trace with every rank as a
process (open it in chrome://tracing or ui.perfetto.dev); the summary gives, per op and
phase, the count, total and mean time, bytes, and the slowest rank.
"""
import argparse
import glob
import json
import re
import sys
from collections import defaultdict


def load(path):
    """The events of one timeline file, tolerating a missing "]" and a cut last line."""
    events = []
    with open(path) as f:
        for line in f:
            line = line.strip().rstrip(",")
            if line in ("[", "]", ""):
                continue
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a partial last event from a job that is still writing (or died)
    return events


def files(prefix):
    """{rank: path} of the files written with this prefix."""
    out = {}
    for path in glob.glob(glob.escape(prefix) + "*.json"):
        m = re.fullmatch(re.escape(prefix) + r"(\d+)\.json", path)
        if m:
            out[int(m.group(1))] = path
    return dict(sorted(out.items()))


def merge(prefix, out_path=None):
    """All ranks' events in one list (written to out_path as JSON if given)."""
    events = [e for _, path in files(prefix).items() for e in load(path)]
    if out_path:
        with open(out_path, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    return events


def _spans(events):
    """(name, pid, seconds, bytes) of every op/phase ("X") and user activity ("B"/"E")."""
    open_ = defaultdict(list)
    for e in events:
        if e.get("ph") == "X":
            yield e["name"], e["pid"], e["dur"] / 1e6, e.get("args", {}).get("bytes", 0)
        elif e.get("ph") == "B":
            open_[(e["pid"], e["tid"])].append(e)
        elif e.get("ph") == "E" and open_[(e["pid"], e["tid"])]:
            b = open_[(e["pid"], e["tid"])].pop()
            yield b["name"], e["pid"], (e["ts"] - b["ts"]) / 1e6, 0


def summary(events):
    """Rows (op, phase or activity, count, total s, mean s, bytes, slowest rank)."""
    rows = defaultdict(lambda: {"count": 0, "total": 0.0, "bytes": 0, "by_rank": defaultdict(float)})
    for name, pid, secs, nbytes in _spans(events):
        r = rows[name]
        r["count"] += 1
        r["total"] += secs
        r["bytes"] += nbytes
        r["by_rank"][pid] += secs
    return [(name, r["count"], r["total"], r["total"] / r["count"], r["bytes"],
             max(r["by_rank"], key=r["by_rank"].get)) for name, r in sorted(rows.items())]


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m shoal.timeline",
                                description="Merge Shoal timelines and summarise them per op.")
    p.add_argument("prefix", help="the SHOAL_TIMELINE prefix the job used")
    p.add_argument("-o", "--output", help="write the merged trace here")
    args = p.parse_args(argv)
    ranks = files(args.prefix)
    if not ranks:
        sys.exit(f"no timeline files {args.prefix}<rank>.json")
    events = merge(args.prefix, args.output)
    print(f"{len(ranks)} ranks, {len(events)} events" + (f"; merged trace: {args.output}" if args.output else ""))
    print(f"{'op / phase':<22} {'count':>7} {'total s':>10} {'mean ms':>9} {'bytes':>12} {'slowest rank':>12}")
    for name, count, total, mean, nbytes, slowest in summary(events):
        print(f"{name:<22} {count:>7} {total:>10.3f} {1e3 * mean:>9.3f} {nbytes:>12} {slowest:>12}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
