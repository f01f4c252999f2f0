"""Runs scripts one after the other in this one process, each as ``python SCRIPT ARGS`` would run
it (``__main__``, its own ``sys.argv``): ``sequence.py A.py [its args] -- B.py [its args]``.

``test_run.py`` trains two unmodified scripts per launch with it (one torchrun start, not two).
Rank 0 prints ``== SCRIPT`` before each. The process ends with ``os._exit(0)``: freeing a stock DDP
Trainer's reducer can hang in torch's gloo teardown (see dist_worker.py), which is not under test.
"""

import os
import runpy
import sys


def split(args: list[str]) -> list[list[str]]:
    runs = []
    while args:
        end = args.index("--") if "--" in args else len(args)
        runs.append(args[:end])
        args = args[end + 1 :]
    return runs


def run_all(runs: list[list[str]]) -> None:
    for script, *script_args in runs:
        if os.environ.get("RANK", "0") == "0":
            print(f"== {os.path.basename(script)}", flush=True)
        sys.argv = [script, *script_args]
        runpy.run_path(script, run_name="__main__")


def main() -> None:
    run_all(split(sys.argv[1:]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
