"""Prints one value of a JSON document, for the GPU check's shell steps.

  jget.py FILE KEY[.KEY...]       the value at that path of FILE's JSON
  jget.py --fig FIGFILE KEY[...]  the same of a step's figures ("key<TAB>JSON" lines)
  jget.py --json TEXT KEY[...]    the same of JSON given as text

Strings print bare, numbers as Python prints them, true/false as True/False, null and
absent keys as nothing; objects and lists as JSON. Exit 0 whatever it finds.
"""
import json
import sys


def load(kind, where):
    try:
        if kind == "--json":
            return json.loads(where)
        if kind == "--fig":
            doc = {}
            with open(where) as f:
                for line in f:
                    key, _, value = line.rstrip("\n").partition("\t")
                    if key:
                        doc[key] = json.loads(value)
            return doc
        with open(where) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def main(argv):
    kind = "file"
    if argv and argv[0] in ("--fig", "--json"):
        kind = argv.pop(0)
    if len(argv) != 2:
        sys.stderr.write(__doc__)
        return 2
    value = load(kind, argv[0])
    for part in argv[1].split("."):
        if isinstance(value, dict):
            value = value.get(part)
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            value = None
    if value is None:
        return 0
    if isinstance(value, (dict, list)):
        print(json.dumps(value))
    else:
        print(value)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
