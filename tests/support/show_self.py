"""What a started process sees of itself, as one JSON line (run as ``python -m``): the
warm-start tests compare it with what a fresh interpreter would see."""

import json
import os
import sys

with open("/proc/self/cmdline", "rb") as f:
    cmdline = [a.decode() for a in f.read().split(b"\0") if a]
with open("/proc/self/status") as f:  # who it runs as, and with what privileges
    status = dict(line.split(":", 1) for line in f if ":" in line)
identity = {k: status[k].split() for k in ("Uid", "Gid", "Groups", "CapInh", "CapPrm",
                                             "CapEff", "CapAmb")}
print(json.dumps({"netns": os.readlink("/proc/self/ns/net"), "cmdline": cmdline,
                  "argv": sys.argv[1:], "cwd": os.getcwd(), "sid": os.getsid(0),
                  "pid": os.getpid(), "probe": os.environ.get("GRADBED_PROBE"),
                  "identity": identity, "home": os.environ.get("HOME"),
                  "host": os.environ.get("GRADBED_HOST"),
                  # what it found imported already (a warm process's preloads)
                  "preloaded": sorted(m for m in ("agents.workloads.base", "agents.net.wire",
                                                  "sklearn") if m in sys.modules)}),
      flush=True)
if "--exit" in sys.argv:
    sys.exit(int(sys.argv[sys.argv.index("--exit") + 1]))
if "--sleep" in sys.argv:
    import time

    time.sleep(float(sys.argv[sys.argv.index("--sleep") + 1]))
