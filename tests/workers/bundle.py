"""Several workers in one job: each rank runs them one after another in the same process,
so it imports torch and TensorFlow once for all of them (a rank's imports cost seconds of
CPU; tests/conftest.py BUNDLES).

    python bundle.py '[["ops_torch.py"], ["psets.py", "torch"]]'

Each part runs as `python <worker> <args>` would (runpy, under __main__, with its own
sys.argv and an empty list of checks), between two lines of this rank,
`[rank R] BUNDLE BEGIN <i>` and `[rank R] BUNDLE END <i> <exit status>`, from which
tests/conftest.py cuts each part's output. Between parts the ranks meet in a barrier and
shut the runtime down, so every part starts on a fresh runtime (init() after shutdown())
with the default topology, as a job of its own would. The bundle exits non-zero if any
part did."""
import json
import os
import runpy
import sys
import traceback
from pathlib import Path

import checks

HERE = Path(__file__).parent
RANK = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))


def exit_status(code):
    """sys.exit's argument as an exit status (None: 0; a message: 1, as Python does)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr, flush=True)
    return 1


def fresh_runtime():
    """Leave together (a rank that shuts down first would fail a peer's last op), then stop
    the runtime; the next part's init() starts a new one."""
    import shoal
    if not shoal.is_initialized():
        return
    try:
        shoal.barrier()
    except Exception:  # noqa: BLE001 - a failed part's runtime: its failure is reported already
        traceback.print_exc()
    shoal.shutdown()


def main():
    parts = json.loads(sys.argv[1])
    saved = dict(vars(checks))  # a worker may replace run_all (neighbor_device.py)
    worst = 0
    for i, (script, *args) in enumerate(parts):
        checks._checks.clear()
        sys.argv = [str(HERE / script), *args]
        print(f"[rank {RANK}] BUNDLE BEGIN {i}", flush=True)
        try:
            runpy.run_path(str(HERE / script), run_name="__main__")
            status = 0
        except SystemExit as done:
            status = exit_status(done.code)
        except BaseException:  # noqa: BLE001 - ends the job, as it would end a worker's own
            sys.excepthook(*sys.exc_info())
            status = 1
        sys.stdout.flush()
        sys.stderr.flush()
        vars(checks).update(saved)
        fresh_runtime()
        print(f"[rank {RANK}] BUNDLE END {i} {status}", flush=True)
        worst = worst or status
    sys.exit(worst)


if __name__ == "__main__":
    main()
