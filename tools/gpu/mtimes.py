"""Keeps a second call's build incremental on a warm GPU machine.

  mtimes.py save ROOT FILE      after a build: each source file's content hash and mtime
  mtimes.py restore ROOT FILE   before the next: a file whose content is what was built
                                gets that mtime back

The device tool lays the working tree anew for each call, and a copy may carry new
mtimes: Ninja and make would then rebuild everything though nothing changed. A file
whose bytes differ keeps its new mtime, so what changed is rebuilt. Folders of builds
(build*), runs and .git are not sources.
"""
import hashlib
import json
import os
import sys

SKIP_DIRS = {".git", "runs"}


def sources(root):
    for d, dirs, files in os.walk(root):
        rel = os.path.relpath(d, root)
        if rel == ".":
            dirs[:] = [x for x in dirs if x not in SKIP_DIRS and not x.startswith("build")]
        for f in files:
            p = os.path.join(d, f)
            if os.path.isfile(p) and not os.path.islink(p):
                yield os.path.relpath(p, root)


def digest(path):
    h = hashlib.sha1()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def main(argv):
    if len(argv) != 3 or argv[0] not in ("save", "restore"):
        sys.stderr.write(__doc__)
        return 2
    cmd, root, state = argv
    if cmd == "save":
        doc = {}
        for rel in sources(root):
            p = os.path.join(root, rel)
            doc[rel] = [digest(p), os.stat(p).st_mtime_ns]
        with open(state + ".tmp", "w") as f:
            json.dump(doc, f)
        os.replace(state + ".tmp", state)
        print("mtimes: %d source files recorded" % len(doc))
        return 0
    if not os.path.exists(state):
        print("mtimes: no record of an earlier build")
        return 0
    with open(state) as f:
        doc = json.load(f)
    same = restored = changed = 0
    for rel in sources(root):
        p = os.path.join(root, rel)
        old = doc.get(rel)
        if not old:
            changed += 1
            continue
        st = os.stat(p)
        if st.st_mtime_ns == old[1]:
            same += 1
        elif digest(p) == old[0]:
            os.utime(p, ns=(old[1], old[1]))
            restored += 1
        else:
            changed += 1
    print("mtimes: %d files as built, %d given back their mtime, %d new or changed" % (same, restored, changed))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
