"""A launcher whose two ranks finish at once while it lingers past any timeout:
python ranks_exit_before_timeout.py [READY_FILE] (written once both ranks have exited)

Each rank (RANK=0/1, WORLD_SIZE=2, as a launcher sets them) exits successfully; the launcher then keeps
running, as a launcher still tearing down or waiting on a helper does. No DeepSpeed needed."""
import os
import subprocess
import sys
import time

if os.environ.get("RANK") is not None:  # a rank: its work is done at once
    print(f"rank {os.environ['RANK']} done", flush=True)
    sys.exit(0)

for rank in (0, 1):
    env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2")
    subprocess.run([sys.executable, __file__], env=env, check=True)
if len(sys.argv) > 1:
    with open(sys.argv[1], "w") as fh:
        fh.write("both ranks exited\n")
time.sleep(600)  # the launcher lingers
