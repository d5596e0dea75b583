#!/usr/bin/env python3
"""Golden logits for the tiny test model, from Hugging Face transformers.

Loads the tiny model (built by the CMake target tiny_model into <build>/tiny-llama) with
transformers' LlamaForCausalLM in float32, eager attention, TF32 off, and writes
tests/golden/tiny_llama_golden.json: the reference the CPU and CUDA engines must match
(max abs logit error <= 1e-3, identical greedy tokens).

Token ids come from tests/golden/golden_inputs.json, produced on the build machine by the
repo's own tokenizer (sentencepiece via `--write-inputs`, below), so this script needs no
sentencepiece on the GPU machine; when the `sentencepiece` module is there, the stored ids
are checked against it. The model files' SHA-256 recorded in the inputs must match the
model directory given, so golden data is never made from a different tiny model.

    # on the build machine (no torch needed): write the inputs
    python3 tests/golden/make_golden.py build/tiny-llama --write-inputs
    # on a machine with torch + transformers (CPU or CUDA): write the golden file
    python3 tests/golden/make_golden.py build/tiny-llama [--device cuda] [--out FILE]

What the golden file holds (every logits vector has vocab_size floats, 6 significant
digits; "ids" always include the leading BOS):
  prompts[i]:        name, text, ids, last_logits (logits at the last prompt position)
  all_positions:     prompt (a name), logits[t] for every position t of that prompt
  greedy:            prompt, tokens (32 greedy ids after the prompt), step_logits[k] = the
                     last-position logits of prompt + tokens[:k] (argmax == tokens[k]),
                     top2_margin[k] (top-1 minus top-2 logit: how safe the argmax is)
  tree:              prompt_ids and 8 suffixes; suffix j's sequence is prompt_ids +
                     suffixes[j].ids, run alone; last_logits at its last position and
                     suffix_logits[p] at each suffix position p
Every forward pass runs a whole sequence from scratch (no KV cache), so each number is
what one sequence alone gives.
"""

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_INPUTS = os.path.join(HERE, "golden_inputs.json")
DEFAULT_OUT = os.path.join(HERE, "tiny_llama_golden.json")
DIGITS = 6
GREEDY_STEPS = 32

# Prompts in the style of models/tiny/corpus.txt (plain ASCII, one line each).
PROMPTS = [
    ("garden", "The old oak at the bottom of the garden has watched three generations of "
               "children climb its lower branches."),
    ("dialogue", "\"Give it ten more minutes,\" said Tom, \"and stop opening the door.\""),
    ("arithmetic", "Thirteen times sixteen is two hundred and eight (13 x 16 = 208)."),
    ("short", "The creek flooded the lower meadow,"),
]
ALL_POSITIONS_PROMPT = "short"
GREEDY_PROMPT = "dialogue"

# The tree case: one shared prompt, 8 branches of 1-6 tokens each. Suffix texts start
# without a space: sentencepiece's dummy prefix gives their first piece its "\u2581".
TREE_PROMPT = "[23:28:31] The parser recovered from a crash; the web server"
# Lengths 1-6 tokens with the tiny vocabulary; "and the"/"and Tom" share a first token
# and "ran out" is a prefix of "ran out of", so branches also share sub-prefixes.
TREE_SUFFIXES = ["the", "and the", "and Tom", "ran out", "ran out of", "was hot.", "recovered",
                 "is 13"]
MAX_SUFFIX_TOKENS = 6

MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.model")


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def model_hashes(model_dir):
    return {name: sha256(os.path.join(model_dir, name)) for name in MODEL_FILES}


# --- tokenization (build machine) ----------------------------------------------------

class SpmModule:
    """The sentencepiece Python module, when installed."""

    def __init__(self, model_file):
        import sentencepiece  # noqa: deferred: optional dependency
        self.sp = sentencepiece.SentencePieceProcessor(model_file=model_file)
        self.name = "sentencepiece python module " + getattr(sentencepiece, "__version__", "?")

    def encode(self, text):
        return list(self.sp.encode(text))

    def bos_id(self):
        return self.sp.bos_id()


class SpmCli:
    """Debian's spm_encode CLI (the same library the C++ tokenizer shim links)."""

    def __init__(self, model_file):
        self.exe = shutil.which("spm_encode")
        if self.exe is None:
            raise RuntimeError("neither the sentencepiece module nor spm_encode is available")
        self.model_file = model_file
        self.name = "spm_encode CLI"

    def encode(self, text):
        assert "\n" not in text, "spm_encode reads one text per line"
        out = subprocess.run([self.exe, "--model", self.model_file, "--output_format=id"],
                             input=text + "\n", capture_output=True, text=True, check=True)
        return [int(t) for t in out.stdout.split()]

    def bos_id(self):
        return 1  # checked against config.json's bos_token_id in write_inputs


def make_tokenizer(model_file):
    try:
        return SpmModule(model_file)
    except ImportError:
        return SpmCli(model_file)


def write_inputs(model_dir, path):
    tok = make_tokenizer(os.path.join(model_dir, "tokenizer.model"))
    with open(os.path.join(model_dir, "config.json")) as f:
        bos = json.load(f)["bos_token_id"]
    if tok.bos_id() != bos:
        sys.exit(f"tokenizer BOS {tok.bos_id()} != config.json bos_token_id {bos}")
    prompts = [{"name": name, "text": text, "ids": [bos] + tok.encode(text)}
               for name, text in PROMPTS]
    suffixes = []
    for text in TREE_SUFFIXES:
        ids = tok.encode(text)
        if not 1 <= len(ids) <= MAX_SUFFIX_TOKENS:
            sys.exit(f"tree suffix {text!r} has {len(ids)} tokens; want 1..{MAX_SUFFIX_TOKENS}")
        suffixes.append({"text": text, "ids": ids})
    if len({tuple(s["ids"]) for s in suffixes}) != len(suffixes):
        sys.exit("tree suffixes must differ")
    inputs = {
        "about": "Token ids for make_golden.py, from the repo's tokenizer.model "
                 "(ids include BOS; tree suffix ids do not). Regenerate with "
                 "make_golden.py MODEL_DIR --write-inputs.",
        "tokenized_with": tok.name,
        "model_sha256": model_hashes(model_dir),
        "bos_id": bos,
        "prompts": prompts,
        "all_positions_prompt": ALL_POSITIONS_PROMPT,
        "greedy": {"prompt": GREEDY_PROMPT, "steps": GREEDY_STEPS},
        "tree": {"prompt_text": TREE_PROMPT, "prompt_ids": [bos] + tok.encode(TREE_PROMPT),
                 "suffixes": suffixes},
    }
    with open(path, "w") as f:
        json.dump(inputs, f, indent=1)
        f.write("\n")
    print(f"wrote {path} ({tok.name})")


def check_inputs(inputs, model_dir, allow_other_model):
    hashes = model_hashes(model_dir)
    if hashes != inputs["model_sha256"]:
        msg = (f"{model_dir} is not the model golden_inputs.json was made for:\n"
               f"  inputs: {inputs['model_sha256']}\n  here:   {hashes}")
        if not allow_other_model:
            sys.exit(msg + "\n(rebuild tiny_model, or --write-inputs, or --allow-other-model)")
        print("WARNING: " + msg, file=sys.stderr)
    try:
        tok = SpmModule(os.path.join(model_dir, "tokenizer.model"))
    except ImportError:
        print("sentencepiece module not installed: using the stored token ids unchecked",
              file=sys.stderr)
        return
    # A mismatch is reported, not fatal: the stored ids are what the C++ tokenizer gives
    # (tests/models/golden_inputs_test.cpp checks that), and they are what the engines
    # will be fed, whatever another sentencepiece version makes of the texts.
    bos = inputs["bos_id"]
    pairs = [(p["name"], [bos] + tok.encode(p["text"]), p["ids"]) for p in inputs["prompts"]]
    tree = inputs["tree"]
    pairs.append(("tree prompt", [bos] + tok.encode(tree["prompt_text"]), tree["prompt_ids"]))
    pairs += [(s["text"], tok.encode(s["text"]), s["ids"]) for s in tree["suffixes"]]
    differ = [name for name, mine, stored in pairs if mine != stored]
    if differ:
        print(f"WARNING: {tok.name} tokenizes {differ} differently from the stored ids; "
              "using the stored ids", file=sys.stderr)
    else:
        print(f"stored token ids agree with {tok.name}")


# --- golden data (any forward function) ----------------------------------------------

def rounded(values):
    return [float(f"{v:.{DIGITS}g}") for v in values]


def argmax(values):
    return max(range(len(values)), key=lambda i: values[i])


def top2_margin(values):
    a, b = sorted(values, reverse=True)[:2]
    return a - b


def compute_golden(inputs, forward):
    """forward(ids) -> logits of every position: a list of len(ids) lists of floats."""
    by_name = {p["name"]: p for p in inputs["prompts"]}
    golden = {"prompts": []}
    for p in inputs["prompts"]:
        logits = forward(p["ids"])
        golden["prompts"].append({"name": p["name"], "text": p["text"], "ids": p["ids"],
                                  "last_logits": rounded(logits[-1])})
        if p["name"] == inputs["all_positions_prompt"]:
            golden["all_positions"] = {"prompt": p["name"], "ids": p["ids"],
                                       "logits": [rounded(row) for row in logits]}

    g = inputs["greedy"]
    ids = list(by_name[g["prompt"]]["ids"])
    tokens, step_logits, margins = [], [], []
    for _ in range(g["steps"]):
        last = forward(ids)[-1]
        token = argmax(last)
        tokens.append(token)
        step_logits.append(rounded(last))
        margins.append(round(top2_margin(last), 6))
        ids.append(token)
    golden["greedy"] = {"prompt": g["prompt"], "prompt_ids": by_name[g["prompt"]]["ids"],
                        "tokens": tokens, "step_logits": step_logits, "top2_margin": margins}
    if min(margins) < 1e-2:
        print(f"WARNING: a greedy step's top-2 margin is only {min(margins):.2e}: "
              "engines may legitimately pick the other token", file=sys.stderr)

    t = inputs["tree"]
    tree = {"prompt_text": t["prompt_text"], "prompt_ids": t["prompt_ids"], "suffixes": []}
    for s in t["suffixes"]:
        logits = forward(t["prompt_ids"] + s["ids"])
        n = len(s["ids"])
        tree["suffixes"].append({"text": s["text"], "ids": s["ids"],
                                 "last_logits": rounded(logits[-1]),
                                 "suffix_logits": [rounded(row) for row in logits[-n:]]})
    golden["tree"] = tree
    return golden


# --- transformers (GPU machine) ------------------------------------------------------

def load_transformers_forward(model_dir, device_arg):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    try:
        import torch
        import transformers
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as e:
        sys.exit(f"{e}: computing golden logits needs torch and transformers "
                 "(only --write-inputs runs without them)")

    # Full float32 everywhere: no TF32 in matmuls (on by default for cuDNN, and on
    # Ampere+ a setting away for cuBLAS), deterministic kernels.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    torch.use_deterministic_algorithms(True, warn_only=True)

    if device_arg == "auto":
        device_arg = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device_arg)

    config = LlamaConfig.from_pretrained(model_dir)  # fails loudly if config.json is off
    major_minor = tuple(int(x) for x in transformers.__version__.split(".")[:2])
    dtype_kw = "dtype" if major_minor >= (4, 56) else "torch_dtype"
    loaded = LlamaForCausalLM.from_pretrained(
        model_dir, config=config, attn_implementation="eager", output_loading_info=True,
        local_files_only=True, **{dtype_kw: torch.float32})
    model, info = loaded if isinstance(loaded, tuple) else (loaded, {})
    if not isinstance(info, dict):
        info = getattr(info, "__dict__", {})
    # Every checkpoint tensor used, none initialized at random (rotary buffers aside).
    problems = {k: [n for n in v if "rotary_emb" not in n]
                for k, v in info.items() if k in ("missing_keys", "unexpected_keys",
                                                 "mismatched_keys")}
    if any(problems.values()):
        sys.exit(f"checkpoint does not match LlamaForCausalLM: {problems}")
    model = model.to(device=device, dtype=torch.float32).eval()
    if model.config.vocab_size != len(model.get_output_embeddings().weight):
        sys.exit("vocab_size disagrees with lm_head")

    def forward(ids):
        with torch.no_grad():
            x = torch.tensor([ids], dtype=torch.long, device=device)
            out = model(input_ids=x, use_cache=False)
        return out.logits[0].to(torch.float32).cpu().tolist()

    rope = getattr(model.config, "rope_parameters", None) or getattr(model.config,
                                                                     "rope_scaling", None)
    meta = {
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": "float32",
        "attn_implementation": "eager",
        "tf32": False,
        "rope": json.loads(json.dumps(rope, default=str)),
        "vocab_size": model.config.vocab_size,
    }
    return forward, meta


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir", help="the tiny model dir (config.json, model.safetensors, "
                                      "tokenizer.model), e.g. build/tiny-llama")
    ap.add_argument("--inputs", default=DEFAULT_INPUTS, help="token ids (golden_inputs.json)")
    ap.add_argument("--out", default=DEFAULT_OUT, help="the golden JSON to write")
    ap.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, ...")
    ap.add_argument("--write-inputs", action="store_true",
                    help="tokenize the prompts and write --inputs; needs no torch")
    ap.add_argument("--allow-other-model", action="store_true",
                    help="warn instead of failing when the model files' hashes differ")
    args = ap.parse_args()

    if args.write_inputs:
        write_inputs(args.model_dir, args.inputs)
        return
    with open(args.inputs) as f:
        inputs = json.load(f)
    check_inputs(inputs, args.model_dir, args.allow_other_model)
    forward, meta = load_transformers_forward(args.model_dir, args.device)
    golden = {
        "about": "Golden logits of the tiny test model from Hugging Face transformers; "
                 "written by tests/golden/make_golden.py (its docstring describes every "
                 "field). Logits are rounded to 6 significant digits.",
        "model_sha256": model_hashes(args.model_dir),
        "reference": meta,
    }
    golden.update(compute_golden(inputs, forward))
    with open(args.out, "w") as f:
        json.dump(golden, f, separators=(",", ":"))
        f.write("\n")
    size = os.path.getsize(args.out)
    print(f"wrote {args.out}: {size / 1e6:.2f} MB on {meta['device']} with transformers "
          f"{meta['transformers_version']}, torch {meta['torch_version']}; greedy tokens "
          f"{golden['greedy']['tokens']}")


if __name__ == "__main__":
    main()
