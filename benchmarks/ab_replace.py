"""A/B: a save over the file the last save wrote (a job saving to one path
every epoch), the replaced file freed on lazyckpt's release thread (the
default) vs inside the save's rename (the previous behaviour, restored here
by patching the rename the file commit uses); a save of a new file and the
raw O_DIRECT and buffered writes of the same bytes alongside (the faster
one is the ceiling). Same process, shuffled order
every repetition (seeded), everything durable before the clock stops; the
release of a replaced file is waited for, untimed, before the next method.

On a file system mounted with ``discard`` (this machine's ext4) freeing a
file's blocks is a synchronous TRIM, paid by whoever drops its last reference.

    python benchmarks/ab_replace.py --gib 0.75 --tensors 64 --reps 7 --dir /work/bench-restore
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import lazyckpt  # noqa: E402
import lazyckpt.storage.layout as layout  # noqa: E402
from _common import machine_line, print_against, restore_state_args  # noqa: E402
from lazyckpt.cli import bench as raw  # noqa: E402
from lazyckpt.storage import fileio  # noqa: E402


def main() -> None:
    args, state, nbytes = restore_state_args(__doc__.splitlines()[0], reps=7)
    path = lambda name: os.path.join(args.dir, name)  # noqa: E731
    deferred = layout.replace_releasing_later

    def over_last(replace, name):
        def go():
            layout.replace_releasing_later = replace
            try:
                lazyckpt.save(state, path(name))
            finally:
                layout.replace_releasing_later = deferred
        return go

    def new_file():
        raw.remove(path("new.lzc"))
        os.sync()
        t = time.perf_counter()
        lazyckpt.save(state, path("new.lzc"))
        return time.perf_counter() - t

    def raw_write():
        raw.remove(path("raw.bin"))
        os.sync()
        return raw.raw_write(path("raw.bin"), nbytes, lazyckpt.Options().writer_threads)[0]
    def raw_write_buffered():
        raw.remove(path("raw.bin"))
        os.sync()
        return raw.raw_write_buffered(path("raw.bin"), nbytes)
    methods = {"raw O_DIRECT, new file": raw_write,
               "raw buffered, new file": raw_write_buffered,
               "save, new file": new_file,
               "save over the last, released later": over_last(deferred, "later.lzc"),
               "save over the last, freed in the rename": over_last(os.replace, "inline.lzc")}
    for name in ("later.lzc", "inline.lzc"):
        lazyckpt.save(state, path(name))
    times = {k: [] for k in methods}
    for rep in range(args.reps):
        names = list(methods)
        random.Random(rep).shuffle(names)
        for name in names:
            os.sync()
            t = time.perf_counter()
            r = methods[name]()
            times[name].append(r if isinstance(r, float) else time.perf_counter() - t)
            fileio.wait_for_releases()
    print(machine_line())
    print(f"{nbytes / 1e9:.3f} GB in {len(state)} tensors, {args.reps} shuffled repetitions, durable saves")
    best = min(("raw O_DIRECT, new file", "raw buffered, new file"), key=lambda k: statistics.median(times[k]))
    print_against(times, best, nbytes, width=42)
    later, inline = times["save over the last, released later"], times["save over the last, freed in the rename"]
    print(f"released later / freed in the rename: {statistics.median(later) / statistics.median(inline):.2f} (time)")
    for name in ("later.lzc", "inline.lzc", "new.lzc", "raw.bin"):
        raw.remove(path(name))


if __name__ == "__main__":
    main()
