// Fuzzes the Hugging Face tokenizer.json reader and its BPE (models/tokenizer.h, loading a file
// whose name ends in ".json"): a model directory from the hub is as untrusted as a request.
//
// Input: the tokenizer.json text, then optionally "\n#TEXT#\n" and a text. A file the reader
// refuses must say why. A tokenizer it accepts must encode the text (or a few fixed ones) to ids
// in its vocabulary (INVALID_ARGUMENT only for text that is not UTF-8), decode those ids and any
// others in the vocabulary, and stream them, IncrementalDetokenizer with and without the
// DetokenizerVocab table giving the same deltas. For the ids of text, deltas plus flush() equal
// decode() of the whole list. Not for any ids: a ByteFallback decoder renders a run of byte
// pieces that is not UTF-8 as a whole (U+FFFD for each byte, ASCII ones included), which a
// stream could only match by holding back every run of byte pieces to its end.
#include <cstdint>
#include <fstream>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "models/detokenizer.h"
#include "models/tokenizer.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

using treeserve::fuzz::check;

constexpr size_t kMaxIds = 64;
constexpr int32_t kMaxTableVocab = 4096;

const std::string& work_dir() {
  static const std::string dir = treeserve::fuzz::make_temp_dir("fuzz_tokenizer_json");
  return dir;
}

void check_ids(const treeserve::Tokenizer& tok, const treeserve::DetokenizerVocab* table,
               const std::vector<int32_t>& ids, bool of_text) {
  auto text = tok.decode(ids);
  check(text.ok(), "ids in the vocabulary decode");
  check(tok.decode_with_special(ids).ok(), "ids in the vocabulary decode with specials");
  treeserve::IncrementalDetokenizer slow(tok);
  treeserve::IncrementalDetokenizer fast(tok, table);
  std::string joined;
  for (size_t i = 0; i < ids.size(); ++i) {
    auto a = slow.push(ids[i]);
    auto b = fast.push(ids[i]);
    check(a.ok() && b.ok(), "both streams take an id in the vocabulary");
    if (*a != *b) {
      std::string prefix;
      for (size_t k = 0; k <= i; ++k) prefix += (k ? " " : "") + std::to_string(ids[k]);
      treeserve::fuzz::fail("the table-driven stream disagrees after ids " + prefix + " at ids[" +
                            std::to_string(i) + "] = " + std::to_string(ids[i]) + " ('" +
                            tok.id_to_piece(ids[i]) + "'): '" + *a + "' vs '" + *b + "'");
    }
    joined += *a;
  }
  auto rest = slow.flush();
  auto fast_rest = fast.flush();
  check(rest.ok() && fast_rest.ok() && *rest == *fast_rest, "flush agrees");
  if (of_text && joined + *rest != *text) {
    std::string list;
    for (int32_t id : ids) list += (list.empty() ? "" : " ") + std::to_string(id);
    treeserve::fuzz::fail("deltas + flush != decode of ids " + list + ": '" + joined + *rest +
                          "' vs '" + *text + "'");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  constexpr std::string_view kSep = "\n#TEXT#\n";
  const size_t at = input.find(kSep);
  const std::string_view json = input.substr(0, at);
  const std::string path = work_dir() + "/tokenizer.json";
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(json.data(), std::streamsize(json.size()));
  }
  auto loaded = treeserve::Tokenizer::load(path);
  if (!loaded.ok()) {
    check(!loaded.status().message().empty(), "a refused tokenizer.json says why");
    return 0;
  }
  const treeserve::Tokenizer& tok = **loaded;
  const int32_t vocab = tok.vocab_size();
  check(vocab > 0, "an accepted tokenizer has a vocabulary");
  check(tok.bos_id() >= -1 && tok.bos_id() < vocab, "bos_id in the vocabulary");
  check(tok.eos_id() >= -1 && tok.eos_id() < vocab, "eos_id in the vocabulary");
  // The table costs two decodes per id: built for the small vocabularies fuzzing makes.
  std::unique_ptr<treeserve::DetokenizerVocab> table;
  if (vocab <= kMaxTableVocab) table = std::make_unique<treeserve::DetokenizerVocab>(tok);

  std::vector<std::string> texts = {"hello world", " \n\t<s></s>", "caf\xC3\xA9 \xE6\x97\xA5!"};
  if (at != std::string_view::npos) texts = {std::string(input.substr(at + kSep.size()))};
  for (const std::string& text : texts) {
    auto ids = tok.encode(text);
    if (!ids.ok()) {
      check(ids.status().code() == treeserve::StatusCode::kInvalidArgument &&
                !treeserve::fuzz::is_valid_utf8(text),
            "encode refuses only text that is not UTF-8");
      continue;
    }
    for (int32_t id : *ids) check(id >= 0 && id < vocab, "encoded ids lie in the vocabulary");
    check_ids(tok, table.get(), *ids, /*of_text=*/true);
  }
  // Any ids: the text's bytes, two at a time, folded into the vocabulary.
  std::vector<int32_t> ids;
  for (size_t i = 0; i + 1 < size && ids.size() < kMaxIds; i += 2) {
    ids.push_back(int32_t((uint32_t(data[i]) | uint32_t(data[i + 1]) << 8) % uint32_t(vocab)));
  }
  check_ids(tok, table.get(), ids, /*of_text=*/false);
  for (int32_t id : {-1, vocab}) {
    check(tok.id_to_piece(id).empty(), "no piece outside the vocabulary");
    check(!tok.decode({id}).ok(), "decode refuses an id outside the vocabulary");
  }
  return 0;
}
