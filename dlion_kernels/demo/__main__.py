import os
import sys

from .cli import main

main()
if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # a rank that torchrun started
    # Leave without the interpreter's teardown, as torchft's replicas do (launch.end_replica):
    # the process group is gone, but gloo's threads can outlive it, and one that lets go of a
    # tensor while Python is exiting aborts the rank after its work is done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
