#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz targets that are not hand-written text:
tests/fuzz/corpus/fuzz_safetensors/ (small checkpoints, one mode byte first, see
fuzz_safetensors.cpp), tests/fuzz/corpus/fuzz_tokenizer/ (texts and id lists, see
fuzz_tokenizer.cpp) and tests/fuzz/corpus/fuzz_tokenizer_json/ (small tokenizer.json files in
the layouts of tests/models/hf_tokenizer_test.cpp, some with a text to encode). The JSON seeds of the config targets and the text sessions of
fuzz_service are hand-written files in their corpus folders. Run from anywhere; rewrites its
outputs."""
import json
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "corpus")


def safetensors(tensors, metadata=True, framed=False):
    """tensors: [(name, dtype, shape, bytes)] -> the file's bytes (framed: header, the
    "\\n#DATA#\\n" separator and data, without the length prefix)."""
    header = {"__metadata__": {"format": "pt"}} if metadata else {}
    data = b""
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape,
                        "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    if framed:
        return text + b"\n#DATA#\n" + data
    return struct.pack("<Q", len(text)) + text + data


def f32(n, start=0.0):
    return struct.pack("<%df" % n, *[start + i for i in range(n)])


def half(n):  # F16 and BF16 patterns: 1, -2, 0.5, 0, inf, nan, a subnormal, ...
    pattern = [0x3C00, 0xC000, 0x3800, 0x0000, 0x7C00, 0x7E00, 0x0001, 0x8000]
    return struct.pack("<%dH" % n, *[pattern[i % len(pattern)] for i in range(n)])


def small_model():
    """The one-layer shape fuzz_safetensors maps to LlamaWeights (tied embeddings)."""
    vocab, hidden, inter, heads, kv, head_dim = 8, 4, 6, 2, 1, 2
    t = [("model.embed_tokens.weight", "F32", [vocab, hidden], f32(vocab * hidden)),
         ("model.norm.weight", "F32", [hidden], f32(hidden, 1.0))]
    p = "model.layers.0."
    t += [(p + "input_layernorm.weight", "F32", [hidden], f32(hidden, 1.0)),
          (p + "post_attention_layernorm.weight", "BF16", [hidden], half(hidden)),
          (p + "self_attn.q_proj.weight", "F16", [heads * head_dim, hidden],
           half(heads * head_dim * hidden)),
          (p + "self_attn.k_proj.weight", "F32", [kv * head_dim, hidden],
           f32(kv * head_dim * hidden)),
          (p + "self_attn.v_proj.weight", "F32", [kv * head_dim, hidden],
           f32(kv * head_dim * hidden)),
          (p + "self_attn.o_proj.weight", "F32", [hidden, heads * head_dim],
           f32(hidden * heads * head_dim)),
          (p + "mlp.gate_proj.weight", "F32", [inter, hidden], f32(inter * hidden)),
          (p + "mlp.up_proj.weight", "F32", [inter, hidden], f32(inter * hidden)),
          (p + "mlp.down_proj.weight", "F32", [hidden, inter], f32(hidden * inter))]
    return t


def write(folder, name, data):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, name), "wb") as f:
        f.write(data)


def safetensors_seeds():
    out = os.path.join(CORPUS, "fuzz_safetensors")
    sep = b"\n#SHARD#\n"
    model = small_model()
    write(out, "single_small_model", b"\x00" + safetensors(model))
    write(out, "single_mixed_dtypes", b"\x00" + safetensors([
        ("a", "F16", [2, 2], half(4)), ("b", "BF16", [3], half(3)),
        ("scalar", "F32", [], f32(1)), ("empty", "F32", [0, 5], b""),
        ("ids", "I64", [2], struct.pack("<2q", 1, 2)), ("odd", "F8_E4M3", [3], b"\x01\x02\x03")],
        metadata=False))
    write(out, "shards_small_model", b"\x01" + safetensors(model[:6]) + sep +
          safetensors(model[6:]))
    index = {"metadata": {"total_size": 0},
             "weight_map": {name: ("s0.safetensors" if i < 6 else "s1.safetensors")
                            for i, (name, _, _, _) in enumerate(model)}}
    write(out, "index_small_model", b"\x02" + json.dumps(index).encode() + sep +
          safetensors(model[:6]) + sep + safetensors(model[6:]))
    # Regression: two dimensions of 2^40 once wrapped the element count to 0 and were accepted.
    overflow = {"w": {"dtype": "F32", "shape": [2**40, 2**40], "data_offsets": [0, 0]}}
    write(out, "regress_numel_overflow", b"\x03" + json.dumps(overflow).encode() + b"\n#DATA#\n")
    # Framed (mode byte 3..5): the harness writes the header length.
    write(out, "framed_single_small_model", b"\x03" + safetensors(model, framed=True))
    write(out, "framed_shards_small_model", b"\x04" + safetensors(model[:6], framed=True) + sep +
          safetensors(model[6:], framed=True))
    write(out, "framed_index_small_model", b"\x05" + json.dumps(index).encode() + sep +
          safetensors(model[:6], framed=True) + sep + safetensors(model[6:], framed=True))


def tokenizer_seeds():
    out = os.path.join(CORPUS, "fuzz_tokenizer")
    texts = {
        "text_sentence": "The old oak at the bottom of the garden has watched three generations.",
        "text_spaces": "  two leading spaces, three   inside\tand\nnew lines\r\n",
        "text_digits": "Thirteen times sixteen is two hundred and eight (13 x 16 = 208).",
        "text_multibyte": "caf\u00e9 na\u00efve \u65e5\u672c\u8a9e \u2014 ok \U0001F600",
        "text_pieces": "<s> </s> <unk> <0x0A> \u2581the",
    }
    for name, text in texts.items():
        write(out, name, b"\x00" + text.encode())
    write(out, "text_invalid_utf8", b"\x00ok \xff\xc3 end \xe6\x97")
    # Id lists (odd mode byte): two little-endian bytes each, mapped to [-8, vocab + 8).
    def ids(values):
        return b"\x01" + b"".join(struct.pack("<H", v + 8) for v in values)
    write(out, "ids_bytes_of_one_char", ids([1, 3 + 0xE6, 3 + 0x97, 3 + 0xA5, 2]))
    write(out, "ids_split_char", ids([100, 3 + 0xE6, 3 + 0x97, 101, 3 + 0xF0, 3 + 0x9F]))
    write(out, "ids_words", ids(list(range(259, 300))))
    write(out, "ids_outside", ids([-1, 5, 512, 7]))


def byte_level(data):
    """GPT-2's byte-to-character map, as tokenizer.json's byte-level vocabularies spell bytes."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + \
        list(range(0xAE, 0x100))
    table, n = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + n)
            n += 1
    return "".join(table[b] for b in data)


def added(i, content, special):
    return {"id": i, "content": content, "single_word": False, "lstrip": False,
            "rstrip": False, "normalized": False, "special": special}


def template_bos(bos, i):
    return {"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}},
                       {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [],
            "special_tokens": {bos: {"id": bos, "ids": [i], "tokens": [bos]}}}


LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                  r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def byte_level_tokenizer():
    """Llama 3's layout, small: bytes 0..255, a few merges, added tokens from 300."""
    vocab = {byte_level(bytes([b])): b for b in range(256)}
    vocab.update({"he": 256, "ll": 257, "hell": 258, "hello": 259, byte_level(b" w"): 260})
    return {"version": "1.0",
            "added_tokens": [added(300, "<|bos|>", True), added(301, "<|eot|>", True),
                             added(302, "<tool>", False)],
            "normalizer": None,
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": LLAMA3_PATTERN},
                 "behavior": "Isolated", "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}]},
            "post_processor": {"type": "Sequence", "processors": [
                {"type": "ByteLevel"}, template_bos("<|bos|>", 300)]},
            "decoder": {"type": "ByteLevel"},
            "model": {"type": "BPE", "ignore_merges": True, "vocab": vocab,
                      "merges": ["h e", "l l", "he ll", "hell o", byte_level(b" ") + " w"]}}


def sentencepiece_style_tokenizer(metaspace):
    """Llama 2's export: <unk> <s> </s>, byte pieces, a few merges (legacy or Metaspace)."""
    sp = "\u2581"
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({"<0x%02X>" % b: 3 + b for b in range(256)})
    pieces = [sp, "h", "e", "l", "o", sp + "h", "ll", sp + "he", sp + "hell", sp + "hello", "w",
              sp + "w"]
    vocab.update({p: 259 + i for i, p in enumerate(pieces)})
    merges = [[sp, "h"], ["l", "l"], [sp + "h", "e"], [sp + "he", "ll"], [sp + "hell", "o"],
              [sp, "w"]]
    t = {"version": "1.0",
         "added_tokens": [added(0, "<unk>", True), added(1, "<s>", True), added(2, "</s>", True)],
         "post_processor": template_bos("<s>", 1),
         "model": {"type": "BPE", "unk_token": "<unk>", "fuse_unk": True, "byte_fallback": True,
                   "vocab": vocab, "merges": merges}}
    if metaspace:
        t["normalizer"] = None
        t["pre_tokenizer"] = {"type": "Metaspace", "replacement": sp, "prepend_scheme": "first",
                              "split": False}
        t["decoder"] = {"type": "Metaspace", "replacement": sp, "prepend_scheme": "first"}
    else:
        t["normalizer"] = {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": sp},
            {"type": "Replace", "pattern": {"String": " "}, "content": sp}]}
        t["pre_tokenizer"] = None
        t["decoder"] = {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": sp}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
    return t


def tokenizer_json_seeds():
    out = os.path.join(CORPUS, "fuzz_tokenizer_json")
    text = "\n#TEXT#\n" + "hello world <|eot|> caf\u00e9 \u65e5 <s> 123"
    for name, t in (("byte_level", byte_level_tokenizer()),
                    ("sentencepiece_legacy", sentencepiece_style_tokenizer(False)),
                    ("sentencepiece_metaspace", sentencepiece_style_tokenizer(True))):
        body = json.dumps(t, ensure_ascii=False)
        write(out, name, body.encode())
        write(out, name + "_text", (body + text).encode())
    nfc = byte_level_tokenizer()
    nfc["normalizer"] = {"type": "NFC"}
    nfc["added_tokens"] = [dict(added(300, "caf\u00e9", False), normalized=True)]
    write(out, "byte_level_nfc_text", (json.dumps(nfc, ensure_ascii=False) +
                                       "\n#TEXT#\ncafe\u0301 e\u0301").encode())


if __name__ == "__main__":
    safetensors_seeds()
    tokenizer_seeds()
    tokenizer_json_seeds()
