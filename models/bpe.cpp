// BPE merges over one word: a min-heap of candidate pairs ordered by (rank, position), stale
// entries skipped when popped; the plain quadratic loop beside it is the tests' reference.
#include "models/detail/bpe.h"

#include <algorithm>
#include <cstdio>

#include "models/detail/unicode.h"

namespace treeserve::detail {

StatusOr<std::unique_ptr<BpeModel>> BpeModel::build(
    StringMap<int32_t> vocab, const std::vector<std::pair<std::string, std::string>>& merges,
    const BpeOptions& options) {
  std::unique_ptr<BpeModel> model(new BpeModel);
  model->options_ = options;
  model->vocab_.reserve(vocab.size());
  for (const auto& [piece, id] : vocab) model->vocab_.insert(piece, id);
  model->byte_ids_.fill(-1);
  model->fallback_ids_.fill(-1);
  for (int b = 0; b < 256; ++b) {
    if (options.byte_level) model->byte_ids_[size_t(b)] = model->piece_id(std::string(1, char(b)));
    char name[8];
    std::snprintf(name, sizeof(name), "<0x%02X>", b);
    if (options.byte_fallback) model->fallback_ids_[size_t(b)] = model->piece_id(name);
  }
  model->merges_.reserve(merges.size());
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const auto& [left, right] = merges[rank];
    const int32_t l = model->piece_id(left), r = model->piece_id(right);
    const int32_t m = model->piece_id(left + right);
    if (l < 0 || r < 0 || m < 0) {
      const std::string& missing = l < 0 ? left : r < 0 ? right : left + right;
      return InvalidArgument("merges[" + std::to_string(rank) + "] ('" + left + "', '" + right +
                             "'): piece '" + missing + "' is not in the vocabulary");
    }
    model->merges_.insert(l, r, Merge{uint32_t(rank), m});
  }
  return model;
}

int32_t BpeModel::piece_id(std::string_view piece) const { return vocab_.find(piece); }

const BpeModel::Merge* BpeModel::find_merge(int32_t left, int32_t right) const {
  return merges_.find(left, right);
}

void BpeModel::initial_symbols(std::string_view word, std::vector<Symbol>* symbols) const {
  symbols->clear();
  auto push = [&](int32_t id, uint32_t length) {
    const int32_t index = int32_t(symbols->size());
    symbols->push_back(Symbol{id, index - 1, index + 1, length});
  };
  size_t pos = 0;
  while (pos < word.size()) {
    const size_t begin = pos;
    int32_t id = -1;
    if (options_.byte_level) {
      id = byte_ids_[static_cast<unsigned char>(word[pos])];
      ++pos;
    } else {
      next_char(word, &pos);
      id = piece_id(word.substr(begin, pos - begin));
    }
    const uint32_t length = uint32_t(pos - begin);
    if (id >= 0) {
      push(id, length);
      continue;
    }
    if (options_.byte_fallback) {
      bool all = true;
      for (size_t i = begin; i < pos; ++i) {
        all = all && fallback_ids_[static_cast<unsigned char>(word[i])] >= 0;
      }
      if (all) {
        for (size_t i = begin; i < pos; ++i) {
          push(fallback_ids_[static_cast<unsigned char>(word[i])], 1);
        }
        continue;
      }
    }
    if (options_.unk_id < 0) continue;  // no unk piece: the character is dropped
    if (options_.fuse_unk && !symbols->empty() && symbols->back().id == options_.unk_id) {
      symbols->back().length += length;
      continue;
    }
    push(options_.unk_id, length);
  }
  if (!symbols->empty()) symbols->back().next = -1;
}

void BpeModel::merge_symbols(std::vector<Symbol>* symbols_ptr) const {
  std::vector<Symbol>& s = *symbols_ptr;
  struct Candidate {
    uint32_t rank;
    int32_t pos;
    int32_t merged_id;
    bool operator>(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : pos > o.pos;
    }
  };
  // A min-heap on (rank, pos) kept in a per-thread vector, reused from word to word.
  thread_local std::vector<Candidate> heap;
  heap.clear();
  const auto later = [](const Candidate& a, const Candidate& b) { return a > b; };
  auto consider = [&](int32_t pos) {
    if (pos < 0 || s[size_t(pos)].next < 0) return;
    if (const Merge* m = find_merge(s[size_t(pos)].id, s[size_t(s[size_t(pos)].next)].id)) {
      heap.push_back(Candidate{m->rank, pos, m->merged_id});
      std::push_heap(heap.begin(), heap.end(), later);
    }
  };
  for (int32_t i = 0; i + 1 < int32_t(s.size()); ++i) consider(i);
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), later);
    const Candidate top = heap.back();
    heap.pop_back();
    Symbol& left = s[size_t(top.pos)];
    if (left.length == 0 || left.next < 0) continue;  // merged away, or now last
    Symbol& right = s[size_t(left.next)];
    const Merge* current = find_merge(left.id, right.id);
    if (current == nullptr || current->merged_id != top.merged_id) continue;  // stale
    left.id = top.merged_id;
    left.length += right.length;
    right.length = 0;
    left.next = right.next;
    if (left.next >= 0) s[size_t(left.next)].prev = top.pos;
    consider(left.prev);
    consider(top.pos);
  }
}

bool BpeModel::whole_word(std::string_view word, std::vector<int32_t>* ids) const {
  if (word.empty()) return true;
  if (!options_.ignore_merges) return false;
  const int32_t id = piece_id(word);
  if (id >= 0) ids->push_back(id);
  return id >= 0;
}

void BpeModel::encode_word(std::string_view word, std::vector<int32_t>* ids) const {
  if (whole_word(word, ids)) return;
  const bool cached = cache_enabled_ && word.size() < kMaxCachedWordBytes;
  CacheShard* shard = nullptr;
  if (cached) {
    shard = &cache_[StringHash{}(word) % kCacheShards];
    std::lock_guard<std::mutex> lock(shard->mu);
    auto it = shard->words.find(word);
    if (it != shard->words.end()) {
      ids->insert(ids->end(), it->second.begin(), it->second.end());
      return;
    }
  }
  thread_local std::vector<Symbol> symbols;
  initial_symbols(word, &symbols);
  if (symbols.empty()) return;
  merge_symbols(&symbols);
  const size_t first = ids->size();
  for (int32_t i = 0; i >= 0; i = symbols[size_t(i)].next) ids->push_back(symbols[size_t(i)].id);
  if (cached) {
    std::vector<int32_t> result(ids->begin() + std::ptrdiff_t(first), ids->end());
    std::lock_guard<std::mutex> lock(shard->mu);
    // A full shard starts over rather than tracking recency: hits come from frequent words,
    // which return at once.
    if (shard->words.size() >= kCacheEntriesPerShard) shard->words.clear();
    shard->words.emplace(std::string(word), std::move(result));
  }
}

void BpeModel::encode_word_reference(std::string_view word, std::vector<int32_t>* ids) const {
  if (whole_word(word, ids)) return;
  std::vector<Symbol> symbols;
  initial_symbols(word, &symbols);
  std::vector<int32_t> seq;
  for (const Symbol& s : symbols) seq.push_back(s.id);
  while (seq.size() > 1) {
    size_t best = seq.size();
    const Merge* best_merge = nullptr;
    for (size_t i = 0; i + 1 < seq.size(); ++i) {
      const Merge* m = find_merge(seq[i], seq[i + 1]);
      if (m != nullptr && (best_merge == nullptr || m->rank < best_merge->rank)) {
        best = i;
        best_merge = m;
      }
    }
    if (best_merge == nullptr) break;
    seq[best] = best_merge->merged_id;
    seq.erase(seq.begin() + std::ptrdiff_t(best) + 1);
  }
  ids->insert(ids->end(), seq.begin(), seq.end());
}

}  // namespace treeserve::detail
