"""The GPU check's summary: one JSON document and a tarball of its logs, in --out.

  summary.py --steps DIR --logs DIR --carry DIR --repo DIR --build DIR --device D
             --budget S --started T --wall S --out DIR

Writes OUT/gpu-check-summary.json (the result, the commit, each step's status, time,
reason, figures and, when it failed, its log's last lines; every build error) and
OUT/gpu-check-logs.tar.gz (every step's log, the build's, the runs' metrics.jsonl,
summary.json and job.yaml, the probes' JSON, the CMake logs, the carry's COMMIT, MANIFEST
and CARRY.txt; no file over 4 MiB), then prints a short table, the last thing the device
tool shows. Exits 1 when a step failed.
"""
import argparse
import io
import json
import os
import socket
import subprocess
import sys
import tarfile
import time

MAX_FILE = 4 << 20
MAX_TAR = 15 << 20


def read(path, default=""):
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return default


def figures(path):
    out = {}
    for line in read(path).splitlines():
        key, _, value = line.partition("\t")
        if not key:
            continue
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


def commit_of(repo, carry):
    """The tree's commit: git's where the tree has its .git, else what --prepare wrote."""
    try:
        head = subprocess.run(["git", "-C", repo, "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, timeout=20)
        if head.returncode == 0 and head.stdout.strip():
            dirty = subprocess.run(["git", "-C", repo, "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=60).stdout.strip()
            return head.stdout.strip() + ("+" if dirty else ""), "git"
    except (OSError, subprocess.SubprocessError):
        pass
    lines = read(os.path.join(carry, "COMMIT")).splitlines()
    if lines and lines[0].strip():
        return lines[0].strip(), "the carry's COMMIT (%s)" % (lines[1].lstrip("# ") if len(lines) > 1 else "--prepare")
    return "unknown", "no git and no COMMIT in the carry (run tools/gpu-check.sh --prepare)"


def carry_of(carry):
    """What --prepare said the carry is (CARRY.txt's closing lines)."""
    out = {"dir": carry}
    for line in read(os.path.join(carry, "CARRY.txt")).splitlines():
        for key in ("carry", "working tree", "together"):
            if line.startswith("# %s: " % key):
                out[key.replace(" ", "_")] = line[len(key) + 4:]
    return out


def steps_of(a):
    order = []
    for name in read(os.path.join(a.steps, "ORDER")).split():
        if name not in order:
            order.append(name)
    out = []
    for name in order:
        base = os.path.join(a.steps, name)
        t = read(base + ".time").split()
        step = {"name": name, "status": read(base + ".status").strip() or "not run",
                "wall_s": float(t[0]) if t else 0.0, "timeout_s": int(float(t[1])) if len(t) > 1 else 0}
        reason = read(base + ".reason").strip()
        if reason:
            step["reason"] = reason[:3000]
        headline = read(base + ".headline").strip()
        if headline:
            step["headline"] = headline.splitlines()[0][:600]
        figs = figures(base + ".fig")
        if figs:
            step["figures"] = figs
        log = os.path.join(a.logs, name + ".log")
        if os.path.exists(log):
            step["log"] = os.path.relpath(log, a.logs)
            if step["status"] == "fail":
                tail = [l[:300] for l in read(log).splitlines() if l.strip()][-20:]
                step["log_tail"] = tail
        out.append(step)
    return out


def tarball(a, dest):
    """Every log, the runs' records and the CMake logs, small files only."""
    picked, left_out = [], []

    def add(path, arc):
        if not os.path.isfile(path):
            return
        size = os.path.getsize(path)
        if size > MAX_FILE:
            left_out.append("%s (%d bytes)" % (arc, size))
        else:
            picked.append((path, arc))

    for d, dirs, files in os.walk(a.logs):
        rel = os.path.relpath(d, a.logs)
        dirs[:] = [x for x in dirs if x not in ("ckpt", "flight") and not (rel == "." and x == "mpi-hello")]
        for f in sorted(files):
            if f in ("corpus.txt",) or f.endswith((".safetensors", ".bin")):
                continue
            if rel.startswith("runs") and not (f in ("summary.json", "metrics.jsonl", "job.yaml") or f.endswith(".log")):
                continue
            add(os.path.join(d, f), os.path.normpath(os.path.join("logs", rel, f)))
    for f in ("CMakeFiles/CMakeError.log", "CMakeFiles/CMakeOutput.log", "CMakeFiles/CMakeConfigureLog.yaml",
              "CMakeCache.txt", "gpu-check-configure.log", ".ninja_log"):
        add(os.path.join(a.build, f), os.path.join("build", f))
    for f in ("COMMIT", "CARRY.txt", "debs/MANIFEST"):
        add(os.path.join(a.carry, f), os.path.join("carry", f))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for path, arc in picked:
            if buf.tell() > MAX_TAR:
                left_out.append(arc + " (the tarball is full)")
                continue
            tar.add(path, arcname=arc, recursive=False)
    with open(dest, "wb") as f:
        f.write(buf.getvalue())
    return len(picked), left_out


def main():
    ap = argparse.ArgumentParser()
    for k in ("steps", "logs", "carry", "repo", "build", "device", "started", "out"):
        ap.add_argument("--" + k, required=True)
    ap.add_argument("--budget", type=int, required=True)
    ap.add_argument("--wall", type=float, required=True)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    steps = steps_of(a)
    result = "fail" if any(s["status"] == "fail" for s in steps) else "pass"
    by = {s["name"]: s for s in steps}
    env = by.get("environment", {}).get("figures", {})
    commit, source = commit_of(a.repo, a.carry)
    errors = []
    for name in ("configure", "build"):
        errors += [name + ": " + e for e in by.get(name, {}).get("figures", {}).get("errors", [])]

    def fig(step, *path):
        v = by.get(step, {}).get("figures", {})
        for p in path:
            v = v.get(p) if isinstance(v, dict) else None
        return v

    doc = {
        "tool": "tools/gpu-check.sh",
        "result": result,
        "started": a.started,
        "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": socket.gethostname(),
        "device": a.device,
        "gpu": env.get("gpu") or None,
        "gpus": env.get("gpus"),
        "torch": (env.get("torch") or {}).get("torch") if isinstance(env.get("torch"), dict) else None,
        "commit": commit,
        "commit_source": source,
        "commit_built": fig("binaries", "commit"),
        "carry": carry_of(a.carry),
        "budget_s": a.budget,
        "wall_s": a.wall,
        "figures": {
            "matmul_tflops_measured": fig("matmul", "matmul", "tflops_median"),
            "quickstart_test_accuracy": fig("quickstart", "run", "test_accuracy"),
            "quickstart_samples_per_s": fig("quickstart", "run", "samples_per_s"),
            "gpt_samples_per_s": fig("gpt-bf16", "run", "samples_per_s_steady"),
            "gpt_model_tflops_per_s": fig("gpt-bf16", "run", "model_tflops_per_s"),
            "gpt_mfu_datasheet": fig("gpt-bf16", "run", "mfu_datasheet"),
            "gpt_mfu_measured_matmul": fig("gpt-bf16", "run", "mfu_measured_matmul"),
            "zero3_final_loss_diff": fig("zero3-compare", "compare", "final_loss_diff"),
        },
        "errors": errors,
        "steps": steps,
    }
    summary = os.path.join(a.out, "gpu-check-summary.json")
    n, left_out = tarball(a, os.path.join(a.out, "gpu-check-logs.tar.gz"))
    doc["logs_tarball"] = {"file": "gpu-check-logs.tar.gz", "files": n, "left_out": left_out}
    with open(summary + ".tmp", "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    os.replace(summary + ".tmp", summary)

    print("gpu-check: summary")
    for s in steps:
        line = "  %-16s %-7s %6.1f s" % (s["name"], s["status"], s["wall_s"])
        if s.get("headline") and s["status"] == "pass":
            line += "  " + s["headline"][:300]
        elif s.get("reason"):
            line += "  " + s["reason"].splitlines()[0][:300]
        print(line)
    if errors:
        print("gpu-check: %d build error line(s); the first ones:" % len(errors))
        for e in errors[:8]:
            print("  " + e[:300])
    print("gpu-check: commit %s (%s)%s" % (commit, source, "; train says %s" % doc["commit_built"] if doc["commit_built"] else ""))
    print("gpu-check: %s in %.0f s of the %d s budget; %s and gpu-check-logs.tar.gz (%d files) in %s" % (
        result.upper(), a.wall, a.budget, os.path.basename(summary), n, a.out))
    return 0 if result == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())
