"""Top frames of a `py-spy record --native --format raw` profile (where host time goes).

    py-spy record --native --format raw -o raw.txt -- python3 tools/frontier_probe.py ...
    python3 tools/pyspy_top.py raw.txt --within loop_tps --top 40

Each raw line is `frame;frame;...;leaf count`.  `--within NAME` keeps the samples whose
stack holds a frame starting with NAME (e.g. the decode loop), so model building and
prefill stay out.  Prints self and inclusive shares of the kept samples per frame
(inclusive counted once per sample).  MLX's C++ frames show with py-spy's --native.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter


def frame_name(f: str) -> str:
    f = re.sub(r"^0x[0-9a-f]+ ", "", f.strip())
    f = re.sub(r"\(anonymous namespace\)::", "", f)
    return f[:150]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("raw")
    p.add_argument("--within", default=None)
    p.add_argument("--top", type=int, default=40)
    a = p.parse_args()
    self_c, incl_c, total = Counter(), Counter(), 0
    with open(a.raw) as fh:
        for line in fh:
            stack, _, n = line.rstrip("\n").rpartition(" ")
            if not stack or not n.isdigit():
                continue
            frames = [frame_name(f) for f in stack.split(";")]
            if a.within and not any(f.startswith(a.within) for f in frames):
                continue
            n = int(n)
            total += n
            self_c[frames[-1]] += n
            for f in set(frames):
                incl_c[f] += n
    print(f"{total} samples" + (f" within {a.within}" if a.within else ""))
    print("-- self")
    for f, n in self_c.most_common(a.top):
        print(f"{100 * n / max(total, 1):6.2f} %  {f}")
    print("-- inclusive")
    for f, n in incl_c.most_common(a.top):
        print(f"{100 * n / max(total, 1):6.2f} %  {f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
