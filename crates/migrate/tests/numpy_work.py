"""A numpy computation that prints its progress: its output depends only on
its arguments (a migrated run must print exactly an undisturbed run's)."""
import sys
import time

import numpy as np

steps, size, pause = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
rng = np.random.default_rng(1234)
a = rng.standard_normal((size, size))
acc = np.zeros(size)
for i in range(steps):
    a = np.tanh(a @ a.T / size + 0.01 * i)
    acc += a.sum(axis=0)
    print(f"step {i} {float(acc.sum()):.10e}", flush=True)
    time.sleep(pause)
print(f"done {float(np.linalg.norm(acc)):.10e}", flush=True)
