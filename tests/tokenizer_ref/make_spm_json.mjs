// Writes tokenizer.json files for a sentencepiece BPE model the way transformers' converter
// (LlamaConverter, SentencePieceExtractor) exports Llama 2 / Mistral tokenizers, from the
// model's tokenizer.vocab ("piece<TAB>score" per line, in id order):
//   OUT_DIR/legacy/tokenizer.json     normalizer Prepend("▁") + Replace(" ", "▁"); decoder
//                                     Replace + ByteFallback + Fuse + Strip (Llama 2's files)
//   OUT_DIR/metaspace/tokenizer.json  Metaspace pre-tokenizer and decoder, prepend "first"
//   OUT_DIR/mistral/tokenizer.json    the Metaspace pre-tokenizer with legacy's decoders
// usage: node make_spm_json.mjs TOKENIZER.vocab OUT_DIR
import fs from "node:fs";
import path from "node:path";

const [vocab_file, out] = process.argv.slice(2);
const rows = fs.readFileSync(vocab_file, "utf8").split("\n").filter((l) => l.length > 0)
  .map((l) => { const tab = l.lastIndexOf("\t"); return [l.slice(0, tab), Number(l.slice(tab + 1))]; });
const vocab = {};
rows.forEach(([piece], id) => { vocab[piece] = id; });
// Every split of every piece into two pieces of the vocabulary is a merge; merges are ranked by
// the merged piece's score, highest first, ties by the ids of the two halves.
let merges = [];
for (const [piece, score] of rows) {
  const chars = Array.from(piece);
  const local = [];
  for (let i = 1; i < chars.length; ++i) {
    const l = chars.slice(0, i).join(""), r = chars.slice(i).join("");
    if (l in vocab && r in vocab) local.push([l, r, score]);
  }
  local.sort((a, b) => vocab[a[0]] - vocab[b[0]] || vocab[a[1]] - vocab[b[1]]);
  merges.push(...local);
}
merges = merges.map((m, i) => [...m, i]).sort((a, b) => b[2] - a[2] || a[3] - b[3])
  .map(([l, r]) => [l, r]);

const sp = "\u2581";
const special = ["<unk>", "<s>", "</s>"].map((content, id) => ({
  id, content, single_word: false, lstrip: false, rstrip: false, normalized: false, special: true,
}));
const base = {
  version: "1.0",
  added_tokens: special,
  post_processor: {
    type: "TemplateProcessing",
    single: [{ SpecialToken: { id: "<s>", type_id: 0 } }, { Sequence: { id: "A", type_id: 0 } }],
    pair: [],
    special_tokens: { "<s>": { id: "<s>", ids: [1], tokens: ["<s>"] } },
  },
  model: { type: "BPE", dropout: null, unk_token: "<unk>", continuing_subword_prefix: null,
           end_of_word_suffix: null, fuse_unk: true, byte_fallback: true, vocab, merges },
};
const legacy = {
  ...base,
  normalizer: { type: "Sequence", normalizers: [
    { type: "Prepend", prepend: sp },
    { type: "Replace", pattern: { String: " " }, content: sp }] },
  pre_tokenizer: null,
  decoder: { type: "Sequence", decoders: [
    { type: "Replace", pattern: { String: sp }, content: " " },
    { type: "ByteFallback" }, { type: "Fuse" },
    { type: "Strip", content: " ", start: 1, stop: 0 }] },
};
const metaspace = {
  ...base,
  normalizer: null,
  pre_tokenizer: { type: "Metaspace", replacement: sp, prepend_scheme: "first", split: false },
  decoder: { type: "Metaspace", replacement: sp, prepend_scheme: "first", split: false },
};
// Mistral v0.3's layout: the Metaspace pre-tokenizer with legacy's decoder chain.
const mistral = { ...metaspace, decoder: legacy.decoder };
for (const [name, tokenizer] of [["legacy", legacy], ["metaspace", metaspace],
                                 ["mistral", mistral]]) {
  fs.mkdirSync(path.join(out, name), { recursive: true });
  fs.writeFileSync(path.join(out, name, "tokenizer.json"), JSON.stringify(tokenizer));
  fs.writeFileSync(path.join(out, name, "tokenizer_config.json"), JSON.stringify({}));
}
console.log(`${out}: ${rows.length} pieces, ${merges.length} merges`);
