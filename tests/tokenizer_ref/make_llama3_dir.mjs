// Writes a Llama-3-style model directory from llama3-tokenizer-js's data (Meta's Llama 3
// vocabulary and merges, as that package ships them; nothing of it is committed here):
//   tokenizer.json         a Hugging Face tokenizer.json laid out as Meta's Llama 3.x files are
//   tokenizer_config.json  BOS <|begin_of_text|>, EOS <|eot_id|> (the Instruct models' choice)
//   generation_config.json eos_token_id [128001, 128008, 128009] (Llama 3.1 Instruct)
//   config.json            a small random-weights shape with Llama 3's vocab_size 128256
// usage: node make_llama3_dir.mjs OUT_DIR
import fs from "node:fs";
import path from "node:path";
import { createRequire } from "node:module";
import llama3Tokenizer from "llama3-tokenizer-js";

const out = process.argv[2];
if (!out) throw new Error("usage: node make_llama3_dir.mjs OUT_DIR");
fs.mkdirSync(out, { recursive: true });

// The pre-tokenizer pattern as the package itself carries it (the pattern Meta's files use).
const require = createRequire(import.meta.url);
const source = fs.readFileSync(
  path.join(path.dirname(require.resolve("llama3-tokenizer-js/package.json")), "src",
            "llama3-tokenizer.js"), "utf8");
const found = source.match(/const DIRTY_LLAMA3_REGEX_STRING = ("(?:[^"\\]|\\.)*")/);
if (!found) throw new Error("llama3-tokenizer-js: DIRTY_LLAMA3_REGEX_STRING not found");
const pattern = JSON.parse(found[1]);

const BASE = 128000;  // ordinary pieces are ids 0..127999, special tokens follow
const pieces = llama3Tokenizer.vocabById;
if (pieces.length !== 128256) throw new Error(`expected 128256 pieces, got ${pieces.length}`);
const vocab = {};
for (let id = 0; id < BASE; ++id) vocab[pieces[id]] = id;
// The package's merges map ("left right" -> priority) iterates in rank order.
const merges = [...llama3Tokenizer.merges.entries()]
  .sort((a, b) => a[1] - b[1])
  .map(([pair]) => pair);
const added_tokens = [];
for (let id = BASE; id < pieces.length; ++id) {
  added_tokens.push({ id, content: pieces[id], single_word: false, lstrip: false,
                      rstrip: false, normalized: false, special: true });
}
const bos = "<|begin_of_text|>";
const tokenizer = {
  version: "1.0",
  truncation: null,
  padding: null,
  added_tokens,
  normalizer: null,
  pre_tokenizer: {
    type: "Sequence",
    pretokenizers: [
      { type: "Split", pattern: { Regex: pattern }, behavior: "Isolated", invert: false },
      { type: "ByteLevel", add_prefix_space: false, trim_offsets: true, use_regex: false },
    ],
  },
  post_processor: {
    type: "Sequence",
    processors: [
      { type: "ByteLevel", add_prefix_space: true, trim_offsets: false, use_regex: true },
      {
        type: "TemplateProcessing",
        single: [{ SpecialToken: { id: bos, type_id: 0 } }, { Sequence: { id: "A", type_id: 0 } }],
        pair: [
          { SpecialToken: { id: bos, type_id: 0 } }, { Sequence: { id: "A", type_id: 0 } },
          { SpecialToken: { id: bos, type_id: 1 } }, { Sequence: { id: "B", type_id: 1 } },
        ],
        special_tokens: { [bos]: { id: bos, ids: [BASE], tokens: [bos] } },
      },
    ],
  },
  decoder: { type: "ByteLevel", add_prefix_space: true, trim_offsets: true, use_regex: true },
  model: {
    type: "BPE", dropout: null, unk_token: null, continuing_subword_prefix: null,
    end_of_word_suffix: null, fuse_unk: false, byte_fallback: false, ignore_merges: true,
    vocab, merges,
  },
};
const write = (name, value) =>
  fs.writeFileSync(path.join(out, name), JSON.stringify(value, null, name === "tokenizer.json" ? 0 : 2));
write("tokenizer.json", tokenizer);
write("tokenizer_config.json", {
  bos_token: bos,
  eos_token: "<|eot_id|>",
  clean_up_tokenization_spaces: true,
  model_input_names: ["input_ids", "attention_mask"],
  model_max_length: 131072,
  tokenizer_class: "PreTrainedTokenizerFast",
});
write("generation_config.json", {
  bos_token_id: BASE, do_sample: true, eos_token_id: [128001, 128008, 128009],
  temperature: 0.6, top_p: 0.9,
});
write("config.json", {
  architectures: ["LlamaForCausalLM"], model_type: "llama", vocab_size: 128256,
  hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2, num_attention_heads: 4,
  num_key_value_heads: 2, head_dim: 16, max_position_embeddings: 4096, rms_norm_eps: 1e-5,
  rope_theta: 500000.0,
  rope_scaling: { rope_type: "llama3", factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0,
                  original_max_position_embeddings: 8192 },
  bos_token_id: BASE, eos_token_id: [128001, 128008, 128009], tie_word_embeddings: false,
  torch_dtype: "bfloat16",
});
console.log(`${out}: ${Object.keys(vocab).length} pieces, ${merges.length} merges, ` +
            `${added_tokens.length} special tokens`);
