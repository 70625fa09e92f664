"""The GPU check's Python helpers print one JSON document on stdout and nothing else.

json_stdout.run(fn) calls fn() with file descriptor 1 pointed at stderr, so that what
torch, CUDA or a plugin write there from C (a driver's banner, a printf) lands in the
step's log and never in the JSON; then writes fn's (document, exit status) to stdout.
"""
import json
import os
import sys


def run(fn):
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        document, status = fn()
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
    if document is not None:
        sys.stdout.write(json.dumps(document) + "\n")
    return status
