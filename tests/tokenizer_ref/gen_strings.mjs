// Seeded test strings for the tokenizer comparison, one JSON string per line on stdout:
// prose with contractions, whitespace runs (ASCII and Unicode spaces), digits of every kind,
// code, CJK, emoji sequences, other scripts with combining marks, Llama 3's special tokens
// (whole, adjacent and broken), random code points, and random bytes made valid UTF-8.
// usage: node gen_strings.mjs SEED COUNT
const seed = Number(process.argv[2] ?? 45);
const count = Number(process.argv[3] ?? 12000);

// mulberry32: a small seeded generator, the same sequence on every machine.
let state = seed >>> 0;
function random() {
  state = (state + 0x6d2b79f5) >>> 0;
  let t = state;
  t = Math.imul(t ^ (t >>> 15), t | 1);
  t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
  return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
}
const int = (n) => Math.floor(random() * n);
const pick = (list) => list[int(list.length)];
const repeat = (n, f) => Array.from({ length: n }, f).join("");

const words = ("the of and to in is was it for on that with as by at this be from or an are " +
  "have not but had his they you were her which all one can said there use each their time " +
  "tokenizer tree branch decoding server model attention cache page prefix kernel latency " +
  "throughput Hello World LLaMA GPT ChatGPT JavaScript naïve café résumé coöperate façade " +
  "über straße Ångström jalapeño piñata Zürich São Paulo").split(" ");
const contractions = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'T", "'RE", "'Ve",
  "'M", "'LL", "'D", "n't", "'", "''", "’s", "’ll"];
const spaces = [" ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \n", "\n ", "\t\t", "    ",
  "\u00a0", "\u2003", "\u3000", "\u0085", "\u2028", "\u202f", "\u180e", "\u200b", "\ufeff",
  " \u00a0 ", "\r", "\v", "\f"];
const punct = [".", ",", "!", "?", ";", ":", "...", "—", "–", "-", "(", ")", "[", "]", "{", "}",
  "\"", "«", "»", "“", "”", "@", "#", "$", "%", "^", "&", "*", "_", "=", "+", "/", "\\", "|",
  "~", "`", "<", ">", "->", "=>", "::", "!=", "==", "<<", ">>", "¿", "¡", "§", "°", "€", "£",
  "¥", "©", "®", "™", "†", "•", "…", "‰"];
const digits = () => pick([
  () => String(int(10)), () => String(int(1000)), () => String(int(1e9)),
  () => repeat(1 + int(30), () => String(int(10))), () => `${int(100)}.${int(1000)}`,
  () => `${int(1e6).toLocaleString("en-US")}`, () => `0x${int(1e9).toString(16)}`,
  () => `${int(10)}e-${int(20)}`, () => "٠١٢٣٤٥٦٧٨٩".slice(int(5), 5 + int(5)),
  () => "１２３４５", () => "²³¹", () => "½¼¾⅓", () => "ⅠⅡⅢⅫ", () => "०१२३", () => "①②③",
  () => `v${int(10)}.${int(10)}.${int(100)}`, () => `${int(24)}:${int(60)}:${int(60)}`,
])();
const code = [
  "def f(x):\n    return x**2  # square\n",
  "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}\n",
  "const x = await fetch(`/api/v1/${id}`);\nconsole.log(x?.data ?? []);",
  "{\"key\": [1, 2.5, true, null], \"nested\": {\"a\": \"b\"}}",
  "<div class=\"row\"><span>&nbsp;&lt;tag&gt;</span></div>",
  "SELECT name, COUNT(*) FROM users WHERE age >= 18 GROUP BY name;",
  "#include <vector>\ntemplate <typename T> T max(T a, T b) { return a > b ? a : b; }",
  "    if err != nil {\n        return nil, fmt.Errorf(\"failed: %w\", err)\n    }",
  "$ ls -la | grep '^d' && echo \"done\" >> /tmp/log.txt",
  "fn main() -> Result<(), Box<dyn Error>> { println!(\"{:?}\", v); Ok(()) }",
  "x = [i**2 for i in range(10) if i % 2 == 0]\n\n\n",
  "\\begin{equation} E = mc^2 \\end{equation}",
];
const cjk = ["日本語のテキストです。", "東京タワー", "こんにちは、世界！", "カタカナ",
  "中文分词测试，标点符号。", "我爱北京天安门", "한국어 텍스트입니다.", "안녕하세요",
  "漢字とひらがなと카타카나", "（全角括弧）", "「引用」", "𠀋𠂉𡈽"];
const emoji = ["🎉", "👍", "👍🏽", "👨‍👩‍👧‍👦", "🏳️‍🌈", "🇫🇷", "🇯🇵🇺🇸", "1️⃣", "❤️", "😀😃😄",
  "🧑🏿‍💻", "🤖", "✨", "☕", "👩‍🔬", "🫠", "🐈‍⬛"];
const scripts = ["Привет, мир!", "Ελληνικά γράμματα", "مرحبا بالعالم", "שלום עולם",
  "नमस्ते दुनिया", "สวัสดีชาวโลก", "Tiếng Việt có dấu", "ქართული", "Հայերեն", "ᚠᚢᚦᚨᚱ",
  "e\u0301le\u0300ve", "A\u030a", "n\u0303", "Z\u0335\u0321a\u0336lgo", "ﬁ ﬂ ﬀ", "ǅ ǈ",
  "İstanbul ıi", "Straße ß ẞ", "ſ long s", "K Kelvin", "Ω ohm"];
const specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>",
  "<|end_header_id|>", "<|eom_id|>", "<|python_tag|>", "<|finetune_right_pad_id|>",
  "<|reserved_special_token_0|>", "<|reserved_special_token_247|>"];
const broken = ["<|eot_id", "<|", "|>", "<|eot_id |>", "< |eot_id|>", "<|EOT_ID|>",
  "<|reserved_special_token_248|>", "<<|eot_id|>>", "<|begin_of_text|"];

// Code points from blocks that are fully assigned in every Unicode version since 6 (so that
// the three implementations' Unicode tables agree), plus any BMP code point now and then.
const ranges = [[0x20, 0x7e], [0xa0, 0x24f], [0x370, 0x3ff], [0x400, 0x4ff], [0x5d0, 0x5ea],
  [0x620, 0x64a], [0x900, 0x939], [0xe01, 0xe3a], [0x1e00, 0x1eff], [0x2000, 0x206f],
  [0x2100, 0x214f], [0x2190, 0x21ff], [0x2200, 0x22ff], [0x2500, 0x257f], [0x3041, 0x3096],
  [0x30a1, 0x30fa], [0x4e00, 0x9fa5], [0xac00, 0xd7a3], [0xff01, 0xff5e], [0x1f300, 0x1f64f],
  [0x1d400, 0x1d4ff], [0x20000, 0x2a6d6]];
function random_char() {
  if (random() < 0.1) {
    let cp;
    do cp = int(0x10000); while (cp >= 0xd800 && cp <= 0xdfff);
    return String.fromCodePoint(cp);
  }
  const [lo, hi] = pick(ranges);
  return String.fromCodePoint(lo + int(hi - lo + 1));
}
const decoder = new TextDecoder("utf-8");  // invalid bytes -> U+FFFD
const random_bytes = () =>
  decoder.decode(Uint8Array.from({ length: 1 + int(40) }, () => int(256)));

const parts = [
  () => pick(words), () => " " + pick(words), () => pick(words) + pick(contractions),
  () => pick(spaces), () => pick(punct), () => digits(), () => pick(code), () => pick(cjk),
  () => pick(emoji), () => pick(scripts), () => pick(specials), () => pick(broken),
  () => random_char(), () => repeat(1 + int(8), random_char), () => random_bytes(),
  () => pick(words).toUpperCase(), () => repeat(2 + int(60), () => pick([" ", "\n", "\t"])),
];
function make_string(i) {
  switch (i % 10) {
    case 0:  // prose
      return repeat(3 + int(30), () => (int(5) === 0 ? pick(punct) : "") + " " + pick(words) +
        (int(6) === 0 ? pick(contractions) : "")).trimStart();
    case 1:  // whitespace runs around words
      return repeat(2 + int(10), () => pick(spaces) + (int(2) ? pick(words) : ""));
    case 2:  // special tokens among text
      return repeat(1 + int(8), () => (int(3) ? pick(specials) : pick(broken)) +
        (int(2) ? pick(words) : "") + (int(3) === 0 ? pick(spaces) : ""));
    default:  // everything mixed
      return repeat(1 + int(12), () => pick(parts)());
  }
}
const lines = ["", " ", "\n", "a", "  leading and trailing  ", repeat(3000, () => " "),
  repeat(2000, () => "ab "), repeat(500, () => "\n"), repeat(400, () => pick(emoji))];
for (let i = 0; lines.length < count; ++i) lines.push(make_string(i));
process.stdout.write(lines.map((s) => JSON.stringify(s)).join("\n") + "\n");
