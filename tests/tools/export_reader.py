#!/usr/bin/python3
"""Evaluates a tetra export in PyTorch, from the safetensors file and its config.json alone.

    export_reader.py MODEL.safetensors CONFIG.json FASHION_MNIST_DIR [SAMPLES]

Prints one JSON line: {"test_loss": ..., "accuracy": ..., "samples": N}. What a user of
the weights does (issue 33, item 4): the layers come from the config's layer texts
(torch.nn reprs), the tensors from the safetensors file (read by hand: Debian's torch
has no safetensors module), the input from the raw IDX test files through the config's
preprocessing. Nothing of tetra's job file or code is read.
"""
import gzip
import json
import re
import struct
import sys

import torch


def read_safetensors(path):
    dtypes = {"F32": torch.float32, "F64": torch.float64, "BF16": torch.bfloat16, "F16": torch.float16,
              "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8}
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        t = torch.frombuffer(bytearray(data[begin:end]), dtype=dtypes[entry["dtype"]])
        tensors[name] = t.reshape(entry["shape"]).clone()
    return tensors


def layer(text):
    """A torch.nn module from its repr: Linear(in_features=784, out_features=32, bias=true)."""
    m = re.fullmatch(r"(\w+)\((.*)\)", text.strip())
    if not m:
        raise SystemExit(f"cannot read layer {text!r}")
    kind, args = m.group(1), m.group(2)
    kw = {}
    for part in filter(None, (a.strip() for a in re.split(r",\s*(?![^\[]*\])", args))):
        key, value = part.split("=", 1)
        value = value.strip().lower()
        if value in ("true", "false"):
            kw[key] = value == "true"
        elif value.startswith("["):
            kw[key] = [int(v) for v in value.strip("[]").split(",")]
        else:
            kw[key] = float(value) if "." in value or "e" in value else int(value)
    if kind == "Linear":
        return torch.nn.Linear(kw["in_features"], kw["out_features"], bias=kw.get("bias", True))
    if kind == "Flatten":
        return torch.nn.Flatten(kw.get("start_dim", 1), kw.get("end_dim", -1))
    if kind in ("ReLU", "GELU", "Tanh"):
        return getattr(torch.nn, kind)()
    if kind == "Dropout":
        return torch.nn.Dropout(kw.get("p", 0.0))
    if kind == "Conv2d":
        k = kw["kernel_size"]
        return torch.nn.Conv2d(kw["in_channels"], kw["out_channels"], k if isinstance(k, int) else tuple(k),
                               stride=tuple(kw.get("stride", [1, 1])), padding=tuple(kw.get("padding", [0, 0])),
                               bias=kw.get("bias", True))
    if kind == "MaxPool2d":
        k = kw["kernel_size"]
        return torch.nn.MaxPool2d(k if isinstance(k, int) else tuple(k))
    raise SystemExit(f"this reader does not know layer {kind}")


def read_idx_gz(path):
    with gzip.open(path, "rb") as f:
        raw = f.read()
    ndim = raw[3]
    dims = struct.unpack(">" + "I" * ndim, raw[4:4 + 4 * ndim])
    return torch.frombuffer(bytearray(raw[4 + 4 * ndim:]), dtype=torch.uint8).reshape(dims)


def main():
    weights, config_path, data_dir = sys.argv[1:4]
    samples = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    config = json.load(open(config_path))
    model = torch.nn.Sequential(*[layer(entry["layer"]) for entry in config["layers"]])
    model.load_state_dict(read_safetensors(weights))
    model.eval()
    pre = config["input"]["preprocessing"]
    assert pre["kind"] == "image", pre
    pixels = read_idx_gz(f"{data_dir}/t10k-images-idx3-ubyte.gz")
    labels = read_idx_gz(f"{data_dir}/t10k-labels-idx1-ubyte.gz").long()
    if samples:
        pixels, labels = pixels[:samples], labels[:samples]
    x = ((pixels.float() * pre["scale"] - pre["mean"]) / pre["std"]).reshape([-1] + config["input"]["shape"])
    with torch.no_grad():
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.double(), labels, reduction="mean").item()
        accuracy = (logits.argmax(1) == labels).double().mean().item()
    print(json.dumps({"test_loss": loss, "accuracy": accuracy, "samples": int(labels.numel())}))


if __name__ == "__main__":
    main()
