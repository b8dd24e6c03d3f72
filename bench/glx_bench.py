#!/usr/bin/env python3
"""Issue 11 part 3 (VMGL's question): which way of showing OpenGL from a program on the cluster
gives more frames per second at home: rendering where the program runs and shipping the images
over the relayed X stream, or GLX over that stream (indirect rendering, drawn by the user's X
server)?

    python3 bench/glx_bench.py [--links lan,coffee-shop] [--seconds 32] [--size 300]

Root, a release build, Xvfb and glxgears (apt-get install -y xvfb mesa-utils x11-apps).
Runs on instance 9 (STARLING_INSTANCE=9 unless set). The user's display is an Xvfb started here
with `+iglx` (indirect GLX allowed) and a cookie. For each link, `starling up --hosts 1 --link L`,
a warm-up (`glxinfo -B`, so the host has fetched libGL and Mesa's driver), then
`glxgears -geometry SIZExSIZE` for --seconds through `starling exec --x11 --host h1`:

* images: as it starts (Mesa renders with llvmpipe where the program runs, and sends each frame
  to the X server as an image: X PutImage requests through the relay);
* indirect: `LIBGL_ALWAYS_INDIRECT=1` (GLX render requests through the relay, drawn at home).

and once on this machine without starling (`local`: the ceiling). FPS is glxgears' own count
(it prints frames per 5 s); the first report is left out (start-up) when there are more. A frame counted is not a
frame seen: after each run the bench grabs the root window (`xwd`) and counts the distinct
pixel values in the gears' window; `painted` is false when the window holds one or two colours
(Xvfb's indirect contexts finish frames without drawing them, so a high FPS there is not an answer).
Writes a table to stdout and JSON to bench/out/glx.json. The emulated link and host share this
machine's 2 cores with the X server and the relay: images at lan speed are bound by those cores.
"""
import argparse
import json
import os
import pathlib
import re
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from provenance import provenance  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
STARLING = str(ROOT / "target/release/starling")
OUT = ROOT / "bench/out/glx.json"
FPS_LINE = re.compile(r"(\d+) frames in ([\d.]+) seconds = ([\d.]+) FPS")


def sh(*a, **kw):
    return subprocess.run(list(a), capture_output=True, text=True, **kw)


def start_xvfb(size, auth):
    cookie = secrets.token_hex(16)
    r, w = os.pipe()
    xvfb = subprocess.Popen(["Xvfb", "-displayfd", str(w), "-screen", "0", f"{size + 100}x{size + 100}x24", "-auth",
                             str(auth), "-nolisten", "tcp", "+iglx"], pass_fds=(w,), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    os.close(w)
    with os.fdopen(r) as f:
        number = f.readline().strip()
    if not number.isdigit():
        sys.exit(f"Xvfb did not start: {xvfb.stderr.read().decode() if xvfb.poll() is not None else ''}")
    display = f":{number}"
    sh("xauth", "-f", str(auth), "add", display, "MIT-MAGIC-COOKIE-1", cookie, check=True)
    return xvfb, dict(os.environ, DISPLAY=display, XAUTHORITY=str(auth))


def colours_in_window(env, size):
    """Distinct pixel values in the top-left SIZE x SIZE of the root window (where glxgears sits)."""
    r = subprocess.run(["xwd", "-root", "-silent"], env=env, capture_output=True)
    if r.returncode != 0:
        return None
    # XWD: a big-endian header whose first word is its own size; 32-bit pixels follow the colour map.
    data = r.stdout
    header_size = int.from_bytes(data[0:4], "big")
    width = int.from_bytes(data[16:20], "big")
    bytes_per_line = int.from_bytes(data[48:52], "big")
    ncolors = int.from_bytes(data[76:80], "big")
    pixels = data[header_size + 12 * ncolors:]
    seen = set()
    for y in range(min(size, len(pixels) // bytes_per_line)):
        row = pixels[y * bytes_per_line: y * bytes_per_line + min(size, width) * 4]
        seen.update(row[i:i + 4] for i in range(0, len(row), 4))
    return len(seen)


def gears(cmd, env, seconds, size):
    """Run glxgears for `seconds`; its FPS reports (the first left out) and the colours it left."""
    argv = cmd + ["timeout", "-s", "INT", str(seconds), "glxgears", "-geometry", f"{size}x{size}+0+0"]
    p = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # Grab the window while it runs (a second before the end), then wait for the reports.
    time.sleep(max(1.0, seconds - 2))
    colours = colours_in_window(env, size)
    out, err = p.communicate(timeout=seconds + 120)
    fps = [float(m.group(3)) for m in FPS_LINE.finditer(out)]
    fps = fps[1:] if len(fps) > 1 else fps
    return {"fps_reports": fps, "fps_median": statistics.median(fps) if fps else None, "colours": colours,
            "painted": colours is not None and colours > 2, "exit": p.returncode,
            "stderr_tail": err.strip()[-300:]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--links", default="lan,coffee-shop")
    ap.add_argument("--seconds", type=int, default=32, help="per run (glxgears reports every 5 s)")
    ap.add_argument("--size", type=int, default=300, help="glxgears window side, pixels")
    a = ap.parse_args()
    os.environ.setdefault("STARLING_INSTANCE", "9")
    for tool, pkg in (("Xvfb", "xvfb"), ("glxgears", "mesa-utils"), ("xwd", "x11-apps"), ("xauth", "xauth")):
        if not shutil.which(tool):
            sys.exit(f"{tool} not found (apt-get install -y {pkg})")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        auth = pathlib.Path(tmp) / "Xauthority"
        auth.touch()
        xvfb, env = start_xvfb(a.size, auth)
        try:
            for mode, extra in (("images", {}), ("indirect", {"LIBGL_ALWAYS_INDIRECT": "1"})):
                row = gears([], dict(env, **extra), a.seconds, a.size)
                rows.append({"link": "local", "mode": mode, **row})
                print(f"{'local':>11} {mode:>8}: {row['fps_median']} FPS, painted {row['painted']}", flush=True)
            for link in a.links.split(","):
                sh(STARLING, "down")
                r = sh(STARLING, "up", "--hosts", "1", "--link", link, timeout=300)
                if r.returncode != 0:
                    sys.exit(f"starling up --link {link}: {r.stdout}{r.stderr}")
                try:
                    for mode, extra in (("images", {}), ("indirect", {"LIBGL_ALWAYS_INDIRECT": "1"})):
                        # The task gets the caller's environment (LIBGL_ALWAYS_INDIRECT with it).
                        task = [STARLING, "exec", "--x11", "-T", "--host", "h1", "--"]
                        # Warm-up, not measured: the host fetches libGL and Mesa's driver (llvmpipe pulls
                        # in libLLVM, ~100 MiB) from this machine once, which over coffee-shop takes minutes.
                        t = time.monotonic()
                        warm = sh(*task, "glxinfo", "-B", env=dict(env, **extra), timeout=900)
                        print(f"{link:>11} {mode:>8}: warm-up (glxinfo -B) exit {warm.returncode} in "
                              f"{time.monotonic() - t:.0f} s", flush=True)
                        row = gears(task, dict(env, **extra), a.seconds, a.size)
                        rows.append({"link": link, "mode": mode, **row})
                        print(f"{link:>11} {mode:>8}: {row['fps_median']} FPS, painted {row['painted']}", flush=True)
                finally:
                    sh(STARLING, "down")
        finally:
            xvfb.terminate()
            xvfb.wait()
    better = {}
    for link in sorted({r["link"] for r in rows}):
        by = {r["mode"]: r for r in rows if r["link"] == link and r["painted"] and r["fps_median"]}
        better[link] = max(by, key=lambda m: by[m]["fps_median"]) if by else None
    doc = {"provenance": provenance(), "cores": os.cpu_count(), "load_at_end": os.getloadavg()[0],
           "params": {"seconds": a.seconds, "size": a.size},
           "rows": rows, "more_fps_painted": better}
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"\nmore frames per second, among runs that painted: {better}\nwrote {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
