"""The GPT-2 export in Hugging Face's transformers (tools/gpu/steps.sh, step hf-gpt2).

Usage: hf_check.py HF_FOLDER PROMPT TETRA_LOGITS.json TETRA_GREEDY_TEXT_FILE TOKENS DEVICE

Loads the folder `ckpt export --format hf` wrote with GPT2LMHeadModel and its tokenizer,
and compares with what tetra computed from the same checkpoint: the prompt's logits at
every position (tetra's `generate --logits`), and the greedy continuation of TOKENS bytes
(tetra's `generate --temperature 0`). Prints one JSON object of figures; exit 0 when the
logits agree within 1e-3 and the texts are equal, 1 when not, 3 when transformers is
missing (the step is skipped, saying so).
"""
import json
import sys

folder, prompt, logits_path, text_path, tokens, device = sys.argv[1:7]
tokens = int(tokens)
try:
    import torch
    import transformers
except ImportError as e:  # a machine without transformers: skipped, not failed
    print(json.dumps({"problems": "no transformers here (%s)" % e}))
    sys.exit(3)

figures = {"transformers": transformers.__version__, "torch": torch.__version__}
problems = []
model = transformers.GPT2LMHeadModel.from_pretrained(folder).to(device).eval()
ids = list(prompt.encode())
with torch.no_grad():
    theirs = model(torch.tensor([ids], device=device)).logits[0].double().cpu()
ours = torch.tensor(json.load(open(logits_path)), dtype=torch.float64)
figures["logit_max_abs_diff"] = float((theirs - ours).abs().max())
if figures["logit_max_abs_diff"] > 1e-3:
    problems.append("logits differ by %.3g (> 1e-3)" % figures["logit_max_abs_diff"])

with torch.no_grad():
    out = model.generate(torch.tensor([ids], device=device), max_new_tokens=tokens, do_sample=False,
                         pad_token_id=0, attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=device))
theirs_text = bytes(out[0, len(ids):].tolist())
ours_text = open(text_path, "rb").read()[len(prompt.encode()):][:tokens]
figures["greedy_equal"] = theirs_text == ours_text
if not figures["greedy_equal"]:
    problems.append("greedy texts differ: transformers %r, tetra %r" % (theirs_text[:40], ours_text[:40]))

try:
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    figures["tokenizer"] = type(tok).__name__
    figures["tokenizer_ids_equal"] = tok.encode(prompt) == ids
    if not figures["tokenizer_ids_equal"]:
        problems.append("the tokenizer gives %r for the prompt, not its bytes" % tok.encode(prompt)[:20])
except Exception as e:  # noqa: BLE001 - reported as a problem with its message
    problems.append("the tokenizer files do not load: %s" % e)
figures["problems"] = "; ".join(problems)
print(json.dumps(figures))
sys.exit(1 if problems else 0)
