#!/usr/bin/env python3
"""Does the size of one folder slow a rename or a lookup on this filesystem?

Usage: big-folder.py SCRATCH_DIR N   (e.g. 20000, then 1000000)

Fills SCRATCH_DIR/big with N entries (hard links to a few files, so the
folder is large while few inodes are made), then times renames of up to
20,000 of them (at most a tenth) out of it and back in, and as many
look-ups of other names. Answers whether spoolq's new/
would need hashed subfolders: compare the figures for a small and a large N.
Removes nothing; delete SCRATCH_DIR afterwards.
"""

import os
import sys
import time

LINKS_PER_FILE = 50_000  # below ext4's 65,000 links per inode
SAMPLE = 20_000


def main() -> None:
    root, n = sys.argv[1], int(sys.argv[2])
    for sub in ("big", "small", "sources"):
        os.makedirs(os.path.join(root, sub))
    big, small, sources = (os.open(os.path.join(root, sub), os.O_RDONLY | os.O_DIRECTORY) for sub in ("big", "small", "sources"))
    for k in range(n // LINKS_PER_FILE + 1):
        os.close(os.open(f"source{k}", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=sources))
    names = [f"20261122T{i:012d}-0123456789.json" for i in range(n)]
    for i, name in enumerate(names):
        os.link(f"source{i // LINKS_PER_FILE}", name, src_dir_fd=sources, dst_dir_fd=big)
    # At most a tenth of the folder is moved, so it stays about its size;
    # look-ups are of other names, not cached by the renames just made.
    step = max(10, n // SAMPLE)
    sample = names[::step][:SAMPLE]
    others = names[step // 2 :: step][:SAMPLE]

    def timed(action, names) -> float:
        start = time.perf_counter()
        for name in names:
            action(name)
        return (time.perf_counter() - start) / len(names) * 1e6

    out = timed(lambda name: os.rename(name, name, src_dir_fd=big, dst_dir_fd=small), sample)
    back = timed(lambda name: os.rename(name, name, src_dir_fd=small, dst_dir_fd=big), sample)
    look = timed(lambda name: os.stat(name, dir_fd=big), others)
    print(f"{n:,} entries: rename out {out:.1f} us, rename in {back:.1f} us, lookup {look:.1f} us")


if __name__ == "__main__":
    main()
