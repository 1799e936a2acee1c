"""Loaded by every Python process the launch tests start (clean_env puts this folder on
PYTHONPATH): a process still running after MPIDP_TEST_HANG_DUMP seconds prints every thread's
stack to stderr once and goes on, so a job that later hits its timeout says where it was."""

import faulthandler
import os

_after = os.environ.get("MPIDP_TEST_HANG_DUMP")
if _after:
    faulthandler.dump_traceback_later(float(_after), exit=False)
