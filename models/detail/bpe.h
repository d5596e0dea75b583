// The BPE model of a tokenizer.json: one pre-token ("word") in, token ids out, merging the
// pair of adjacent symbols with the lowest merge rank first (the leftmost among equal
// ranks), as Hugging Face tokenizers' BPE model does. Results are cached per word.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common/status.h"
#include "models/detail/flat_tables.h"

namespace treeserve::detail {

// Hash and equality that let an unordered_map<std::string, ...> be searched with a
// string_view (no temporary string per lookup).
struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
template <typename V>
using StringMap = std::unordered_map<std::string, V, StringHash, std::equal_to<>>;

struct BpeOptions {
  // Words are raw bytes and the vocabulary's pieces were translated from the byte-level
  // alphabet to the bytes they stand for: the first symbols are single bytes.
  bool byte_level = false;
  // A word that is itself in the vocabulary is one token, whatever the merges would make of
  // it (Llama 3's tokenizer.json sets this, after tiktoken).
  bool ignore_merges = false;
  // A character missing from the vocabulary becomes its UTF-8 bytes as <0xXX> pieces.
  bool byte_fallback = false;
  int32_t unk_id = -1;    // what a character that is still unknown becomes (-1: dropped)
  bool fuse_unk = false;  // consecutive unknown characters become one unk
};

class BpeModel {
 public:
  // vocab: piece -> id (pieces already in the model's alphabet, see BpeOptions::byte_level);
  // merges: pairs of pieces in rank order. INVALID_ARGUMENT naming the merge when a piece of
  // it, or the piece it makes, is not in the vocabulary.
  static StatusOr<std::unique_ptr<BpeModel>> build(
      StringMap<int32_t> vocab, const std::vector<std::pair<std::string, std::string>>& merges,
      const BpeOptions& options);

  // Appends the ids of one word (not empty). Thread-safe.
  void encode_word(std::string_view word, std::vector<int32_t>* ids) const;
  // The same result by the plain quadratic algorithm (repeatedly merge the lowest-ranked
  // pair), without the cache: the reference the tests compare encode_word against.
  void encode_word_reference(std::string_view word, std::vector<int32_t>* ids) const;

  int32_t piece_id(std::string_view piece) const;  // -1 when not in the vocabulary
  // Turns the per-word cache off (benchmarks measure both); on by default.
  void set_cache_enabled(bool enabled) { cache_enabled_ = enabled; }

 private:
  struct Symbol {
    int32_t id;
    int32_t prev;
    int32_t next;
    uint32_t length;  // bytes of the word it covers; 0 once merged into its left neighbour
  };
  using Merge = PairTable::Value;
  // Words shorter than this many bytes are cached (Hugging Face's limit).
  static constexpr size_t kMaxCachedWordBytes = 256;
  static constexpr size_t kCacheShards = 16;
  static constexpr size_t kCacheEntriesPerShard = 4096;
  struct CacheShard {
    std::mutex mu;
    StringMap<std::vector<int32_t>> words;
  };

  BpeModel() = default;
  // An empty word, or with ignore_merges a word that is one piece (its id appended).
  bool whole_word(std::string_view word, std::vector<int32_t>* ids) const;
  const Merge* find_merge(int32_t left, int32_t right) const;
  void initial_symbols(std::string_view word, std::vector<Symbol>* symbols) const;
  void merge_symbols(std::vector<Symbol>* symbols) const;

  BpeOptions options_;
  PieceTable vocab_;
  PairTable merges_;
  std::array<int32_t, 256> byte_ids_{};      // a single byte's id (byte-level) or -1
  std::array<int32_t, 256> fallback_ids_{};  // <0xXX> ids (byte_fallback) or -1
  bool cache_enabled_ = true;
  mutable std::array<CacheShard, kCacheShards> cache_;
};

}  // namespace treeserve::detail
