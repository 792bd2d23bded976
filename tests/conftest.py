import pytest

from dsdoctor.proctree import deepspeed_shm_files, unlink_leaked_deepspeed_shm

# Every CPU DeepSpeed launch leaves 66 MB per rank in /dev/shm (see dsdoctor.proctree). dsdoctor's own
# launches clean up after themselves; the suite's direct launches are cleaned here. Without this a few
# suite runs fill the machine's memory and everything after that thrashes (this once ran CI past its limit).
# Only workspaces that appeared during this session (or this test) and that no live process maps are
# unlinked: another job's files on the same machine are not this suite's to touch.


@pytest.fixture(autouse=True, scope="session")
def _no_leaked_deepspeed_shm_at_end():
    before = deepspeed_shm_files()
    yield
    unlink_leaked_deepspeed_shm(deepspeed_shm_files() - before)


@pytest.fixture(autouse=True)
def _no_leaked_deepspeed_shm_after_each_test():
    before = deepspeed_shm_files()
    yield
    unlink_leaked_deepspeed_shm(deepspeed_shm_files() - before)
