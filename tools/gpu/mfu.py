"""The GPU check's GPT figures: samples/s and model FLOP utilisation, as JSON on stdout.

  mfu.py RUN_DIR --layers L --d-model D --seq-len T --batch B [--parameters N]
         [--gpu NAME] [--matmul-tflops X]

Model FLOPs per token (PaLM, appendix B): 6 N + 12 L D T, where N is every parameter
(forward 2 N, backward 4 N) and 12 L D T is attention's scores and weighted sums
(forward and backward) over a context of T. A sample is T tokens, so per sample:
(6 N + 12 L D T) T. Model FLOP/s = that x samples/s (the median of the metrics records
after the first, which holds the warm-up). MFU is model FLOP/s over
  (a) the datasheet's dense bf16 peak: 989 TFLOP/s for H100 SXM and H200 (756 for H100
      PCIe, 835 for H100 NVL), and
  (b) a bf16 matrix product measured on the spot (tools/gpu/matmul.py, --matmul-tflops).
A run with a loss that is not finite, or a skipped step, exits 1 (tools/gpu/runs.py's
health): its figures would not be a model's.
"""
import argparse
import json
import os
import statistics
import sys

sys.dont_write_bytecode = True  # no __pycache__ left in the tree that travels
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import runs  # noqa: E402  (tools/gpu/runs.py, beside this file)

# Dense bf16 tensor-core peaks, TFLOP/s, by what nvidia-smi calls the card (first match).
DATASHEET_BF16 = [("H200", 989.0), ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0),
                  ("A100", 312.0)]


def datasheet_peak(gpu):
    for name, peak in DATASHEET_BF16:
        if name.lower() in gpu.lower():
            return name, peak
    return None, None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir")
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--d-model", type=int, required=True)
    ap.add_argument("--seq-len", type=int, required=True)
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--parameters", type=int, default=0)
    ap.add_argument("--gpu", default="")
    ap.add_argument("--matmul-tflops", type=float, default=0.0)
    a = ap.parse_args()
    try:
        summary, records, problems = runs.health(a.run_dir)
    except (OSError, ValueError) as e:
        print(json.dumps({"problems": ["cannot read the run: %s" % e]}))
        return 2
    L, D, T, V = a.layers, a.d_model, a.seq_len, a.vocab
    # tetra's gpt: token and position embeddings, per layer qkv + proj + 2 MLP matrices
    # (d_ff = 4 D) with biases and two layer norms, a final norm, an untied head.
    analytic = V * D + T * D + L * (12 * D * D + 13 * D) + 2 * D + D * V + V
    N = a.parameters or analytic
    train = [r for r in records if not r.get("eval") and "samples_per_s" in r]
    steady = [r["samples_per_s"] for r in train[1:]] or [summary.get("samples_per_s") or 0]
    sps = statistics.median(steady)
    per_token = 6 * N + 12 * L * D * T
    per_sample = per_token * T
    model_flops = per_sample * sps
    name, peak = datasheet_peak(a.gpu)
    out = {
        "formula": "model FLOPs/sample = (6 N + 12 L D T) T",
        "parameters": N, "parameters_source": "train --dry-run" if a.parameters else "formula",
        "parameters_analytic": analytic, "layers": L, "d_model": D, "seq_len": T, "batch": a.batch,
        "model_flops_per_sample": per_sample, "model_flops_per_step": per_sample * a.batch,
        "samples_per_s_whole_run": round(summary.get("samples_per_s") or 0, 2),
        "samples_per_s_steady": round(sps, 2), "intervals": len(train),
        "tokens_per_s_steady": round(sps * T), "model_tflops_per_s": round(model_flops / 1e12, 2),
        "gpu": a.gpu,
        "datasheet_peak_tflops": peak, "datasheet_card": name,
        "mfu_datasheet": round(model_flops / (peak * 1e12), 4) if peak else None,
        "matmul_tflops_measured": round(a.matmul_tflops, 1) if a.matmul_tflops else None,
        "mfu_measured_matmul": round(model_flops / (a.matmul_tflops * 1e12), 4) if a.matmul_tflops else None,
        "final_loss": summary.get("final_loss"), "steps": summary.get("steps"),
        "skipped_steps": summary.get("skipped_steps"),
        "step_ms": ((summary.get("ranks") or [{}])[0]).get("step_ms"),
        "train_seconds": round(summary.get("train_seconds") or 0, 2),
        "problems": problems,
    }
    print(json.dumps(out))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
