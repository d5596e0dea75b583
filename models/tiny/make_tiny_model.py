#!/usr/bin/python3
"""Writes the tiny random Llama test model next to its tokenizer:
config.json and model.safetensors (float32) in OUT_DIR, which must already hold
tokenizer.model (spm_train's output; its piece count is the vocab size).

Standard library only (no numpy, no torch) and bit-for-bit deterministic: weights
come from a splitmix64 PRNG, float32 rounding is done by struct/array, and the
safetensors file is written by hand. Usage: make_tiny_model.py OUT_DIR

Init scales keep the logits well spread (std ~3 over the vocabulary) so that greedy
argmax never hinges on float32 rounding differences between the CPU engine and
Hugging Face transformers.
"""

import array
import json
import math
import os
import struct
import sys

MASK64 = (1 << 64) - 1
SEED = 0x7265657365727665  # "treeserve"-ish, fixed forever: changing it changes the model.

HIDDEN = 256
INTERMEDIATE = 512
LAYERS = 4
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 64
LM_HEAD_GAIN = 3.0  # logits std ~3 (unit-RMS hidden state, fan-in-scaled weights)


class SplitMix64:
    def __init__(self, seed):
        self.state = seed & MASK64

    def next_u64(self):
        self.state = (self.state + 0x9E3779B97F4A7C15) & MASK64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        return z ^ (z >> 31)

    def uniform(self):
        """Uniform in [0, 1) with 53 random bits."""
        return (self.next_u64() >> 11) * (1.0 / (1 << 53))


def uniform_tensor(rng, count, bound):
    return [bound * (2.0 * rng.uniform() - 1.0) for _ in range(count)]


def normal_tensor(rng, count, std):
    """Box-Muller: two normals per pair of uniforms (1 - u keeps log away from 0)."""
    out = []
    while len(out) < count:
        u1, u2 = 1.0 - rng.uniform(), rng.uniform()
        r = math.sqrt(-2.0 * math.log(u1))
        out.append(std * r * math.cos(2.0 * math.pi * u2))
        out.append(std * r * math.sin(2.0 * math.pi * u2))
    return out[:count]


def norm_tensor(rng, count):
    return [1.0 + 0.1 * (2.0 * rng.uniform() - 1.0) for _ in range(count)]


def linear(rng, out_features, in_features, gain=1.0):
    """HF layout [out, in]; uniform +-gain*sqrt(3/fan_in) gives unit output variance."""
    bound = gain * math.sqrt(3.0 / in_features)
    return [out_features, in_features], uniform_tensor(rng, out_features * in_features, bound)


def count_sentencepiece_pieces(model_path):
    """Counts field 1 (repeated SentencePiece pieces) of the serialized ModelProto."""
    data = open(model_path, "rb").read()
    pos, pieces = 0, 0

    def varint():
        nonlocal pos
        shift, value = 0, 0
        while True:
            byte = data[pos]
            pos += 1
            value |= (byte & 0x7F) << shift
            if byte < 0x80:
                return value
            shift += 7

    while pos < len(data):
        key = varint()
        field, wire = key >> 3, key & 7
        if wire == 0:
            varint()
        elif wire == 1:
            pos += 8
        elif wire == 2:
            length = varint()  # not `pos += varint()`: that would add to the stale pos
            pos += length
        elif wire == 5:
            pos += 4
        else:
            raise ValueError(f"{model_path}: unexpected protobuf wire type {wire}")
        if field == 1 and wire == 2:
            pieces += 1
    return pieces


def build_tensors(vocab):
    rng = SplitMix64(SEED)
    tensors = {}
    tensors["model.embed_tokens.weight"] = ([vocab, HIDDEN], normal_tensor(rng, vocab * HIDDEN, 1.0))
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = ([HIDDEN], norm_tensor(rng, HIDDEN))
        tensors[p + "self_attn.q_proj.weight"] = linear(rng, HEADS * HEAD_DIM, HIDDEN)
        tensors[p + "self_attn.k_proj.weight"] = linear(rng, KV_HEADS * HEAD_DIM, HIDDEN)
        tensors[p + "self_attn.v_proj.weight"] = linear(rng, KV_HEADS * HEAD_DIM, HIDDEN)
        tensors[p + "self_attn.o_proj.weight"] = linear(rng, HIDDEN, HEADS * HEAD_DIM)
        tensors[p + "post_attention_layernorm.weight"] = ([HIDDEN], norm_tensor(rng, HIDDEN))
        tensors[p + "mlp.gate_proj.weight"] = linear(rng, INTERMEDIATE, HIDDEN)
        tensors[p + "mlp.up_proj.weight"] = linear(rng, INTERMEDIATE, HIDDEN)
        tensors[p + "mlp.down_proj.weight"] = linear(rng, HIDDEN, INTERMEDIATE)
    tensors["model.norm.weight"] = ([HIDDEN], norm_tensor(rng, HIDDEN))
    tensors["lm_head.weight"] = linear(rng, vocab, HIDDEN, LM_HEAD_GAIN)
    return tensors


def write_safetensors(path, tensors):
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        shape, values = tensors[name]
        blob = array.array("f", values)
        if sys.byteorder != "little":
            blob.byteswap()
        raw = blob.tobytes()
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    header["__metadata__"] = {"format": "pt"}
    header_bytes = json.dumps(header, separators=(",", ":"), sort_keys=True).encode("utf-8")
    header_bytes += b" " * (-len(header_bytes) % 8)  # data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header_bytes)))
        f.write(header_bytes)
        for raw in blobs:
            f.write(raw)


def write_config(path, vocab):
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        },
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
        "initializer_range": 0.02,
    }
    with open(path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: make_tiny_model.py OUT_DIR (holding tokenizer.model)")
    out_dir = sys.argv[1]
    vocab = count_sentencepiece_pieces(os.path.join(out_dir, "tokenizer.model"))
    # Write to temporaries and rename so an interrupted build never leaves a torn file.
    for name, writer, arg in (("config.json", write_config, vocab),
                              ("model.safetensors", write_safetensors, build_tensors(vocab))):
        final = os.path.join(out_dir, name)
        writer(final + ".tmp", arg)
        os.replace(final + ".tmp", final)


if __name__ == "__main__":
    main()
