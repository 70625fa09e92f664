"""Prints a text file's lines as one JSON list (at most 200, each at most 400 characters),
for the GPU check's summary: every compile or configure error of a build."""
import json
import sys

with open(sys.argv[1], errors="replace") as f:
    lines = [line.rstrip("\n")[:400] for line in f if line.strip()]
print(json.dumps(lines[:200] + (["... and %d more" % (len(lines) - 200)] if len(lines) > 200 else [])))
