#!/usr/bin/python3
"""Writes an FP8 (e4m3) checkpoint of a 16-bit (or float32) Llama safetensors checkpoint, in
the layouts published FP8 checkpoints use, for treeserve's loader and engines to be tested on:

  --layout fp8                 quantization_config {"quant_method": "fp8", "activation_scheme":
                               "dynamic" | "static", "ignored_layers": ["lm_head"]}, the layout
                               AutoFP8 writes; weight_scale [] (tensor) or [out] (channel).
  --layout compressed-tensors  llm-compressor's FP8 schemes: weights channel with input
                               activations token/dynamic ("FP8_DYNAMIC", weight_scale [out, 1]),
                               or weights tensor with activations tensor/static ("FP8",
                               weight_scale [1]); format float-quantized.

Every q/k/v/o/gate/up/down projection becomes an F8_E4M3 weight with its weight_scale (F32, or
BF16 with --scale-dtype BF16) and, for static activations, an input_scale; embeddings, norms and
lm_head are copied as they are. The quantization rule is treeserve's (models/fp8.h):
scale = amax / 448 (1 for amax 0; the row's amax per channel, the matrix's per tensor), q =
e4m3(x / scale), in float32, round to nearest even, saturating. This file has its own e4m3
conversion: the nearest of the e4m3 values by searching their table (ties to the even
mantissa), with float32 rounding done by array('f'). A float32 quotient computed in double and
rounded once to float32 is the correctly rounded float32 quotient, so these are the bytes the
C++ rule gives. Static input scales are fixed (--input-scale, twice that for k_proj and
up_proj, so that the parts of a fused matrix differ), not calibrated.

Test options that break the result on purpose: --omit SUFFIX drops every tensor whose name ends
with SUFFIX; --keep-16bit SUFFIX leaves the projections whose weight name ends with SUFFIX
16-bit (no scales); --quantization-config JSON replaces config.json's quantization_config.

Standard library only. config.json gets the quantization_config; every other file of the source
directory except its safetensors (tokenizer files, generation_config.json, ...) is copied.
Usage: make_fp8_checkpoint.py SRC_DIR OUT_DIR --layout fp8|compressed-tensors
       [--weights channel|tensor] [--activations dynamic|static] [--scale-dtype F32|BF16]
"""

import argparse
import array
import bisect
import json
import math
import os
import shutil
import struct
import sys

E4M3_MAX = 448.0
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def e4m3_value(code):
    """The OCP E4M3 value of a code in 0x00..0x7e (no sign, no NaN)."""
    e, m = code >> 3, code & 7
    return math.ldexp(m / 8.0, -6) if e == 0 else math.ldexp(1.0 + m / 8.0, e - 7)


E4M3_TABLE = [e4m3_value(c) for c in range(0x7F)]  # increasing


def to_e4m3(x):
    """x (a float32 value) to its e4m3 code: nearest value, ties to the even code."""
    if x != x:
        return 0xFF if math.copysign(1.0, x) < 0 else 0x7F
    sign = 0x80 if math.copysign(1.0, x) < 0 else 0x00
    a = abs(x)
    if a >= E4M3_MAX:
        return sign | 0x7E
    i = bisect.bisect_left(E4M3_TABLE, a)
    if E4M3_TABLE[i] == a:
        return sign | i
    below, above = a - E4M3_TABLE[i - 1], E4M3_TABLE[i] - a
    if below < above or (below == above and (i - 1) % 2 == 0):
        return sign | (i - 1)
    return sign | i


def f32(values):
    """Python floats rounded to float32 (round to nearest even), as a list."""
    return array.array("f", values).tolist()


def bf16_round(x):
    """A float32 value rounded to bfloat16 (nearest even), as a float."""
    (bits,) = struct.unpack("<I", struct.pack("<f", x))
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def scale_of(amax, scale_dtype):
    scale = 1.0 if amax == 0.0 else f32([amax / E4M3_MAX])[0]
    return bf16_round(scale) if scale_dtype == "BF16" else scale


def quantize(values, rows, cols, per_channel, scale_dtype):
    """(codes as bytes, scales): scales one per row, or one for the matrix."""
    codes = bytearray(rows * cols)
    scales = []
    if not per_channel:
        scales.append(scale_of(max(abs(v) for v in values), scale_dtype))
    for r in range(rows):
        row = values[r * cols:(r + 1) * cols]
        if per_channel:
            scales.append(scale_of(max(abs(v) for v in row), scale_dtype))
        s = scales[-1]
        codes[r * cols:(r + 1) * cols] = bytes(to_e4m3(q) for q in f32([v / s for v in row]))
    return bytes(codes), scales


# --- safetensors ------------------------------------------------------------------


def read_safetensors(path):
    """{name: (dtype, shape, raw bytes)}."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        out[name] = (info["dtype"], info["shape"], data[8 + n + begin:8 + n + end])
    return out


def read_checkpoint(model_dir):
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(p for p in os.listdir(model_dir) if p.endswith(".safetensors"))
    tensors = {}
    for name in files:
        tensors.update(read_safetensors(os.path.join(model_dir, name)))
    return tensors


def to_floats(dtype, raw):
    if dtype == "F32":
        a = array.array("f")
        a.frombytes(raw)
        if sys.byteorder != "little":
            a.byteswap()
        return a.tolist()
    if dtype == "F16":
        return list(struct.unpack("<%de" % (len(raw) // 2), raw))
    if dtype == "BF16":
        halves = struct.unpack("<%dH" % (len(raw) // 2), raw)
        return list(struct.unpack("<%df" % len(halves),
                                  struct.pack("<%dI" % len(halves), *(h << 16 for h in halves))))
    raise SystemExit("make_fp8_checkpoint: tensor dtype %s is not a 16-bit or float32 one" % dtype)


def scale_tensor(values, shape, dtype):
    if dtype == "F32":
        return ("F32", shape, struct.pack("<%df" % len(values), *values))
    raw = struct.pack("<%df" % len(values), *values)
    words = struct.unpack("<%dI" % len(values), raw)  # already bf16-exact: keep the top halves
    return ("BF16", shape, struct.pack("<%dH" % len(values), *(w >> 16 for w in words)))


def write_safetensors(path, tensors):
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        dtype, shape, raw = tensors[name]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    header["__metadata__"] = {"format": "pt"}
    header_bytes = json.dumps(header, separators=(",", ":"), sort_keys=True).encode("utf-8")
    header_bytes += b" " * (-len(header_bytes) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header_bytes)))
        f.write(header_bytes)
        for raw in blobs:
            f.write(raw)


# --- the checkpoint -----------------------------------------------------------------


def quantization_config(args):
    if args.layout == "fp8":
        return {"quant_method": "fp8", "activation_scheme": args.activations,
                "ignored_layers": ["lm_head"]}

    def group_args(strategy, dynamic, observer):
        return {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy,
                "dynamic": dynamic, "group_size": None, "block_structure": None,
                "actorder": None, "observer": observer, "observer_kwargs": {}}

    inputs = (group_args("token", True, None) if args.activations == "dynamic"
              else group_args("tensor", False, "minmax"))
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": group_args(args.weights, False, "minmax"),
            "input_activations": inputs,
            "output_activations": None,
        }},
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
    }


def scale_shape(args, rows):
    if args.layout == "fp8":
        return [rows] if args.weights == "channel" else []
    return [rows, 1] if args.weights == "channel" else [1]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("src")
    p.add_argument("out")
    p.add_argument("--layout", choices=["fp8", "compressed-tensors"], required=True)
    p.add_argument("--weights", choices=["channel", "tensor"], default="channel")
    p.add_argument("--activations", choices=["dynamic", "static"], default="dynamic")
    p.add_argument("--scale-dtype", choices=["F32", "BF16"], default="F32")
    p.add_argument("--input-scale", type=float, default=0.0625)
    p.add_argument("--omit", action="append", default=[])
    p.add_argument("--keep-16bit", action="append", default=[])
    p.add_argument("--quantization-config")
    args = p.parse_args()
    if args.layout == "compressed-tensors" and (
            (args.weights, args.activations) not in (("channel", "dynamic"), ("tensor", "static"))):
        raise SystemExit("make_fp8_checkpoint: compressed-tensors layouts are channel+dynamic "
                         "and tensor+static")

    with open(os.path.join(args.src, "config.json")) as f:
        config = json.load(f)
    if config.get("quantization_config"):
        raise SystemExit("make_fp8_checkpoint: %s is already quantized" % args.src)
    tensors = read_checkpoint(args.src)
    out = {}
    for name, (dtype, shape, raw) in tensors.items():
        if not name.endswith(".weight") or not any(name.endswith(pr + ".weight")
                                                   for pr in PROJECTIONS):
            out[name] = (dtype, shape, raw)
            continue
        if any(name.endswith(s) for s in args.keep_16bit):
            out[name] = (dtype, shape, raw)
            continue
        rows, cols = shape
        codes, scales = quantize(to_floats(dtype, raw), rows, cols, args.weights == "channel",
                                 args.scale_dtype)
        base = name[:-len(".weight")]
        out[name] = ("F8_E4M3", shape, codes)
        out[base + ".weight_scale"] = scale_tensor(scales, scale_shape(args, rows),
                                                   args.scale_dtype)
        if args.activations == "static":
            factor = 2.0 if base.endswith(("k_proj", "up_proj")) else 1.0
            out[base + ".input_scale"] = scale_tensor(
                f32([args.input_scale * factor]), [] if args.layout == "fp8" else [1], "F32")
    for suffix in args.omit:
        for name in [n for n in out if n.endswith(suffix)]:
            del out[name]

    os.makedirs(args.out, exist_ok=True)
    for name in os.listdir(args.src):
        src = os.path.join(args.src, name)
        if (os.path.isfile(src) and not name.endswith(".safetensors")
                and name not in ("config.json", "model.safetensors.index.json")):
            shutil.copyfile(src, os.path.join(args.out, name))
    config["quantization_config"] = (json.loads(args.quantization_config)
                                     if args.quantization_config else quantization_config(args))
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    write_safetensors(os.path.join(args.out, "model.safetensors"), out)


if __name__ == "__main__":
    main()
