import subprocess
import sys

import pytest

from tests.helpers import EXAMPLES

pytestmark = pytest.mark.process  # every test here starts a Python process


def test_every_command_is_a_library_function_and_import_stays_light():
    code = (
        "import sys, dsdoctor, dsdoctor.api as api\n"
        "names = ['check','split','explain','plan','trace','ab','merge','verify','compare','diagnose','env']\n"
        "assert all(callable(getattr(api, n)) for n in names)\n"
        f"r = api.check({str(EXAMPLES / 'train_zero3_offload.json')!r})\n"
        "assert r.effective.zero_stage == 3, r.effective.zero_stage\n"
        "assert 'DSD101' in api.explain('DSD101')\n"
        "assert dsdoctor.check is api.check and dsdoctor.merge is api.merge\n"
        "assert 'torch' not in sys.modules and 'deepspeed' not in sys.modules, 'heavy import'\n"
        "import dsdoctor.plan.api, dsdoctor.compare.api\n"
        "assert callable(api.plan) and callable(api.compare)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
