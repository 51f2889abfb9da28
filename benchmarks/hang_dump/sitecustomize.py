"""Imported at start-up by every Python process that has this folder on PYTHONPATH (spawned
tensor-parallel workers too): with HANG_DUMP_AFTER=<seconds> set, print every thread's traceback
to stderr after that long, to show where a hang sits."""
import faulthandler
import os
import sys

if os.environ.get("HANG_DUMP_AFTER"):
    faulthandler.dump_traceback_later(float(os.environ["HANG_DUMP_AFTER"]), file=sys.stderr)
