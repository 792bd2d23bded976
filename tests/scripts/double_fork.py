"""Leaves a daemon behind the way careless scripts do: fork, setsid, fork again, so the sleeper is
re-parented away from this process (to init, or to the nearest child subreaper). Writes the sleeper's pid to
argv[1]; with --hang, this process then waits forever too (for --timeout and signal tests); with --untagged,
the sleeper execs with an empty environment, so dsdoctor's run tag no longer finds it."""
import os
import sys
import time

pid_file = sys.argv[1]
first = os.fork()
if first == 0:
    os.setsid()
    if os.fork() == 0:
        with open(pid_file + ".tmp", "w") as fh:
            fh.write(str(os.getpid()))
        os.replace(pid_file + ".tmp", pid_file)
        if "--untagged" in sys.argv:
            os.execve(sys.executable, [sys.executable, "-c", "import time; time.sleep(600)"], {})
        time.sleep(600)
    os._exit(0)
os.waitpid(first, 0)
while not os.path.exists(pid_file):
    time.sleep(0.01)
print("daemon started", flush=True)
if "--hang" in sys.argv:
    time.sleep(600)
