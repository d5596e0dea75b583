// Compares treeserve_tokenize's output with the reference's, string by string: identical ids,
// identical decodes (with and without special tokens), decode(encode(s)) == s, the streamed
// text equal to the decode, no delta ending inside a character, and the same BOS. Prints a
// summary and the first mismatches; exits 1 on any.
//   --no-round-trip   skip decode(encode(s)) == s (Metaspace's "first" scheme does not keep a
//                     leading space, in any implementation)
//   --ids-also FILE   a third implementation's output (treeserve_tokenize's format) whose ids
//                     must match too: sentencepiece on the model the tokenizer.json came from
// One difference of the reference is known and counted apart, not as a mismatch: its
// ByteFallback decoder (TextDecoder with ignoreBOM off) drops a U+FEFF that starts a run of
// byte pieces; Hugging Face's Rust decoder (String::from_utf8) keeps it, as treeserve does.
// usage: node compare.mjs STRINGS.jsonl REF.jsonl OURS.jsonl [--no-round-trip] [--ids-also F]
import fs from "node:fs";

const args = process.argv.slice(2);
const [strings_file, ref_file, ours_file] = args;
const round_trip = !args.includes("--no-round-trip");
const also_at = args.indexOf("--ids-also");
const lines = (file) => fs.readFileSync(file, "utf8").split("\n").filter((l) => l.length > 0)
  .map((l) => JSON.parse(l));
const strings = lines(strings_file);
const [ref_head, ...ref] = lines(ref_file);
const [ours_head, ...ours] = lines(ours_file);
const also = also_at >= 0 ? lines(args[also_at + 1]).slice(1) : null;
if (ref.length !== strings.length || ours.length !== strings.length ||
    (also && also.length !== strings.length)) {
  console.error("line counts differ");
  process.exit(1);
}
const failures = { ids: 0, decoded: 0, decoded_skip: 0, round_trip: 0, stream: 0, partial: 0 };
if (also) failures.ids_also = 0;
let bom_quirk = 0;
const shown = [];
const show = (kind, i, detail) => {
  if (shown.length < 20) shown.push(`[${kind}] string ${i} ${JSON.stringify(strings[i])}\n  ${detail}`);
};
const same_text = (kind, i, r, o) => {
  if (r === o) return;
  if (r === o.replaceAll("\ufeff", "") || r.replaceAll("\ufeff", "") === o.replaceAll("\ufeff", "")) {
    ++bom_quirk;
    return;
  }
  ++failures[kind];
  show(kind, i, `reference ${JSON.stringify(r)} treeserve ${JSON.stringify(o)}`);
};
let tokens = 0;
strings.forEach((s, i) => {
  const r = ref[i], o = ours[i];
  tokens += o.ids.length;
  if (JSON.stringify(r.ids) !== JSON.stringify(o.ids)) {
    ++failures.ids;
    show("ids", i, `reference ${JSON.stringify(r.ids)}\n  treeserve ${JSON.stringify(o.ids)}`);
  }
  if (also && JSON.stringify(also[i].ids) !== JSON.stringify(o.ids)) {
    ++failures.ids_also;
    show("ids_also", i, `other ${JSON.stringify(also[i].ids)}\n  treeserve ${JSON.stringify(o.ids)}`);
  }
  same_text("decoded", i, r.decoded, o.decoded);
  same_text("decoded_skip", i, r.decoded_skip, o.decoded_skip);
  if (round_trip && o.decoded !== s) {
    ++failures.round_trip;
    show("round_trip", i, `decode(encode(s)) = ${JSON.stringify(o.decoded)}`);
  }
  if (o.stream !== o.decoded_skip) {
    ++failures.stream;
    show("stream", i, `streamed ${JSON.stringify(o.stream)}`);
  }
  if (o.stream_partial !== 0) {
    ++failures.partial;
    show("partial", i, `${o.stream_partial} deltas ended inside a character`);
  }
});
if (ref_head.bos_id !== ours_head.bos_id) {
  console.error(`BOS differs: reference ${ref_head.bos_id}, treeserve ${ours_head.bos_id}`);
  failures.bos = 1;
}
const total = Object.values(failures).reduce((a, b) => a + b, 0);
console.log(`${strings.length} strings, ${tokens} tokens; mismatches: ` +
            Object.entries(failures).map(([k, v]) => `${k} ${v}`).join(", ") +
            (bom_quirk ? `; reference BOM quirk: ${bom_quirk} decodes` : "") +
            (round_trip ? "" : "; round trip not checked"));
console.log(`reference encode: ${ref_head.encode_ms.toFixed(0)} ms for ${ref_head.tokens} ` +
            `tokens (${(ref_head.tokens / ref_head.encode_ms * 1000 / 1e6).toFixed(2)} M tokens/s)`);
for (const line of shown) console.log(line);
process.exit(total === 0 ? 0 : 1);
