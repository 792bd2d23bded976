"""A script meant for a launcher, started as `python needs_launcher.py`: init_distributed finds no RANK and
WORLD_SIZE, falls back to MPI discovery and fails on the missing mpi4py."""
import deepspeed

deepspeed.init_distributed()
print("distributed is up")
