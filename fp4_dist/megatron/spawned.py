"""The ``__main__`` of a process that multiprocessing spawns from a rank of ``fp4_dist.megatron.run`` on Python 3.11.

A spawned process re-runs the parent's main script as ``__mp_main__`` before it unpickles its target; the script
imports megatron.training, which imports ``typing.override`` (Python 3.12). Megatron's checkpoint saving in its
default format spawns one such process (the result queue's manager, ``filesystem_async.get_write_results_queue``),
which failed on 3.11 with ImportError and left the ranks an EOFError. `fp4_dist.megatron.run` names this module as
the child's main instead: it provides the decorator first, then runs the script as upstream's child would.
"""

import os
import runpy

from fp4_dist.megatron.patching import python_311_shim

SCRIPT = "FP4_DIST_SPAWNED_MAIN"
"""The environment variable naming the script (the child inherits the rank's environment; its argv[0] is this
module's path while this runs)."""

if __name__ == "__mp_main__":
    python_311_shim()
    globals().update(runpy.run_path(os.environ[SCRIPT], run_name="__mp_main__"))
