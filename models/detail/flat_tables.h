// Immutable open-addressing hash tables for the BPE model's hot lookups: the vocabulary
// (piece -> id) and the merges ((left id, right id) -> rank and merged id). One probe array
// (linear probing, load <= 1/2) and, for pieces, one byte arena: no allocation per entry, and
// a lookup touches a slot and the piece's bytes where std::unordered_map chases a bucket, a
// node and often a heap string.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

namespace treeserve::detail {

inline uint64_t mix64(uint64_t x) {  // MurmurHash3's finalizer
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return x;
}

inline uint64_t hash_bytes(std::string_view s) {
  uint64_t h = 0x9E3779B97F4A7C15ULL * (s.size() + 1);
  size_t i = 0;
  for (; i + 8 <= s.size(); i += 8) {
    uint64_t v;
    std::memcpy(&v, s.data() + i, 8);
    h = mix64(h ^ v);
  }
  uint64_t v = 0;
  std::memcpy(&v, s.data() + i, s.size() - i);
  return mix64(h ^ v);
}

inline size_t table_capacity(size_t entries) {
  size_t capacity = 16;
  while (capacity < 2 * entries) capacity *= 2;
  return capacity;
}

class PieceTable {
 public:
  void reserve(size_t entries) { slots_.assign(table_capacity(entries), Slot{}); }

  // The first insert of a piece wins. reserve() must have made room for every entry.
  void insert(std::string_view piece, int32_t id) {
    const uint64_t h = hash_bytes(piece);
    for (size_t i = h & (slots_.size() - 1);; i = (i + 1) & (slots_.size() - 1)) {
      Slot& s = slots_[i];
      if (s.id < 0) {
        s = Slot{uint32_t(h >> 32), uint32_t(arena_.size()), uint32_t(piece.size()), id};
        arena_.append(piece);
        return;
      }
      if (matches(s, uint32_t(h >> 32), piece)) return;
    }
  }

  int32_t find(std::string_view piece) const {
    if (slots_.empty()) return -1;
    const uint64_t h = hash_bytes(piece);
    for (size_t i = h & (slots_.size() - 1);; i = (i + 1) & (slots_.size() - 1)) {
      const Slot& s = slots_[i];
      if (s.id < 0) return -1;
      if (matches(s, uint32_t(h >> 32), piece)) return s.id;
    }
  }

 private:
  struct Slot {
    uint32_t tag = 0;  // high half of the hash
    uint32_t offset = 0;
    uint32_t length = 0;
    int32_t id = -1;  // -1: empty
  };
  bool matches(const Slot& s, uint32_t tag, std::string_view piece) const {
    return s.tag == tag && s.length == piece.size() &&
           std::memcmp(arena_.data() + s.offset, piece.data(), piece.size()) == 0;
  }

  std::vector<Slot> slots_;
  std::string arena_;
};

// (left, right) id pairs -> (rank, merged id); ids are >= 0.
class PairTable {
 public:
  struct Value {
    uint32_t rank;
    int32_t merged_id;
  };

  void reserve(size_t entries) { slots_.assign(table_capacity(entries), Slot{}); }

  // The first insert of a pair wins (a pair listed twice keeps its lowest rank).
  void insert(int32_t left, int32_t right, Value value) {
    const uint64_t key = pack(left, right);
    for (size_t i = mix64(key) & (slots_.size() - 1);; i = (i + 1) & (slots_.size() - 1)) {
      Slot& s = slots_[i];
      if (s.value.merged_id < 0) {
        s = Slot{key, value};
        return;
      }
      if (s.key == key) return;
    }
  }

  const Value* find(int32_t left, int32_t right) const {
    if (slots_.empty()) return nullptr;
    const uint64_t key = pack(left, right);
    for (size_t i = mix64(key) & (slots_.size() - 1);; i = (i + 1) & (slots_.size() - 1)) {
      const Slot& s = slots_[i];
      if (s.value.merged_id < 0) return nullptr;
      if (s.key == key) return &s.value;
    }
  }

 private:
  struct Slot {
    uint64_t key = 0;
    Value value{0, -1};  // merged_id -1: empty
  };
  static uint64_t pack(int32_t left, int32_t right) {
    return (uint64_t(uint32_t(left)) << 32) | uint32_t(right);
  }

  std::vector<Slot> slots_;
};

}  // namespace treeserve::detail
