// Fuzzes the tokenizer shim (models/tokenizer.h, the dlopen()ed libtreeserve_spm.so) and the
// streaming detokenizer (models/detokenizer.h) with the tiny model's tokenizer.model.
//
// Input: one mode byte, then the payload. Even mode: the payload is text; it is encoded, every
// id must lie in the vocabulary, valid UTF-8 must decode back to itself exactly (unless it holds
// U+2581, sentencepiece's space), and the ids are streamed (below). Odd mode: the payload is a list
// of ids (two bytes each, a few of them outside the vocabulary), decoded and streamed.
//
// Streaming: IncrementalDetokenizer with and without the DetokenizerVocab table, and the
// stateless decode_new_text, must agree, and their deltas plus flush() must equal decode() of
// the whole list; for the ids of valid text no delta ends inside a UTF-8 sequence. An id
// outside the vocabulary is INVALID_ARGUMENT and is not appended.
//
// This binary links no gRPC, so the sanitized build's way of loading the shim (tokenizer.cpp:
// without RTLD_DEEPBIND, which ASan refuses) is safe here: sentencepiece's own protobuf runtime
// meets no other.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "models/detokenizer.h"
#include "models/tokenizer.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

using treeserve::fuzz::check;

constexpr size_t kStatelessIds = 48;

const treeserve::Tokenizer* tokenizer = nullptr;
const treeserve::DetokenizerVocab* vocab = nullptr;

void stream(const std::vector<int32_t>& ids, bool valid_text) {
  const treeserve::Tokenizer& tok = *tokenizer;
  treeserve::IncrementalDetokenizer slow(tok);
  treeserve::IncrementalDetokenizer fast(tok, vocab);
  std::vector<int32_t> in_vocab;
  std::string joined;
  std::string joined_stateless;
  for (int32_t id : ids) {
    auto a = slow.push(id);
    auto b = fast.push(id);
    if (id < 0 || id >= tok.vocab_size()) {
      check(!a.ok() && a.status().code() == treeserve::StatusCode::kInvalidArgument,
            "an id outside the vocabulary is INVALID_ARGUMENT");
      check(!b.ok() && b.status().code() == treeserve::StatusCode::kInvalidArgument,
            "an id outside the vocabulary is INVALID_ARGUMENT (table-driven)");
      check(slow.ids() == in_vocab && fast.ids() == in_vocab, "a refused id is not appended");
      continue;
    }
    check(a.ok() && b.ok(), "an id in the vocabulary streams");
    check(*a == *b, "the table-driven stream gives the same delta");
    // The stateless form decodes the whole prefix each time: checked on the first ids only.
    const bool stateless_too = in_vocab.size() < kStatelessIds;
    treeserve::StatusOr<std::string> stateless = std::string();
    if (stateless_too) {
      stateless = treeserve::decode_new_text(tok, in_vocab, id);
      check(stateless.ok(), "decode_new_text of ids in the vocabulary");
    }
    in_vocab.push_back(id);
    if (valid_text) {
      check(treeserve::fuzz::is_valid_utf8(*a), "no delta of valid text ends mid-character");
      check(!stateless_too || *a == *stateless, "the stateless form gives the same delta");
    }
    joined += *a;
    joined_stateless += *stateless;
  }
  check(slow.ids() == in_vocab, "the stream holds the ids it accepted");
  auto rest = slow.flush();
  auto fast_rest = fast.flush();
  check(rest.ok() && fast_rest.ok() && *rest == *fast_rest, "flush agrees");
  if (valid_text) check(rest->empty(), "valid text holds nothing back at the end");
  auto full = tok.decode(in_vocab);
  check(full.ok(), "decode of ids in the vocabulary");
  check(joined + *rest == *full, "deltas + flush == decode of the whole list");
  if (valid_text && in_vocab.size() <= kStatelessIds) {
    check(joined_stateless == *full, "stateless deltas == decode for valid text");
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  auto loaded =
      treeserve::Tokenizer::load(std::string(TREESERVE_TINY_MODEL_DIR) + "/tokenizer.model");
  if (!loaded.ok())
    treeserve::fuzz::fail("cannot load the tiny tokenizer: " + loaded.status().ToString());
  tokenizer = loaded->release();
  vocab = new treeserve::DetokenizerVocab(*tokenizer);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const treeserve::Tokenizer& tok = *tokenizer;
  const int32_t n_vocab = tok.vocab_size();
  if (data[0] % 2 == 0) {
    const std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
    auto ids = tok.encode(text);
    check(ids.ok(), "any bytes encode");
    for (int32_t id : *ids) check(id >= 0 && id < n_vocab, "encoded ids lie in the vocabulary");
    const bool valid = treeserve::fuzz::is_valid_utf8(text);
    // sentencepiece writes spaces as U+2581 inside pieces, so a U+2581 in the text decodes as a
    // space (as in every Llama-family tokenizer): text with one round-trips up to that.
    const bool has_space_marker = text.find("\xE2\x96\x81") != std::string::npos;
    if (valid && !has_space_marker) {
      auto back = tok.decode(*ids);
      check(back.ok() && *back == text, "valid UTF-8 round-trips exactly");
    }
    stream(*ids, valid);
    return 0;
  }
  std::vector<int32_t> ids;
  for (size_t i = 1; i + 1 < size; i += 2) {
    const int32_t raw = int32_t(data[i]) | int32_t(data[i + 1]) << 8;
    ids.push_back(raw % (n_vocab + 16) - 8);  // [-8, vocab + 8)
  }
  auto text = tok.decode(ids);
  bool all_in_vocab = true;
  for (int32_t id : ids) all_in_vocab = all_in_vocab && id >= 0 && id < n_vocab;
  check(text.ok() == all_in_vocab, "decode refuses exactly the lists with an id outside");
  if (!text.ok()) {
    check(text.status().code() == treeserve::StatusCode::kInvalidArgument,
          "decode of an id outside the vocabulary is INVALID_ARGUMENT");
  }
  for (int32_t id : ids) (void)tok.id_to_piece(id);
  stream(ids, false);
  return 0;
}
