import pytest

from dsdoctor.proctree import unlink_leaked_deepspeed_shm

# Every CPU DeepSpeed launch leaves 66 MB per rank in /dev/shm (see dsdoctor.proctree). dsdoctor's own
# launches clean up after themselves; the suite's direct launches are cleaned here. Without this a few
# suite runs fill the machine's memory and everything after that thrashes (this once ran CI past its limit).


@pytest.fixture(autouse=True, scope="session")
def _no_leaked_deepspeed_shm_at_start_or_end():
    unlink_leaked_deepspeed_shm()
    yield
    unlink_leaked_deepspeed_shm()


@pytest.fixture(autouse=True)
def _no_leaked_deepspeed_shm_after_each_test():
    yield
    unlink_leaked_deepspeed_shm()
