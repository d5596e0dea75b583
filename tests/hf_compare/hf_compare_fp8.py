#!/usr/bin/env python3
"""treeserve's FP8 linear layers against Hugging Face transformers running the same
quantization in float32, on a randomly initialised model of a real shape (default
Llama-3-8B).

On a GPU machine with torch + transformers (no internet needed):
  1. builds LlamaForCausalLM from the shape with a fixed seed, saves it as an fp16 checkpoint
     (--model-dir/fp16), quantizes its seven linear matrices per layer with PyTorch (per
     output row: scale = amax / 448, q = (w / scale).clamp(-448, 448).to(float8_e4m3fn)) and
     saves them as an FP8 checkpoint in the "fp8" layout (--model-dir/fp8: weight in
     float8_e4m3fn, weight_scale float32 [out], quantization_config {"quant_method": "fp8",
     "activation_scheme": "dynamic"});
  2. the reference: the fp16 checkpoint loaded in float32 with every quantized linear layer's
     weight replaced by its dequantized e4m3 values and its input quantized per token the same
     way (dynamic per-token activations, as treeserve runs them), and the same in fp16 (HF's
     own half-precision error, the floor);
  3. treeserve_logits (--tool) on the FP8 checkpoint (the loader's FP8 path) and on the fp16
     checkpoint with --quantization fp8 (quantized at load on the GPU): the two must give
     bit-identical logits, which holds only if treeserve's quantizer equals PyTorch's bit for
     bit on every matrix; and within the floor of the reference: per prompt length, the mean
     over --prompts prompts of treeserve's max and mean |error| against HF float32 at most
     HF fp16's;
  4. writes a JSON report (--out) and prints a table.

Rounding activations to e4m3 (3 mantissa bits) is discontinuous: two runs whose inputs differ
in the last bits of fp16 round some elements one e4m3 step apart, and every later layer
carries that on. Deep enough, any two implementations that are not bit-identical end at about
the same distance from each other as from float32. The report gives that third distance
(treeserve against HF fp16) next to the two, and its ratio to the floor: near 1, the
comparison measures that rounding more than the implementation.

    python3 tests/hf_compare/hf_compare_fp8.py --tool build/bin/treeserve_logits \\
        --model-dir /tmp/llama-3-8b-fp8 --out report.json [--layers 2]
"""

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
from hf_compare import (greedy_run, model_shape, random_model, random_prompts,  # noqa: E402
                        reference_torch)
DEFAULT_CONFIG = os.path.join(REPO, "configs", "models", "llama-3-8b.json")
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tool", required=True, help="path of the treeserve_logits binary")
    p.add_argument("--model-dir", required=True, help="where the checkpoints are saved")
    p.add_argument("--out", required=True, help="JSON report")
    p.add_argument("--config", default=DEFAULT_CONFIG, help="model shape (a config.json)")
    p.add_argument("--layers", type=int, default=0, help="keep only N layers (0 = all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lengths", default="16,2000", help="prompt lengths, comma-separated")
    p.add_argument("--prompts", type=int, default=3, help="random prompts per length")
    p.add_argument("--greedy", type=int, default=8)
    p.add_argument("--chunk", type=int, default=512, help="treeserve prefill step (tokens)")
    p.add_argument("--tool-timeout", type=int, default=1800)
    return p.parse_args()


def main():
    args = parse_args()
    if not os.access(args.tool, os.X_OK):
        sys.exit(f"--tool {args.tool} is not an executable (build the treeserve_logits target)")
    torch, device, dtype_kw = reference_torch("hf_compare_fp8.py")
    from safetensors.torch import save_file
    import transformers
    from transformers import LlamaForCausalLM
    fp8 = torch.float8_e4m3fn
    lengths = [int(x) for x in args.lengths.split(",") if x]
    shape = model_shape(args.config, args.layers)
    timings = {}

    def row_scales(x32, dim):
        """amax / 448 per row as an IEEE float32 division (models/fp8.h). A Python-number
        divisor would not do: PyTorch on CUDA multiplies by its reciprocal instead, one bit
        from the quotient in some rows."""
        amax = x32.abs().amax(dim=dim, keepdim=True)
        s = amax / torch.full_like(amax, 448.0)
        return torch.where(s > 0, s, torch.ones_like(s))

    def quantize(w):
        """PyTorch's per-row e4m3 quantization: (q, scale [rows])."""
        w32 = w.float()
        s = row_scales(w32, 1)
        return (w32 / s).clamp(-448.0, 448.0).to(fp8), s.squeeze(1)

    # 1. The fp16 checkpoint and its FP8 twin.
    t = time.time()
    d16, d8 = os.path.join(args.model_dir, "fp16"), os.path.join(args.model_dir, "fp8")
    shutil.rmtree(args.model_dir, ignore_errors=True)
    model = random_model(torch, shape, args.seed, device)
    model.save_pretrained(d16, safe_serialization=True)
    tensors = {}
    quantized = {}
    for name, p in model.state_dict().items():
        module = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and any(module.endswith(l) for l in LINEARS):
            q, s = quantize(p)
            tensors[name] = q.contiguous().cpu()
            tensors[module + ".weight_scale"] = s.contiguous().cpu()
            quantized[module] = (q, s)
        else:
            tensors[name] = p.contiguous().cpu()
    os.makedirs(d8)
    save_file(tensors, os.path.join(d8, "model.safetensors"), metadata={"format": "pt"})
    del tensors
    with open(os.path.join(d16, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    with open(os.path.join(d8, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    for extra in ("generation_config.json",):
        if os.path.exists(os.path.join(d16, extra)):
            shutil.copy(os.path.join(d16, extra), d8)
    deq = {m: (q.float() * s[:, None]).cpu() for m, (q, s) in quantized.items()}
    del model, quantized
    gc.collect()
    torch.cuda.empty_cache()
    timings["create_quantize_save_s"] = time.time() - t
    print(f"checkpoints saved in {timings['create_quantize_save_s']:.0f} s", flush=True)

    # Prompts, seeded; BOS first (the first of each length the same as hf_compare.py's for the
    # same seed). Keyed (length, index).
    prompts = {}
    for j in range(args.prompts):
        for n, (ids, _) in random_prompts(torch, shape, lengths, args.seed + 1 + j).items():
            prompts[(n, j)] = ids

    def fake_quant_input(module, inputs):
        (x,) = inputs
        x32 = x.float()
        s = row_scales(x32, -1)
        return ((x32 / s).clamp(-448.0, 448.0).to(fp8).float() * s).to(x.dtype),

    def reference(dt):
        m = LlamaForCausalLM.from_pretrained(d16, local_files_only=True,
                                             **{dtype_kw: dt}).to(device).eval()
        mods = dict(m.named_modules())
        with torch.no_grad():
            for name, w in deq.items():
                mods[name].weight.copy_(w.to(device=device, dtype=dt))
                mods[name].register_forward_pre_hook(fake_quant_input)
        with torch.no_grad():
            out = {n: greedy_run(torch, m, ids, args.greedy, device) for n, ids in prompts.items()}
        del m
        gc.collect()
        torch.cuda.empty_cache()
        return out

    # 2. The references.
    ref = {}
    for name, dt in (("fp32", torch.float32), ("fp16", torch.float16)):
        t = time.time()
        ref[name] = reference(dt)
        timings[f"hf_{name}_s"] = time.time() - t
        print(f"HF {name} with FP8 layers: {timings[f'hf_{name}_s']:.0f} s", flush=True)

    def err(a, b):
        d = (a.float() - b.float()).abs()
        return {"max_abs": float(d.max()), "mean_abs": float(d.mean())}

    # 3. treeserve, both ways.
    out_dir = os.path.dirname(os.path.abspath(args.out))
    report = {"about": "treeserve FP8 (e4m3 weights per output row, activations per token) vs "
                       "HF transformers with the same quantization; hf_compare_fp8.py",
              "shape": {k: shape[k] for k in ("hidden_size", "intermediate_size",
                                              "num_hidden_layers", "vocab_size")},
              "reference": {"transformers_version": transformers.__version__,
                            "torch_version": torch.__version__,
                            "device": torch.cuda.get_device_name(device)},
              "cases": []}
    ok = True
    per_length = {}
    for (n, j), ids in prompts.items():
        ids_file = os.path.join(out_dir, f"hf_compare_fp8_ids_{n}_{j}.json")
        json.dump(ids, open(ids_file, "w"))
        runs = {}
        for label, extra in (("fp8_checkpoint", ["--model", d8]),
                             ("quantized_at_load", ["--model", d16, "--quantization", "fp8"])):
            tool_out = os.path.join(out_dir, f"treeserve_fp8_{label}_{n}_{j}.json")
            # Without autotuning both runs take the same GEMM for each shape (timing picks may
            # differ between processes and change the last bits).
            cmd = [args.tool, *extra, "--backend", "cuda", "--dtype", "fp16", "--ids-file",
                   ids_file, "--greedy", str(args.greedy), "--chunk", str(args.chunk), "--out",
                   tool_out, "--no-gemm-autotune"]
            t = time.time()
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=args.tool_timeout)
            timings[f"treeserve_{label}_{n}_{j}_s"] = time.time() - t
            if run.returncode != 0:
                sys.exit(f"{' '.join(cmd)} failed ({run.returncode}):\n{run.stdout}{run.stderr}")
            runs[label] = json.load(open(tool_out))
            os.remove(tool_out)
        os.remove(ids_file)
        a = torch.tensor(runs["fp8_checkpoint"]["first_logits"])
        b = torch.tensor(runs["quantized_at_load"]["first_logits"])
        identical = bool(torch.equal(a, b)) and (runs["fp8_checkpoint"]["greedy"]["tokens"] ==
                                                 runs["quantized_at_load"]["greedy"]["tokens"])
        r32, r16 = ref["fp32"][(n, j)], ref["fp16"][(n, j)]
        ts, floor = err(a, r32["first"]), err(r16["first"], r32["first"])
        tokens = runs["fp8_checkpoint"]["greedy"]["tokens"]
        div = next((k for k, (x, y) in enumerate(zip(tokens, r32["tokens"])) if x != y), None)
        margin = None
        if div is not None:
            row = r32["steps"][div]
            margin = float(row[r32["tokens"][div]] - row[tokens[div]])
        case = {"prompt_len": n, "prompt": j, "at_load_identical_to_fp8_checkpoint": identical,
                "at_load_vs_fp8_checkpoint": err(b, a),
                "treeserve_vs_hf_fp32": ts, "hf_fp16_vs_hf_fp32": floor,
                "treeserve_vs_hf_fp16": err(a, r16["first"]),
                "greedy": {"treeserve": tokens, "hf_fp32": r32["tokens"], "hf_fp16": r16["tokens"],
                           "first_divergence": div, "hf_fp32_margin_there": margin,
                           "near_tie": margin is not None and margin <= floor["max_abs"]}}
        report["cases"].append(case)
        per_length.setdefault(n, []).append(case)
        ok = ok and identical and (div is None or case["greedy"]["near_tie"])
        print(f"  {n} ids, prompt {j}: FP8 checkpoint == quantized at load: {identical}; "
              f"max|treeserve - HF fp32| {ts['max_abs']:.4f} (HF fp16 {floor['max_abs']:.4f}), "
              f"mean {ts['mean_abs']:.5f} (HF fp16 {floor['mean_abs']:.5f}), "
              f"treeserve - HF fp16 mean {case['treeserve_vs_hf_fp16']['mean_abs']:.5f}; greedy "
              + ("identical" if div is None else f"differs at {div} (margin {margin:.4f})"),
              flush=True)
    report["lengths"] = []
    for n, cases in per_length.items():
        def avg(key, metric):
            return sum(c[key][metric] for c in cases) / len(cases)
        summary = {"prompt_len": n, "prompts": len(cases)}
        for key in ("treeserve_vs_hf_fp32", "hf_fp16_vs_hf_fp32", "treeserve_vs_hf_fp16"):
            summary[key] = {m: avg(key, m) for m in ("max_abs", "mean_abs")}
        ts, floor = summary["treeserve_vs_hf_fp32"], summary["hf_fp16_vs_hf_fp32"]
        summary["within"] = ts["max_abs"] <= floor["max_abs"] and ts["mean_abs"] <= floor["mean_abs"]
        # How far treeserve and HF fp16 are from each other against how far HF fp16 is from
        # float32: near 1, the two errors are independent draws of the rounding noise.
        summary["apart_over_floor"] = (summary["treeserve_vs_hf_fp16"]["mean_abs"] /
                                       floor["mean_abs"])
        report["lengths"].append(summary)
        ok = ok and summary["within"]
        print(f"{n} ids, mean of {len(cases)} prompts: treeserve max {ts['max_abs']:.4f} "
              f"mean {ts['mean_abs']:.5f}; HF fp16 max {floor['max_abs']:.4f} "
              f"mean {floor['mean_abs']:.5f}; treeserve - HF fp16 mean "
              f"{summary['treeserve_vs_hf_fp16']['mean_abs']:.5f}; "
              f"{summary['apart_over_floor']:.2f} of the floor; "
              f"{'within' if summary['within'] else 'NOT within'}", flush=True)
    report["seconds"] = timings
    report["ok"] = ok
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
        f.write("\n")
    shutil.rmtree(args.model_dir, ignore_errors=True)
    print("hf_compare_fp8:", "passed" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
