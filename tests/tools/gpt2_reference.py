#!/usr/bin/python3
"""GPT-2's forward from a Hugging Face GPT-2 folder alone, written from the published
architecture (Radford et al. 2019; what transformers' GPT2LMHeadModel computes), in float64:

    gpt2_reference.py HF_FOLDER TOKENS.json LOGITS_OUT.json

Token and position tables, pre-LayerNorm blocks of causal attention (Conv1D weights
[in, out]; q, k, v split from c_attn), the MLP with the config's activation, the final
norm, lm_head (or the token table when tied). Checks the tokenizer files too: GPT-2's
bytes_to_unicode, each byte's character's id its value, no merges. Writes the logits
[T][vocab] as JSON. Nothing of tetra's is read but the folder (tests/tools/test_generate.cpp).
"""
import json
import math
import sys

import torch

from export_reader import read_safetensors

def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + list(range(ord("\xae"), ord("\xff") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))

folder, tokens_path, out_path = sys.argv[1:4]
cfg = json.load(open(folder + "/config.json"))
assert cfg["model_type"] == "gpt2", cfg
W = {k: v.double() for k, v in read_safetensors(folder + "/model.safetensors").items()}
vocab = json.load(open(folder + "/vocab.json"))
enc = bytes_to_unicode()
assert len(vocab) == 256 and all(vocab[enc[b]] == b for b in range(256)), "vocab.json"
assert [l for l in open(folder + "/merges.txt").read().splitlines() if not l.startswith("#")] == [], "merges"

def gelu(x):
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))
def gelu_new(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
act = {"gelu": gelu, "gelu_new": gelu_new}[cfg["activation_function"]]
eps = cfg["layer_norm_epsilon"]
def ln(x, p):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * W[p + ".weight"] + W[p + ".bias"]
def conv1d(x, p):
    return x @ W[p + ".weight"] + W[p + ".bias"]

ids = torch.tensor(json.load(open(tokens_path)))
T, d, H = len(ids), cfg["n_embd"], cfg["n_head"]
hd = d // H
assert T <= cfg["n_positions"]
x = W["transformer.wte.weight"][ids] + W["transformer.wpe.weight"][:T]
causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
for i in range(cfg["n_layer"]):
    p = "transformer.h.%d." % i
    q, k, v = conv1d(ln(x, p + "ln_1"), p + "attn.c_attn").split(d, dim=-1)
    q, k, v = [t.reshape(T, H, hd).transpose(0, 1) for t in (q, k, v)]
    att = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
    att = att.masked_fill(~causal, float("-inf")).softmax(-1)
    x = x + conv1d((att @ v).transpose(0, 1).reshape(T, d), p + "attn.c_proj")
    x = x + conv1d(act(conv1d(ln(x, p + "ln_2"), p + "mlp.c_fc")), p + "mlp.c_proj")
x = ln(x, "transformer.ln_f")
head = W["transformer.wte.weight"] if cfg.get("tie_word_embeddings", True) else W["lm_head.weight"]
json.dump((x @ head.t()).tolist(), open(out_path, "w"))
