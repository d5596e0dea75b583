#!/usr/bin/env python3
"""treeserve's CUDA engine vs Hugging Face transformers on a randomly initialised model of a
real shape (default Llama-3-8B, configs/models/llama-3-8b.json): the engine's accuracy check at
full scale.

On a GPU machine with torch + transformers (no internet needed):
  1. builds LlamaForCausalLM from the shape with a fixed seed, directly on the GPU in fp16
     (transformers' own init: normal(0, initializer_range) matrices, norms of ones), and
     saves it with save_pretrained (safetensors) into --model-dir (16 GB for 8B);
  2. runs a fixed random prompt (--prompt-len ids, BOS first) through it: the first-token
     logits and a --greedy token greedy continuation, in fp16 and, with the same weights cast
     to float32, in float32 (eager attention, TF32 off: the reference);
  3. frees the GPU and runs treeserve_logits (--tool) on the saved directory and the same ids
     with --backend cuda --dtype fp16: the checkpoint goes through treeserve's real loader
     and the engine's real step path;
  4. writes a JSON report (--out): max / mean abs error of treeserve's first-token logits vs
     HF float32 and HF fp16 (and HF fp16 vs HF float32, the noise floor of fp16 itself),
     argmaxes and top-2 margins, the three greedy continuations, whether they are identical,
     and where they diverge, with HF's float32 logit margin there (a divergence at a margin
     below the fp16 noise floor is a near-tie, not a bug).

    python3 tests/hf_compare/hf_compare.py --tool build/bin/treeserve_logits \\
        --model-dir /tmp/llama-3-8b-random --out report.json [--layers 2]

--layers N keeps only N layers (a quick dry run of the whole pipeline); --reuse loads an
existing --model-dir instead of creating it again.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
DEFAULT_CONFIG = os.path.join(REPO, "configs", "models", "llama-3-8b.json")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tool", required=True, help="path of the treeserve_logits binary")
    p.add_argument("--model-dir", required=True, help="where the random checkpoint is saved")
    p.add_argument("--out", required=True, help="JSON report")
    p.add_argument("--config", default=DEFAULT_CONFIG, help="model shape (a config.json)")
    p.add_argument("--layers", type=int, default=0, help="keep only N layers (0 = all)")
    p.add_argument("--seed", type=int, default=0, help="weights and prompt seed")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--greedy", type=int, default=16)
    p.add_argument("--reuse", action="store_true",
                   help="load --model-dir if it holds a checkpoint instead of recreating it")
    p.add_argument("--keep", action="store_true", help="keep --model-dir afterwards")
    p.add_argument("--tool-timeout", type=int, default=1800)
    return p.parse_args()


def top2(row):
    """(argmax, top-1 minus top-2 logit) of a 1-D float tensor."""
    v, i = row.topk(2)
    return int(i[0]), float(v[0] - v[1])


def first_divergence(ours, theirs, step_logits):
    """None when the sequences agree, else where they first differ with the reference's
    logit margin of its token over ours there (step_logits[k]: float32 logits at step k of
    the reference's continuation, whose prefix equals ours up to k)."""
    for k, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            row = step_logits[k] if step_logits is not None else None
            return {
                "index": k,
                "ours": a,
                "reference": b,
                "reference_margin_over_ours": (float(row[b] - row[a]) if row is not None
                                               else None),
            }
    if len(ours) != len(theirs):
        return {"index": min(len(ours), len(theirs)), "ours": None, "reference": None,
                "reference_margin_over_ours": None}
    return None


def main():
    args = parse_args()
    if not os.access(args.tool, os.X_OK):
        sys.exit(f"--tool {args.tool} is not an executable (build the treeserve_logits target)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        import torch
        import transformers
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as e:
        sys.exit(f"{e}: hf_compare.py needs torch and transformers")
    if not torch.cuda.is_available():
        sys.exit("hf_compare.py needs a CUDA device (the model is built and run on the GPU)")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    device = torch.device("cuda")
    major_minor = tuple(int(x) for x in transformers.__version__.split(".")[:2])
    dtype_kw = "dtype" if major_minor >= (4, 56) else "torch_dtype"

    with open(args.config) as f:
        shape = json.load(f)
    if args.layers > 0:
        shape["num_hidden_layers"] = args.layers
    # The dtype is the model's (fp16); save_pretrained writes it into config.json.
    shape.pop("torch_dtype", None)
    shape.pop("dtype", None)
    timings = {}

    # 1. The random checkpoint (or the one already there).
    t = time.time()
    have = os.path.exists(os.path.join(args.model_dir, "config.json"))
    if args.reuse and have:
        model = LlamaForCausalLM.from_pretrained(
            args.model_dir, attn_implementation="eager", local_files_only=True,
            **{dtype_kw: torch.float16}).to(device)
        saved = json.load(open(os.path.join(args.model_dir, "config.json")))
        if saved.get("num_hidden_layers") != shape["num_hidden_layers"]:
            sys.exit(f"--reuse: {args.model_dir} has {saved.get('num_hidden_layers')} layers, "
                     f"not {shape['num_hidden_layers']}")
    else:
        config = LlamaConfig(**{k: v for k, v in shape.items() if k != "architectures"},
                             architectures=["LlamaForCausalLM"], attn_implementation="eager")
        torch.manual_seed(args.seed)
        torch.set_default_device(device)
        torch.set_default_dtype(torch.float16)
        try:
            model = LlamaForCausalLM(config)
        finally:
            torch.set_default_dtype(torch.float32)
            torch.set_default_device("cpu")
        model = model.to(device=device, dtype=torch.float16)
        timings["init_s"] = time.time() - t
        t = time.time()
        if os.path.exists(args.model_dir):
            shutil.rmtree(args.model_dir)
        try:
            model.save_pretrained(args.model_dir, safe_serialization=True)
        except TypeError:  # transformers versions where safetensors is the only format
            model.save_pretrained(args.model_dir)
        timings["save_s"] = time.time() - t
    model.eval()
    vocab = model.config.vocab_size

    # 2. HF: fp16, then the same weights in float32.
    gen = torch.Generator().manual_seed(args.seed + 1)
    prompt = torch.randint(0, vocab, (args.prompt_len,), generator=gen).tolist()
    bos = shape.get("bos_token_id")
    if isinstance(bos, int) and 0 <= bos < vocab:
        prompt[0] = bos

    def hf_run(m):
        """First-token logits (float32, CPU) and a greedy continuation with each step's
        logits, every forward a whole sequence from scratch (no KV cache)."""
        ids = list(prompt)
        steps = []
        with torch.no_grad():
            for _ in range(max(args.greedy, 1)):
                x = torch.tensor([ids], dtype=torch.long, device=device)
                row = m(input_ids=x, use_cache=False).logits[0, -1].float().cpu()
                steps.append(row)
                ids.append(int(row.argmax()))
        return steps[0], ids[len(prompt):len(prompt) + args.greedy], steps

    t = time.time()
    hf16_first, hf16_tokens, hf16_steps = hf_run(model)
    timings["hf_fp16_s"] = time.time() - t
    t = time.time()
    model = model.float()
    hf32_first, hf32_tokens, hf32_steps = hf_run(model)
    timings["hf_fp32_s"] = time.time() - t
    del model
    torch.cuda.empty_cache()

    # 3. treeserve on the saved checkpoint.
    ids_file = os.path.join(os.path.dirname(os.path.abspath(args.out)), "hf_compare_ids.json")
    tool_out = os.path.join(os.path.dirname(os.path.abspath(args.out)), "treeserve_logits.json")
    with open(ids_file, "w") as f:
        json.dump(prompt, f)
    cmd = [args.tool, "--model", args.model_dir, "--backend", "cuda", "--dtype", "fp16",
           "--ids-file", ids_file, "--greedy", str(args.greedy), "--out", tool_out]
    t = time.time()
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=args.tool_timeout)
    timings["treeserve_s"] = time.time() - t
    if run.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({run.returncode}):\n{run.stdout}{run.stderr}")
    with open(tool_out) as f:
        ours = json.load(f)
    ours_first = torch.tensor(ours["first_logits"], dtype=torch.float32)
    ours_tokens = ours["greedy"]["tokens"]

    # 4. The report.
    def err(a, b):
        d = (a - b).abs()
        return {"max_abs": float(d.max()), "mean_abs": float(d.mean())}

    ours_arg, ours_margin = top2(ours_first)
    hf32_arg, hf32_margin = top2(hf32_first)
    hf16_arg, hf16_margin = top2(hf16_first)
    div32 = first_divergence(ours_tokens, hf32_tokens, hf32_steps)
    div16 = first_divergence(ours_tokens, hf16_tokens, hf16_steps)
    device_argmax = ours["greedy"].get("device_argmax")
    report = {
        "about": "treeserve CUDA fp16 vs Hugging Face transformers on a randomly initialised "
                 "model; written by tests/hf_compare/hf_compare.py",
        "shape": {k: shape[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                        "num_attention_heads", "num_key_value_heads",
                                        "vocab_size") if k in shape},
        "config": os.path.relpath(args.config, REPO) if args.config.startswith(REPO)
                  else args.config,
        "seed": args.seed,
        "prompt_ids": prompt,
        "reference": {
            "transformers_version": transformers.__version__,
            "torch_version": torch.__version__,
            "device": torch.cuda.get_device_name(device),
            "attn_implementation": "eager",
            "tf32": False,
        },
        "first_token": {
            "treeserve_vs_hf_fp32": err(ours_first, hf32_first),
            "treeserve_vs_hf_fp16": err(ours_first, hf16_first),
            "hf_fp16_vs_hf_fp32": err(hf16_first, hf32_first),
            "hf_fp32_logit_std": float(hf32_first.std()),
            "argmax": {"treeserve": ours_arg, "hf_fp32": hf32_arg, "hf_fp16": hf16_arg},
            "top2_margin": {"treeserve": ours_margin, "hf_fp32": hf32_margin,
                            "hf_fp16": hf16_margin},
        },
        "greedy": {
            "n": args.greedy,
            "treeserve": ours_tokens,
            "hf_fp32": hf32_tokens,
            "hf_fp16": hf16_tokens,
            "identical_to_hf_fp32": ours_tokens == hf32_tokens,
            "identical_to_hf_fp16": ours_tokens == hf16_tokens,
            "hf_fp16_identical_to_hf_fp32": hf16_tokens == hf32_tokens,
            "first_divergence_vs_hf_fp32": div32,
            "first_divergence_vs_hf_fp16": div16,
            "treeserve_top2_margin": ours["greedy"]["top2_margin"],
            "hf_fp32_top2_margin": [top2(r)[1] for r in hf32_steps[:args.greedy]],
            # The scheduler's greedy fast path (argmax on the device) agrees with the host
            # argmax of the full logits at every step.
            "device_argmax_agrees": (device_argmax == ours_tokens
                                     if device_argmax is not None else None),
        },
        "seconds": {**timings, "treeserve_tool": ours.get("seconds")},
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
        f.write("\n")
    if not args.keep and not args.reuse:
        shutil.rmtree(args.model_dir, ignore_errors=True)

    ft = report["first_token"]
    g = report["greedy"]
    print(f"layers={shape['num_hidden_layers']} prompt={args.prompt_len} ids, "
          f"{torch.cuda.get_device_name(device)}")
    print(f"first-token logits: max|treeserve - HF fp32| = "
          f"{ft['treeserve_vs_hf_fp32']['max_abs']:.4g}, "
          f"max|treeserve - HF fp16| = {ft['treeserve_vs_hf_fp16']['max_abs']:.4g}, "
          f"max|HF fp16 - HF fp32| = {ft['hf_fp16_vs_hf_fp32']['max_abs']:.4g} "
          f"(logit std {ft['hf_fp32_logit_std']:.3g})")
    print(f"greedy {args.greedy}: identical to HF fp32: {g['identical_to_hf_fp32']}, "
          f"to HF fp16: {g['identical_to_hf_fp16']}; device argmax agrees: "
          f"{g['device_argmax_agrees']}")
    if div32:
        print(f"  first divergence vs HF fp32: {div32}")
    print(f"report: {args.out}")


if __name__ == "__main__":
    main()
