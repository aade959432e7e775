"""Micro-benchmark: decoding one 64-key ``load_many`` request, in each of several checkouts.

Usage: ``python benchmarks/decode_request.py TREE [TREE ...]`` (each a kvtier checkout with its
``.venv``, e.g. ``/work/main /work/wt-proto``). Each tree runs in its own interpreter (both are
the ``kvtier`` package), with ``timeit`` (best of 7 x 20,000 calls, microseconds per call):

- ``map_path``: ``decode_request(unpack_body(body))`` (msgpack, then the map's checks);
- ``body_path``: ``decode_request_body(body)`` where the tree has it (msgspec, from the bytes);
- ``encode``: ``encode_request`` of the same request.
"""

from __future__ import annotations

import json
import subprocess
import sys

CODE = r"""
import json, timeit
from kvtier import protocol as P
keys = [bytes([i]) * 32 for i in range(1, 65)]
parents = [None] + keys[:-1]
body = bytearray(P.encode_request(P.LoadMany(keys, parents), 7)[4:])
fns = {"map_path": lambda: P.decode_request(P.unpack_body(body))}
if hasattr(P, "decode_request_body"):
    fns["body_path"] = lambda: P.decode_request_body(body)
fns["encode"] = lambda: P.encode_request(P.LoadMany(keys, parents), 7)
out = {}
for name, fn in fns.items():
    if name != "encode":
        _, req = fn()
        assert list(req.keys) == keys and list(req.parents) == parents
    out[name] = round(min(timeit.repeat(fn, number=20000, repeat=7)) / 20000 * 1e6, 2)
print(json.dumps(out))
"""


def main(trees: list[str]) -> None:
    for tree in trees:
        r = subprocess.run([f"{tree}/.venv/bin/python", "-c", CODE], cwd=tree, capture_output=True, text=True,
                           env={"PYTHONPATH": tree, "PATH": "/usr/bin:/bin"})
        print(tree, json.loads(r.stdout) if r.returncode == 0 else r.stderr[-2000:])


if __name__ == "__main__":
    main(sys.argv[1:])
