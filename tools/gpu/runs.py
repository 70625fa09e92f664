"""The GPU check's reading of tetra run folders (summary.json, metrics.jsonl), as JSON.

  runs.py check DIR                 the run's health: every train loss finite, no step
                                    skipped (train.on_nonfinite: skip), a finite final loss
  runs.py quickstart DIR [--min-accuracy A]
                                    the quickstart's figures, failing under accuracy A
  runs.py compare ONE TWO [--max-loss-diff X]
                                    one process against two ranks: losses step by step and
                                    the final parameters (model.safetensors)

Prints one JSON object on stdout; exits 1 when the run is unhealthy or a bound is missed
(the object's "problems" say why), 2 when the folder cannot be read.
"""
import argparse
import array
import json
import math
import os
import struct
import sys


def finite(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def load_run(d):
    with open(os.path.join(d, "summary.json")) as f:
        summary = json.load(f)
    records = []
    path = os.path.join(d, "metrics.jsonl")
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line:
                    # tetra writes a non-finite loss as null; Python's reader would also
                    # take NaN and Infinity, should a writer ever print them.
                    records.append(json.loads(line))
    return summary, records


def health(d):
    """Problems of one run: a loss that is not finite, a skipped step."""
    summary, records = load_run(d)
    problems = []
    train = [r for r in records if not r.get("eval") and "loss" in r]
    bad = [r.get("step") for r in train if not finite(r.get("loss"))]
    if bad:
        problems.append("loss not finite at step%s %s" % ("s" if len(bad) > 1 else "", ", ".join(map(str, bad[:10]))))
    skipped_records = [r.get("step") for r in train if r.get("skipped")]
    skipped = max([summary.get("skipped_steps") or 0] + [r.get("skipped_steps") or 0 for r in train])
    if skipped or skipped_records:
        problems.append("%d step(s) skipped for a loss or gradient that was not finite (train.on_nonfinite: skip)%s" % (
            max(skipped, len(skipped_records)),
            ", at step " + ", ".join(map(str, skipped_records[:10])) if skipped_records else ""))
    if not finite(summary.get("final_loss")):
        problems.append("final loss %s" % summary.get("final_loss"))
    evals = [r for r in records if r.get("eval")]
    bad_eval = [r.get("step") for r in evals if not finite(r.get("test_loss"))]
    if bad_eval:
        problems.append("test loss not finite at step %s" % ", ".join(map(str, bad_eval[:10])))
    if not train:
        problems.append("no train record in metrics.jsonl")
    return summary, records, problems


def cmd_check(a):
    summary, records, problems = health(a.dir)
    out = {"steps": summary.get("steps"), "skipped_steps": summary.get("skipped_steps"),
           "final_loss": summary.get("final_loss"), "records": len(records), "problems": problems}
    print(json.dumps(out))
    return 1 if problems else 0


def cmd_quickstart(a):
    summary, records, problems = health(a.dir)
    e = summary.get("final_eval") or {}
    acc = e.get("test_accuracy")
    if not finite(acc):
        problems.append("no test accuracy in summary.json")
    elif acc < a.min_accuracy:
        problems.append("test accuracy %.4f, under the %.2f configs/quickstart.yaml promises" % (acc, a.min_accuracy))
    out = {"test_accuracy": acc, "test_loss": e.get("test_loss"), "final_loss": summary.get("final_loss"),
           "steps": summary.get("steps"), "skipped_steps": summary.get("skipped_steps"),
           "samples_per_s": round(summary.get("samples_per_s") or 0, 1),
           "train_seconds": round(summary.get("train_seconds") or 0, 2),
           "total_seconds": round(summary.get("total_seconds") or 0, 2),
           "commit": summary.get("commit"), "problems": problems}
    print(json.dumps(out))
    return 1 if problems else 0


def safetensors_f32(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        head = json.loads(f.read(n))
        data = f.read()
    out = {}
    for k, v in head.items():
        if k == "__metadata__" or v.get("dtype") != "F32":
            continue
        a = array.array("f")
        a.frombytes(data[v["data_offsets"][0]:v["data_offsets"][1]])
        out[k] = a
    return out


def cmd_compare(a):
    s1, r1, p1 = health(a.one)
    s2, r2, p2 = health(a.two)
    problems = ["one process: " + p for p in p1] + ["two ranks: " + p for p in p2]
    l1 = {r["step"]: r["loss"] for r in r1 if not r.get("eval") and finite(r.get("loss"))}
    l2 = {r["step"]: r["loss"] for r in r2 if not r.get("eval") and finite(r.get("loss"))}
    common = sorted(set(l1) & set(l2))
    rel = max((abs(l1[k] - l2[k]) / max(abs(l1[k]), 1e-12) for k in common), default=None)
    out = {"final_loss_one_rank": s1.get("final_loss"), "final_loss_two_ranks": s2.get("final_loss"),
           "steps_compared": len(common), "loss_max_rel_diff": rel,
           "samples_per_s_one_rank": round(s1.get("samples_per_s") or 0, 1),
           "samples_per_s_two_ranks": round(s2.get("samples_per_s") or 0, 1)}
    if finite(s1.get("final_loss")) and finite(s2.get("final_loss")):
        diff = abs(s1["final_loss"] - s2["final_loss"])
        out["final_loss_diff"] = diff
        if diff > a.max_loss_diff:
            problems.append("two ranks end at a loss %.3g away from one process's (over %g)" % (diff, a.max_loss_diff))
    if not common:
        problems.append("no step logged by both runs")
    m1, m2 = os.path.join(a.one, "model.safetensors"), os.path.join(a.two, "model.safetensors")
    if os.path.exists(m1) and os.path.exists(m2):
        t1, t2 = safetensors_f32(m1), safetensors_f32(m2)
        worst, at, count = 0.0, "", 0
        for k in sorted(set(t1) & set(t2)):
            for x, y in zip(t1[k], t2[k]):
                count += 1
                if abs(x - y) > worst:
                    worst, at = abs(x - y), k
        out.update({"parameters_compared": count, "parameters_same_names": sorted(t1) == sorted(t2),
                    "parameter_max_abs_diff": worst, "parameter_max_abs_diff_at": at})
    else:
        out["parameters_compared"] = 0
    out["problems"] = problems
    print(json.dumps(out))
    return 1 if problems else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check")
    c.add_argument("dir")
    q = sub.add_parser("quickstart")
    q.add_argument("dir")
    q.add_argument("--min-accuracy", type=float, default=0.88)
    m = sub.add_parser("compare")
    m.add_argument("one")
    m.add_argument("two")
    m.add_argument("--max-loss-diff", type=float, default=1e-3)
    a = ap.parse_args()
    try:
        return {"check": cmd_check, "quickstart": cmd_quickstart, "compare": cmd_compare}[a.cmd](a)
    except (OSError, ValueError, KeyError) as e:
        print(json.dumps({"problems": ["cannot read the run: %s" % e]}))
        return 2


if __name__ == "__main__":
    sys.exit(main())
