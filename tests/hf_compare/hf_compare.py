#!/usr/bin/env python3
"""treeserve's CUDA engine against Hugging Face transformers on a randomly initialised model of
a real shape (default Llama-3-8B, configs/models/llama-3-8b.json), each loaded from the same
saved checkpoint, as users load it.

On a GPU machine with torch + transformers (no internet needed):
  1. builds LlamaForCausalLM from the shape with a fixed seed (transformers' own init) and
     saves it with save_pretrained (safetensors) into --model-dir/fp16, and the same weights
     rounded to bfloat16 into --model-dir/bf16 (16 GB each for 8B);
  2. for each dtype and each prompt length (--lengths, default 16, 2000 and 8000 ids, BOS
     first, seeded): loads the checkpoint with from_pretrained in float32 (the reference) and in
     the checkpoint's dtype (HF's own half-precision run), and computes with each the
     last-position logits, a greedy continuation (--greedy tokens, with the KV cache) and,
     for --branches suffixes of 1, 3, 5, 8, ... ids, the logits after each prompt + suffix run
     alone;
  3. runs treeserve_logits (--tool) on the same checkpoint and ids (--backend cuda, the
     checkpoint's dtype, the prompt prefilled in --chunk-token steps as the scheduler does,
     the suffixes as forked branches of one tree, all run in one step);
  4. writes a JSON report (--out) and prints a table: for each case, treeserve's max and mean
     abs logit error against HF float32 beside HF half's own error against HF float32 (the
     floor), whether treeserve is within it, and the greedy continuations, with the first
     divergence and HF float32's margin there (a divergence below HF half's own error is a
     near-tie, not a bug).

    python3 tests/hf_compare/hf_compare.py --tool build/bin/treeserve_logits \\
        --model-dir /tmp/llama-3-8b-random --out report.json [--layers 2]

--layers N keeps only N layers (a quick run of the whole pipeline); --reuse loads existing
checkpoints from --model-dir instead of creating them.
"""

import argparse
import gc
import inspect
import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
DEFAULT_CONFIG = os.path.join(REPO, "configs", "models", "llama-3-8b.json")
SUFFIX_LENGTHS = [1, 3, 5, 8, 13, 21, 34, 55]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tool", required=True, help="path of the treeserve_logits binary")
    p.add_argument("--model-dir", required=True, help="where the random checkpoints are saved")
    p.add_argument("--out", required=True, help="JSON report")
    p.add_argument("--config", default=DEFAULT_CONFIG, help="model shape (a config.json)")
    p.add_argument("--layers", type=int, default=0, help="keep only N layers (0 = all)")
    p.add_argument("--seed", type=int, default=0, help="weights and prompt seed")
    p.add_argument("--lengths", default="16,2000,8000", help="prompt lengths, comma-separated")
    p.add_argument("--dtypes", default="fp16,bf16", help="checkpoint dtypes: fp16, bf16")
    p.add_argument("--branches", type=int, default=4, help="forked suffixes per prompt")
    p.add_argument("--greedy", type=int, default=16)
    p.add_argument("--chunk", type=int, default=512, help="treeserve prefill step (tokens)")
    p.add_argument("--tensor-parallel", type=int, default=1,
                   help="treeserve on N GPUs (a reduced-layer 70B shape on two, say)")
    p.add_argument("--reuse", action="store_true",
                   help="load the checkpoints in --model-dir instead of creating them")
    p.add_argument("--keep", action="store_true", help="keep --model-dir afterwards")
    p.add_argument("--tool-timeout", type=int, default=1800)
    return p.parse_args()


def err(a, b):
    d = (a.float() - b.float()).abs()
    return {"max_abs": float(d.max()), "mean_abs": float(d.mean())}


def top2_margin(row):
    v, _ = row.float().topk(2)
    return float(v[0] - v[1])


def first_divergence(ours, theirs, step_logits):
    """None when the sequences agree, else where they first differ, with the reference's logit
    margin of its token over ours there (step_logits[k]: the reference's float32 logits at
    step k, whose prefix equals ours up to k)."""
    for k, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            row = step_logits[k]
            return {"index": k, "ours": a, "reference": b,
                    "reference_margin_over_ours": float(row[b] - row[a])}
    return None


def reference_torch(script):
    """torch on the GPU for a reference run, offline, float32 matmuls without TF32:
    (torch, device, the from_pretrained keyword for the dtype)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        import torch
        import transformers
    except ImportError as e:
        sys.exit(f"{e}: {script} needs torch and transformers")
    if not torch.cuda.is_available():
        sys.exit(f"{script} needs a CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    major_minor = tuple(int(x) for x in transformers.__version__.split(".")[:2])
    dtype_kw = "dtype" if major_minor >= (4, 56) else "torch_dtype"
    return torch, torch.device("cuda"), dtype_kw


def model_shape(path, layers):
    """The config.json dict of the shape at `path`, cut to `layers` layers (0: all), without a
    dtype (the checkpoints set theirs)."""
    with open(path) as f:
        shape = json.load(f)
    if layers > 0:
        shape["num_hidden_layers"] = layers
    shape.pop("torch_dtype", None)
    shape.pop("dtype", None)
    return shape


def random_model(torch, shape, seed, device):
    """LlamaForCausalLM of `shape` (a config.json dict), transformers' own initialisation from
    `seed`, built in fp16 on `device`."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(**{k: v for k, v in shape.items() if k != "architectures"},
                         architectures=["LlamaForCausalLM"])
    torch.manual_seed(seed)
    torch.set_default_device(device)
    torch.set_default_dtype(torch.float16)
    try:
        return LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(torch.float32)
        torch.set_default_device("cpu")


def random_prompts(torch, shape, lengths, seed, branches=0):
    """{n: (ids, suffixes)} for each length n: n ids drawn from `seed`, BOS first, and
    `branches` suffixes of SUFFIX_LENGTHS ids."""
    vocab = shape["vocab_size"]
    gen = torch.Generator().manual_seed(seed)
    bos = shape.get("bos_token_id")
    prompts = {}
    for n in lengths:
        ids = torch.randint(0, vocab, (n,), generator=gen).tolist()
        if isinstance(bos, int) and 0 <= bos < vocab:
            ids[0] = bos
        suffixes = [torch.randint(0, vocab, (SUFFIX_LENGTHS[i % len(SUFFIX_LENGTHS)],),
                                  generator=gen).tolist() for i in range(branches)]
        prompts[n] = (ids, suffixes)
    return prompts


def greedy_run(torch, m, ids, greedy, device):
    """The last position's float32 logits (on the CPU), a greedy continuation of `greedy`
    tokens with the KV cache, and each of its steps' logits."""
    # Only the last position's logits (the whole [n, vocab] would be 4 GB at 8000 ids).
    keep = ({"logits_to_keep": 1}
            if "logits_to_keep" in inspect.signature(m.forward).parameters else {})
    out = m(input_ids=torch.tensor([ids], dtype=torch.long, device=device), use_cache=True,
            **keep)
    first = out.logits[0, -1].float().cpu()
    past, steps, tokens = out.past_key_values, [first], []
    for k in range(greedy):
        tok = int(steps[-1].argmax())
        tokens.append(tok)
        if k + 1 == greedy:
            break
        out = m(input_ids=torch.tensor([[tok]], device=device), past_key_values=past,
                use_cache=True)
        past = out.past_key_values
        steps.append(out.logits[0, -1].float().cpu())
    del out, past
    return {"first": first, "steps": steps, "tokens": tokens}


def main():
    args = parse_args()
    if not os.access(args.tool, os.X_OK):
        sys.exit(f"--tool {args.tool} is not an executable (build the treeserve_logits target)")
    torch, device, dtype_kw = reference_torch("hf_compare.py")
    import transformers
    from transformers import LlamaForCausalLM
    half_of = {"fp16": torch.float16, "bf16": torch.bfloat16}
    dtypes = [d for d in args.dtypes.split(",") if d]
    for d in dtypes:
        if d not in half_of:
            sys.exit(f"--dtypes: unknown dtype '{d}' (fp16, bf16)")
    lengths = [int(x) for x in args.lengths.split(",") if x]
    shape = model_shape(args.config, args.layers)
    timings = {}

    # 1. The checkpoints.
    dirs = {d: os.path.join(args.model_dir, d) for d in dtypes}
    if not (args.reuse and all(os.path.exists(os.path.join(p, "config.json"))
                               for p in dirs.values())):
        t = time.time()
        model = random_model(torch, shape, args.seed, device)
        for d in dtypes:
            model = model.to(dtype=half_of[d])
            if os.path.exists(dirs[d]):
                shutil.rmtree(dirs[d])
            model.save_pretrained(dirs[d], safe_serialization=True)
        del model
        gc.collect()
        torch.cuda.empty_cache()
        timings["create_and_save_s"] = time.time() - t
        print(f"checkpoints saved in {timings['create_and_save_s']:.0f} s", flush=True)

    # Prompts and suffixes, seeded; BOS first.
    prompts = random_prompts(torch, shape, lengths, args.seed + 1, args.branches)

    def hf_runs(m, ids, suffixes):
        """greedy_run's logits and tokens, and each prompt + suffix's last-position logits."""
        keep = ({"logits_to_keep": 1}
                if "logits_to_keep" in inspect.signature(m.forward).parameters else {})
        with torch.no_grad():
            run = greedy_run(torch, m, ids, args.greedy, device)
            branch = []
            for s in suffixes:
                y = torch.tensor([ids + s], dtype=torch.long, device=device)
                branch.append(m(input_ids=y, use_cache=False, **keep).logits[0, -1].float().cpu())
        torch.cuda.empty_cache()
        return {**run, "branches": branch}

    out_dir = os.path.dirname(os.path.abspath(args.out))
    report = {
        "about": "treeserve CUDA vs Hugging Face transformers, both loading the same saved "
                 "checkpoint; written by tests/hf_compare/hf_compare.py",
        "shape": {k: shape[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                        "num_attention_heads", "num_key_value_heads",
                                        "vocab_size") if k in shape},
        "seed": args.seed,
        "chunk": args.chunk,
        "reference": {"transformers_version": transformers.__version__,
                      "torch_version": torch.__version__,
                      "device": torch.cuda.get_device_name(device), "tf32": False},
        "cases": [],
    }
    for d in dtypes:
        # 2. HF, float32 then the checkpoint's dtype, each loaded from the checkpoint.
        ref = {}
        for name, dt in (("fp32", torch.float32), ("half", half_of[d])):
            t = time.time()
            m = LlamaForCausalLM.from_pretrained(dirs[d], local_files_only=True,
                                                 **{dtype_kw: dt}).to(device).eval()
            ref[name] = {n: hf_runs(m, *prompts[n]) for n in lengths}
            del m
            gc.collect()
            torch.cuda.empty_cache()
            timings[f"hf_{d}_{name}_s"] = time.time() - t
            print(f"HF {name} ({d} checkpoint): {timings[f'hf_{d}_{name}_s']:.0f} s", flush=True)
        # 3. treeserve on the same checkpoint.
        for n in lengths:
            ids, suffixes = prompts[n]
            ids_file = os.path.join(out_dir, f"hf_compare_ids_{n}.json")
            branches_file = os.path.join(out_dir, f"hf_compare_branches_{n}.json")
            tool_out = os.path.join(out_dir, f"treeserve_logits_{d}_{n}.json")
            json.dump(ids, open(ids_file, "w"))
            json.dump(suffixes, open(branches_file, "w"))
            cmd = [args.tool, "--model", dirs[d], "--backend", "cuda", "--dtype", d,
                   "--ids-file", ids_file, "--greedy", str(args.greedy), "--chunk",
                   str(args.chunk), "--out", tool_out]
            if args.tensor_parallel > 1:
                cmd += ["--tensor-parallel", str(args.tensor_parallel)]
            if suffixes:
                cmd += ["--branches", branches_file]
            t = time.time()
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=args.tool_timeout)
            timings[f"treeserve_{d}_{n}_s"] = time.time() - t
            if run.returncode != 0:
                sys.exit(f"{' '.join(cmd)} failed ({run.returncode}):\n{run.stdout}{run.stderr}")
            ours = json.load(open(tool_out))
            os.remove(tool_out)
            ours_first = torch.tensor(ours["first_logits"])
            r32, rh = ref["fp32"][n], ref["half"][n]
            ts_err = err(ours_first, r32["first"])
            floor = err(rh["first"], r32["first"])
            branches = []
            for b in range(len(suffixes)):
                got = torch.tensor(ours["branch_logits"][b])
                be, bf = err(got, r32["branches"][b]), err(rh["branches"][b], r32["branches"][b])
                branches.append({"suffix_len": len(suffixes[b]), "treeserve_vs_hf_fp32": be,
                                 "hf_half_vs_hf_fp32": bf,
                                 "within": be["max_abs"] <= bf["max_abs"]
                                 and be["mean_abs"] <= bf["mean_abs"]})
            tokens = ours["greedy"]["tokens"]
            div = first_divergence(tokens, r32["tokens"], r32["steps"])
            case = {
                "dtype": d, "prompt_len": n,
                "first_token": {"treeserve_vs_hf_fp32": ts_err, "hf_half_vs_hf_fp32": floor,
                                "within": ts_err["max_abs"] <= floor["max_abs"]
                                and ts_err["mean_abs"] <= floor["mean_abs"],
                                "hf_fp32_logit_std": float(r32["first"].std())},
                "branches": branches,
                "greedy": {"treeserve": tokens, "hf_fp32": r32["tokens"], "hf_half": rh["tokens"],
                           "identical_to_hf_fp32": tokens == r32["tokens"],
                           "hf_half_identical_to_hf_fp32": rh["tokens"] == r32["tokens"],
                           "first_divergence_vs_hf_fp32": div,
                           "near_tie": (div is not None and abs(div["reference_margin_over_ours"])
                                        <= floor["max_abs"]),
                           "device_argmax_agrees": ours["greedy"].get("device_argmax") == tokens},
            }
            report["cases"].append(case)
            print(f"  {d} {n} ids: max|treeserve - HF fp32| = "
                  f"{ts_err['max_abs']:.4f} (HF {d}: {floor['max_abs']:.4f}), mean "
                  f"{ts_err['mean_abs']:.5f} (HF {d}: {floor['mean_abs']:.5f}); greedy "
                  f"{'identical' if tokens == r32['tokens'] else 'differs'}", flush=True)
    report["seconds"] = timings
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
        f.write("\n")
    if not args.keep and not args.reuse:
        shutil.rmtree(args.model_dir, ignore_errors=True)

    # 4. The table.
    print(f"{shape['num_hidden_layers']} layers, {report['reference']['device']}, "
          f"transformers {transformers.__version__}, prefill chunk {args.chunk}")
    print(f"{'dtype':5} {'prompt':>6} {'ts max':>8} {'ts mean':>9} {'HF max':>8} {'HF mean':>9} "
          f"{'within':>6} {'branches within':>15} {'greedy':>22}")
    for c in report["cases"]:
        ft, g = c["first_token"], c["greedy"]
        bw = sum(b["within"] for b in c["branches"])
        greedy = ("identical" if g["identical_to_hf_fp32"] else
                  f"differs at {g['first_divergence_vs_hf_fp32']['index']}"
                  + (" (near-tie)" if g["near_tie"] else ""))
        print(f"{c['dtype']:5} {c['prompt_len']:6d} {ft['treeserve_vs_hf_fp32']['max_abs']:8.4f} "
              f"{ft['treeserve_vs_hf_fp32']['mean_abs']:9.5f} "
              f"{ft['hf_half_vs_hf_fp32']['max_abs']:8.4f} "
              f"{ft['hf_half_vs_hf_fp32']['mean_abs']:9.5f} {str(ft['within']):>6} "
              f"{bw:>7d} of {len(c['branches']):<5d} {greedy:>22}")
        for b in c["branches"]:
            print(f"      suffix {b['suffix_len']:3d}: ts max {b['treeserve_vs_hf_fp32']['max_abs']:.4f}"
                  f" mean {b['treeserve_vs_hf_fp32']['mean_abs']:.5f}; HF half max "
                  f"{b['hf_half_vs_hf_fp32']['max_abs']:.4f} mean "
                  f"{b['hf_half_vs_hf_fp32']['mean_abs']:.5f}")
    print(f"report: {args.out}")


if __name__ == "__main__":
    main()
