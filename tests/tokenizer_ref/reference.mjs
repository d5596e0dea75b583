// The reference side: @huggingface/tokenizers (the JavaScript implementation of tokenizer.json
// by Hugging Face) over the same strings, one JSON line each: {ids, decoded, decoded_skip}.
// Decoding leaves clean_up_tokenization_spaces off (it rewrites " ." as "." and so on).
// The first line: {bos_id, encode_ms, tokens}: the BOS encode() adds with special tokens on,
// and the time encode() took over all strings, for the benchmark table.
// usage: node reference.mjs MODEL_DIR STRINGS.jsonl > REF.jsonl
import fs from "node:fs";
import path from "node:path";
import { Tokenizer } from "@huggingface/tokenizers";

const [dir, input] = process.argv.slice(2);
const read = (name) => JSON.parse(fs.readFileSync(path.join(dir, name), "utf8"));
const tokenizer = new Tokenizer(read("tokenizer.json"), read("tokenizer_config.json"));
const strings = fs.readFileSync(input, "utf8").split("\n").filter((l) => l.length > 0)
  .map((l) => JSON.parse(l));

const start = process.hrtime.bigint();
const encoded = strings.map((s) => tokenizer.encode(s, { add_special_tokens: false }).ids);
const encode_ms = Number(process.hrtime.bigint() - start) / 1e6;
const decode = (ids, skip) => ids.length === 0 ? "" : tokenizer.decode(ids, {
  skip_special_tokens: skip, clean_up_tokenization_spaces: false });
// The BOS: what add_special_tokens puts before the text (-1: nothing).
const plain = tokenizer.encode("hello", { add_special_tokens: false }).ids;
const with_bos = tokenizer.encode("hello", { add_special_tokens: true }).ids;
const lines = [JSON.stringify({
  bos_id: with_bos.length === plain.length + 1 ? with_bos[0] : -1,
  encode_ms,
  tokens: encoded.reduce((n, ids) => n + ids.length, 0),
})];
strings.forEach((s, i) => lines.push(JSON.stringify({
  ids: encoded[i], decoded: decode(encoded[i], false), decoded_skip: decode(encoded[i], true),
})));
process.stdout.write(lines.join("\n") + "\n");
