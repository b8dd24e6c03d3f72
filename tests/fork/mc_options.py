"""QuantLib pattern on the cluster: build numpy arrays, fork 4 clones onto other hosts, price a
European call by Monte Carlo split by clone id, collate in the parent, check against a local run.
Prints one JSON line: {"remote": price, "local": price, "bs": price, "hosts": [...]}."""
import json
import math
import os
import socket
import struct
import sys

import numpy as np
import starling

S0, K, R, SIGMA, T = 100.0, 105.0, 0.05, 0.2, 1.0
N_PATHS, N_CLONES = 2_000_000, 4


def payoff_sum(normals):
    st = S0 * np.exp((R - 0.5 * SIGMA * SIGMA) * T + SIGMA * math.sqrt(T) * normals)
    return float(np.maximum(st - K, 0.0).sum())


def black_scholes():
    d1 = (math.log(S0 / K) + (R + 0.5 * SIGMA**2) * T) / (SIGMA * math.sqrt(T))
    d2 = d1 - SIGMA * math.sqrt(T)
    n = lambda x: 0.5 * (1 + math.erf(x / math.sqrt(2)))
    return S0 * n(d1) - K * math.exp(-R * T) * n(d2)


out = sys.argv[1]
# Built BEFORE the fork: the clones read these arrays from the parent's memory.
normals = np.random.default_rng(7).standard_normal(N_PATHS)
slices = [normals[i * N_PATHS // N_CLONES:(i + 1) * N_PATHS // N_CLONES] for i in range(N_CLONES)]
t = starling.request_ticket(N_CLONES)
cid = starling.clone(t)
if cid > 0:
    with open(os.path.join(out, f"partial{cid}"), "wb") as f:
        f.write(struct.pack("<d", payoff_sum(slices[cid - 1])))
    with open(os.path.join(out, f"host{cid}"), "w") as f:
        f.write(socket.gethostname())
    starling.exit(0)
statuses = starling.join(t)
assert statuses == [("exited", 0)] * t.allocation, statuses
partials = [struct.unpack("<d", open(os.path.join(out, f"partial{i}"), "rb").read())[0] for i in range(1, N_CLONES + 1)]
local = [payoff_sum(s) for s in slices]
disc = math.exp(-R * T) / N_PATHS
print(json.dumps({
    "remote": disc * sum(partials), "local": disc * sum(local), "bs": black_scholes(),
    "identical": partials == local,
    "hosts": [open(os.path.join(out, f"host{i}")).read() for i in range(1, N_CLONES + 1)],
    "parent": socket.gethostname(),
}))
