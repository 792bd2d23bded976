"""Hangs with a grandchild in a session of its own (as torchrun starts ranks); writes the pids to argv[1]."""
import subprocess
import sys
import time

child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
with open(sys.argv[1], "w") as fh:
    fh.write(f"{child.pid}\n")


def wait_for_peer():
    time.sleep(600)


wait_for_peer()
