// build_attention_plan: AttentionView -> AttentionPlan (work items, masks, reduction map).
//
// Four passes, all linear in nodes + queries (+ mask bits for packed items):
//  1. Units. Walk the run tree breadth-first. A child subtree small enough for one item
//     (<= pack_max_tokens live tokens, <= one query tile of queries) becomes part of a *pack*
//     of consecutive small siblings, read by one masked item (DeFT-Flatten: subtrees flattened
//     depth-first into one chunk, causality by bit mask). Any other child is a *run unit*.
//  2. Greedy edge assignment (FastTree Algorithm 1), parents before children: for each
//     child unit l of run unit v, compare the cost of keeping v's KV in v's own group
//     (SplitKV: padding of both groups + gamma * l's extra partials) with folding v into l
//     (SplitQ: l's queries read v's KV again inside l's items). Folding grows l's context.
//  3. Chunk size. Each group's context is cut into even chunks of <= kv_chunk_tokens; if that
//     gives fewer items than num_sms * min_items_per_sm, the chunk is shrunk (down to
//     min_split_tokens) until it does (FastTree long-context splitting), then grown again
//     where that saves a partly filled wave of items (num_sms items a wave). With
//     max_chunk_tokens, a plan with items enough may grow its chunks 4x or 2x instead.
//  4. Items. Per group, per chunk: the group's queries that see at least one chunk token,
//     cut into query tiles. A mask is written only when some tile query sees only part of the
//     chunk (its leaf is in the chunk with leaf_tokens short of it, or a packed subtree it is
//     not in). Then the reduction map, CSR by query, in item order (deterministic).
//
// Invariant (tested by expanding plans): every (query, visible token) pair is in exactly one
// item with its mask bit set, and no invisible pair is.
#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>

#include "kernels/attention_plan.h"

namespace treeserve {
namespace {

// ceil_div and pad skip the division where the operand fits one tile (pad also where the tile
// is a power of two): a plan build calls them per unit and per cost-model step, where 64-bit
// divisions would be a large share of its time.
int64_t ceil_div(int64_t a, int64_t b) { return a > 0 && a <= b ? 1 : (a + b - 1) / b; }

// FastTree eq. 3: padding of the last tile of n elements; 0 for an empty dimension.
int64_t pad(int64_t tile, int64_t n) {
  if (n <= 0) return 0;
  if (n <= tile) return tile - n;
  if ((tile & (tile - 1)) == 0) return (tile - (n & (tile - 1))) & (tile - 1);
  return tile - ((n - 1) % tile + 1);
}

// DeFT-Flatten's even split: the tokens of each chunk (but the last) when `total` tokens are
// cut into ceil(total / chunk) chunks of equal length, rounded up to whole KV tiles.
int64_t even_chunk_tokens(int64_t total, int64_t chunk, int64_t tile) {
  return ceil_div(ceil_div(total, ceil_div(total, chunk)), tile) * tile;
}

// FastTree section 4.2, with GQA: a query occupies gqa_group_size rows of a tile.
class CostModel {
 public:
  explicit CostModel(const AttentionPlanConfig& c) : c_(c) {}

  // C_P(nQ, len) = alpha * C_P,q + beta * C_P,kv (eqs. 5-7).
  double padding(int64_t num_queries, int64_t len) const {
    const int64_t rows = num_queries * c_.gqa_group_size;
    if (rows == 0 || len == 0) return 0.0;
    const double q_pad = double(pad(c_.query_tile_rows, rows)) * double(len) * c_.head_dim;
    const int64_t kv_len = std::min<int64_t>(len, c_.kv_tile_tokens);
    const double kv_pad = double(rows) * double(pad(c_.kv_tile_tokens, kv_len)) * c_.head_dim;
    return c_.cost_alpha * q_pad + c_.cost_beta * kv_pad;
  }

  // True when folding v (nq_v queries still grouped with it, len_v tokens) into child l
  // (nq_l queries, len_l tokens) is cheaper than giving v's KV its own group (eqs. 8-11).
  bool should_fold(int64_t nq_v, int64_t len_v, int64_t nq_l, int64_t len_l) const {
    const double split_kv = padding(nq_v, len_v) + padding(nq_l, len_l) +
                            c_.cost_gamma * double(nq_l * c_.gqa_group_size) * c_.head_dim;
    const double split_q = padding(nq_v - nq_l, len_v) + padding(nq_l, len_v + len_l);
    return split_kv > split_q;
  }

 private:
  const AttentionPlanConfig& c_;
};

Status check_config(const AttentionPlanConfig& c) {
  auto bad = [](const char* field, int64_t v, const char* why) {
    return InvalidArgument(std::string("AttentionPlanConfig.") + field + " = " + std::to_string(v) +
                           " " + why);
  };
  if (c.gqa_group_size < 1) return bad("gqa_group_size", c.gqa_group_size, "must be >= 1");
  if (c.query_tile_rows < c.gqa_group_size) {
    return bad("query_tile_rows", c.query_tile_rows, "must hold one GQA group");
  }
  if (c.kv_tile_tokens < 1) return bad("kv_tile_tokens", c.kv_tile_tokens, "must be >= 1");
  if (c.kv_chunk_tokens < c.kv_tile_tokens) {
    return bad("kv_chunk_tokens", c.kv_chunk_tokens, "must be >= kv_tile_tokens");
  }
  if (c.num_sms < 1) return bad("num_sms", c.num_sms, "must be >= 1");
  if (c.min_split_tokens < 1) return bad("min_split_tokens", c.min_split_tokens, "must be >= 1");
  if (c.pair_margin < 2) return bad("pair_margin", c.pair_margin, "must be >= 2");
  if (c.decode_chunk_tokens < 0) {
    return bad("decode_chunk_tokens", c.decode_chunk_tokens, "must be >= 0");
  }
  return Status::Ok();
}

// Item i of the plan becomes item order[i] of before. Items reference segments, partial slots
// and mask words by offset, so the per-item arrays are all a reordering moves.
void permute_items(const std::vector<int32_t>& order, AttentionPlan* plan) {
  AttentionPlan& p = *plan;
  const int32_t n = p.num_items();
  std::vector<int32_t>& tmp = p.scratch.permuted;
  for (std::vector<int32_t>* v : {&p.item_segment_begin, &p.item_segment_end, &p.item_query_begin,
                                  &p.item_query_end, &p.item_num_tokens, &p.item_mask_offset}) {
    tmp.resize(size_t(n));
    for (int32_t i = 0; i < n; ++i) tmp[size_t(i)] = (*v)[size_t(order[size_t(i)])];
    std::copy(tmp.begin(), tmp.end(), v->begin());  // (a swap would move the buffers around)
  }
}

// Builds the plan; one instance per build so the passes share state without long signatures.
class PlanBuilder {
 public:
  PlanBuilder(const AttentionView& view, const AttentionPlanConfig& config, AttentionPlan* out)
      : view_(view), c_(config), out_(out), s_(out->scratch), cost_(config) {}

  Status build();

 private:
  void compute_subtree_tokens();
  void add_unit(int32_t first, int32_t end, bool is_pack, int32_t parent, int32_t len);
  void scan_children(int32_t parent_unit, int32_t begin, int32_t end);
  void build_units_and_assign();
  int64_t count_items(int32_t chunk) const;
  int64_t simulated_span(int32_t chunk, int32_t pair, int32_t decode_chunk = 0,
                         bool one_wave = false) const;
  int64_t longest_decode_shaped_run() const;
  bool decode_shaped_queries(int64_t q) const;
  void build_unit_runs() const;
  // The chunk, the kv heads a decode-shaped item's block runs (1, or c_.pair_heads), and the
  // chunk decode-shaped units are cut into (the chunk, or shorter where paired).
  struct ChunkChoice {
    int32_t chunk;
    int32_t pair;
    int32_t decode_chunk;
  };
  ChunkChoice choose_chunk_tokens() const;

  void collect_group(int32_t u);
  void emit_group(int32_t u, int32_t chunk);
  void reorder_items();
  void emit_chunk(int32_t seg_begin, int32_t seg_end, int32_t num_tokens);
  int32_t visible_in_segment(int32_t query, int32_t seg) const;
  // Positions in the ascending query ids[0, n) of the queries that see segment seg: those whose
  // leaf is the segment's node (in part, visible_in_segment) are [leaf_begin, whole_begin),
  // those whose leaf is a strict descendant of it (whole) are [whole_begin, whole_end).
  struct SegmentViewers {
    int32_t leaf_begin, whole_begin, whole_end;
  };
  // from: a position at or before the segment's first viewer (the previous segment's
  // leaf_begin: a chunk's segments follow the preorder, so their viewers' ids rise).
  SegmentViewers segment_viewers(const std::vector<int32_t>& ids, int32_t n, int32_t seg,
                                 int32_t from) const;
  Status build_reduction_map();

  int32_t queries_of(int32_t first, int32_t end) const {
    return s_.first_query[end] - s_.first_query[first];
  }

  const AttentionView& view_;
  const AttentionPlanConfig& c_;
  AttentionPlan* out_;
  AttentionPlanScratch& s_;
  CostModel cost_;
  int32_t tile_queries_ = 1;
};

void PlanBuilder::compute_subtree_tokens() {
  const int32_t n = int32_t(view_.nodes.size());
  s_.subtree_tokens.resize(n);
  for (int32_t i = 0; i < n; ++i) {
    const KvNodeRun& node = view_.nodes[i];
    s_.subtree_tokens[i] = node.query_end > node.query_begin ? node.num_tokens : 0;
  }
  for (int32_t i = n - 1; i >= 0; --i) {
    const int32_t p = view_.nodes[i].parent;
    if (p >= 0) s_.subtree_tokens[p] += s_.subtree_tokens[i];
  }
}

void PlanBuilder::add_unit(int32_t first, int32_t end, bool is_pack, int32_t parent, int32_t len) {
  s_.unit_first_node.push_back(first);
  s_.unit_end_node.push_back(end);
  s_.unit_is_pack.push_back(is_pack ? 1 : 0);
  s_.unit_parent.push_back(parent);
  s_.unit_len.push_back(len);
  s_.unit_folded.push_back(0);
  s_.unit_children_begin.push_back(0);
  s_.unit_children_end.push_back(0);
  s_.unit_remaining.push_back(queries_of(first, is_pack ? end : s_.subtree_end[first]));
  if (is_pack) ++out_->num_packs;
}

// Appends units for the child subtrees c in [begin, end) (siblings, stepping by subtree).
void PlanBuilder::scan_children(int32_t parent_unit, int32_t begin, int32_t end) {
  int32_t pack_first = -1, pack_end = -1, pack_tokens = 0, pack_queries = 0;
  auto flush = [&] {
    if (pack_first < 0) return;
    const bool single_run = pack_end == pack_first + 1;
    add_unit(pack_first, single_run ? pack_first + 1 : pack_end, !single_run, parent_unit,
             pack_tokens);
    pack_first = -1;
  };
  for (int32_t ch = begin; ch < end; ch = s_.subtree_end[ch]) {
    const int32_t num_queries = queries_of(ch, s_.subtree_end[ch]);
    if (num_queries == 0) {  // nobody reads this subtree; keep it out of packs too
      flush();
      continue;
    }
    const int32_t tokens = s_.subtree_tokens[ch];
    const bool fits =
        c_.pack_subtrees && tokens <= c_.pack_max_tokens && num_queries <= tile_queries_;
    if (!fits) {
      flush();
      add_unit(ch, ch + 1, false, parent_unit, view_.nodes[ch].num_tokens);
      continue;
    }
    if (pack_first >= 0 &&
        (pack_tokens + tokens > c_.pack_max_tokens || pack_queries + num_queries > tile_queries_)) {
      flush();
    }
    if (pack_first < 0) {
      pack_first = ch;
      pack_tokens = 0;
      pack_queries = 0;
    }
    pack_end = s_.subtree_end[ch];
    pack_tokens += tokens;
    pack_queries += num_queries;
  }
  flush();
}

void PlanBuilder::build_units_and_assign() {
  s_.unit_first_node.clear();
  s_.unit_end_node.clear();
  s_.unit_is_pack.clear();
  s_.unit_parent.clear();
  s_.unit_len.clear();
  s_.unit_folded.clear();
  s_.unit_children_begin.clear();
  s_.unit_children_end.clear();
  s_.unit_remaining.clear();
  scan_children(-1, 0, int32_t(view_.nodes.size()));
  // The unit vector is its own BFS queue: a unit's length is final (its parent has decided
  // the edge into it) before the unit is visited.
  for (int32_t u = 0; u < int32_t(s_.unit_first_node.size()); ++u) {
    if (s_.unit_is_pack[u]) continue;  // a pack is a leaf of the virtual tree
    const int32_t n = s_.unit_first_node[u];
    const int32_t children_begin = int32_t(s_.unit_first_node.size());
    scan_children(u, n + 1, s_.subtree_end[n]);
    const int32_t children_end = int32_t(s_.unit_first_node.size());
    s_.unit_children_begin[u] = children_begin;
    s_.unit_children_end[u] = children_end;
    if (!c_.greedy_grouping) continue;
    int64_t nq_v = s_.unit_remaining[u];
    const int64_t len_v = s_.unit_len[u];
    for (int32_t l = children_begin; l < children_end; ++l) {
      const int64_t nq_l = s_.unit_remaining[l];
      if (!cost_.should_fold(nq_v, len_v, nq_l, s_.unit_len[l])) continue;
      s_.unit_folded[l] = 1;
      s_.unit_len[l] += int32_t(len_v);
      nq_v -= nq_l;
      ++out_->num_folded_edges;
    }
    s_.unit_remaining[u] = int32_t(nq_v);
  }
}

// Items the groups make with this chunk size (before dropping queries that see nothing).
int64_t PlanBuilder::count_items(int32_t chunk) const {
  int64_t total = 0;
  for (size_t u = 0; u < s_.unit_remaining.size(); ++u) {
    if (s_.unit_remaining[u] == 0) continue;
    total += ceil_div(s_.unit_remaining[u], tile_queries_) * ceil_div(s_.unit_len[u], chunk);
  }
  return total;
}

// A unit with q queries left gives decode-shaped items (one query tile of at most
// kDecodeShapedRows rows): what head pairing pairs.
bool PlanBuilder::decode_shaped_queries(int64_t q) const {
  return q > 0 && q <= tile_queries_ && q * c_.gqa_group_size <= kDecodeShapedRows;
}

// The units with queries left as runs of equal (length, queries): what simulated_span reads,
// so a tree of many equal branches costs its simulations a few runs instead of a unit each.
void PlanBuilder::build_unit_runs() const {
  std::vector<int64_t>& runs = s_.span_unit_runs;
  runs.clear();
  for (size_t u = 0; u < s_.unit_remaining.size(); ++u) {
    const int64_t queries = s_.unit_remaining[u], len = s_.unit_len[u];
    if (queries == 0) continue;
    const size_t n = runs.size();
    if (n > 0 && runs[n - 3] == len && runs[n - 2] == queries) {
      ++runs[n - 1];
    } else {
      runs.insert(runs.end(), {len, queries, 1});
    }
  }
}

// The longest unit whose items are decode-shaped, in tokens; 0 where there is none. Reads the
// unit runs (build_unit_runs).
int64_t PlanBuilder::longest_decode_shaped_run() const {
  const std::vector<int64_t>& runs = s_.span_unit_runs;
  int64_t longest = 0;
  for (size_t r = 0; r < runs.size(); r += 3) {
    if (decode_shaped_queries(runs[r + 1])) longest = std::max(longest, runs[r]);
  }
  return longest;
}

// Chunk growth's estimate of a launch's span (AttentionPlanConfig::max_chunk_tokens): the
// items this chunk gives (per group: query tiles x even chunks, cut as emit_group cuts them),
// each costing a block's fixed part (kBlockFixedQuarterTiles) plus its KV tiles,
// list-scheduled longest first on num_sms item slots; the longest slot, in quarter KV tiles.
// With pair > 1 (head
// pairing, AttentionPlanConfig::pair_heads) a decode-shaped item (a unit whose one query tile
// has at most 16 rows) costs the fixed part plus ceil(tokens * pair / kv_tile_tokens) tiles
// (its block runs pair heads, tiles pair times shorter: a paired block of a 200-token branch,
// 13 steps of 16 tokens, takes about as long as a wide block of 13 full tiles) on 1 / pair of
// an item slot: the paired items, longest first, go to the slots in groups of pair, each group
// costing its longest.
// decode_chunk > 0: decode-shaped units are cut into chunks of that many tokens instead.
// one_wave: INT64_MAX unless every item (paired group) has a slot of its own, when the span is
// the longest item's cost (no placement needed).
int64_t PlanBuilder::simulated_span(int32_t chunk, int32_t pair, int32_t decode_chunk,
                                    bool one_wave) const {
  const int64_t tile = c_.kv_tile_tokens;
  pair = std::max(1, pair);
  // An item's cost is the fixed part plus 4 quarters a KV tile, and it reads at most
  // ceil(chunk / tile) tiles (pair times that paired), so the items are counted per tile count,
  // longest first, instead of sorted: count[k] items of k tiles, and paired[k] paired items
  // (pair of them share one slot's worth).
  const std::vector<int64_t>& runs = s_.span_unit_runs;
  // The tokens of each even piece a run of len tokens is cut into (decode-shaped runs by
  // decode_chunk where > 0).
  auto piece_tokens = [&](int64_t len, bool decode_shaped) {
    return even_chunk_tokens(len, decode_shaped && decode_chunk > 0 ? decode_chunk : chunk, tile);
  };
  if (one_wave) {  // every item (paired group) a slot of its own, or INT64_MAX
    int64_t items = 0, paired_items = 0, longest = -1;  // longest: in KV tiles
    for (size_t r = 0; r < runs.size(); r += 3) {
      const int64_t len = runs[r], queries = runs[r + 1], units = runs[r + 2];
      const bool decode_shaped = decode_shaped_queries(queries);
      const int64_t per = piece_tokens(len, decode_shaped);
      const int64_t pieces = ceil_div(len, per), first = std::min(per, len);
      if (pair > 1 && decode_shaped) {
        paired_items += pieces * units;
        longest = std::max(longest, ceil_div(first * pair, tile));
      } else {
        items += pieces * ceil_div(queries, tile_queries_) * units;
        longest = std::max(longest, ceil_div(first, tile));
      }
    }
    if (items + ceil_div(paired_items, pair) > c_.num_sms) return INT64_MAX;
    return longest < 0 ? 0 : kBlockFixedQuarterTiles + 4 * longest;
  }
  const int64_t max_tiles = ceil_div(std::max(chunk, decode_chunk), tile) * pair;
  std::vector<int64_t>& count = s_.span_item_cost;
  std::vector<int64_t>& paired = s_.span_paired_cost;
  count.assign(size_t(max_tiles + 1), 0);
  paired.assign(pair > 1 ? size_t(max_tiles + 1) : 0, 0);
  for (size_t r = 0; r < runs.size(); r += 3) {
    const int64_t len = runs[r], queries = runs[r + 1], units = runs[r + 2];
    const int64_t query_tiles = ceil_div(queries, tile_queries_);
    const bool decode_shaped = decode_shaped_queries(queries);
    const bool pairs = pair > 1 && decode_shaped;
    const int64_t per = piece_tokens(len, decode_shaped);
    for (int64_t begin = 0; begin < len; begin += per) {
      const int64_t tokens = std::min(per, len - begin);
      if (pairs) {
        paired[size_t(ceil_div(tokens * pair, tile))] += units;
      } else {
        count[size_t(ceil_div(tokens, tile))] += query_tiles * units;
      }
    }
  }
  if (pair > 1) {        // longest first, each group of pair costs its first (longest)
    int64_t before = 0;  // paired items of more tiles
    for (int64_t k = max_tiles; k >= 0; --k) {
      const int64_t n = paired[size_t(k)];
      count[size_t(k)] += (before + n + pair - 1) / pair - (before + pair - 1) / pair;
      before += n;
    }
  }
  std::vector<int64_t>& load = s_.span_slot_load;  // the slots' loads, ascending
  load.assign(size_t(std::max(1, c_.num_sms)), 0);
  for (int64_t k = max_tiles; k >= 0; --k) {
    if (count[size_t(k)] > 0)
      place_equal_items(&load, count[size_t(k)], kBlockFixedQuarterTiles + 4 * k);
  }
  return load.back();
}

PlanBuilder::ChunkChoice PlanBuilder::choose_chunk_tokens() const {
  const int32_t tile = c_.kv_tile_tokens;
  const int32_t max_tiles = c_.kv_chunk_tokens / tile;
  if (!c_.long_context_split) return {max_tiles * tile, 1, max_tiles * tile};
  const int64_t target = int64_t(c_.num_sms) * std::max(1, c_.min_items_per_sm);
  if (count_items(max_tiles * tile) >= target) {
    // Growth (AttentionPlanConfig::max_chunk_tokens): the chunk among 1x, 2x, 3x and 4x whose
    // simulated span is shortest (ties: the smaller); on the benchmark trees it picks the
    // chunk that runs fastest (docs/tree-attention.md). 1.5x is not a candidate: the
    // simulation favours it for trees of thought at GQA 1 that run slower with it. With head
    // pairing the chosen chunk is also simulated paired (one more simulation, where the plan
    // has decode-shaped units), and pairing is kept where its span is at least 1 / pair_margin
    // shorter, the simulation being good to about 5%, and so are the other candidate chunks
    // (below).
    const int32_t base = max_tiles * tile;
    if (c_.max_chunk_tokens <= base) return {base, 1, base};  // no growth
    build_unit_runs();
    int32_t best = base;
    int64_t best_span = simulated_span(base, 1);
    for (int32_t factor : {2, 3, 4}) {
      const int32_t chunk = base * factor;
      if (chunk > c_.max_chunk_tokens) break;
      const int64_t span = simulated_span(chunk, 1);
      if (span < best_span) {
        best = chunk;
        best_span = span;
      }
    }
    const int64_t longest_decode = longest_decode_shaped_run();
    if (c_.pair_heads <= 1 || c_.item_order != AttentionPlanConfig::ItemOrder::kKvMajor ||
        longest_decode == 0) {
      return {best, 1, best};
    }
    // Paired: the unpaired pick, with the decode-shaped units whole or cut into 2 or 3 even
    // pieces (paired blocks are long: a 200-token branch at 4 kv heads is 13 tiles, so where
    // the wide items fill the slots the paired ones left over make a tail one paired block
    // long, and shorter pieces can shorten it); then, with the cut found there, the chunks
    // that cut the longest unit into 1 or 2 more pieces (paired, the decode-shaped items take a
    // quarter of the slots they took, which may leave room for more, shorter wide items), and
    // the other chunks growth could pick and the cuts of the longest unit into up to 8 pieces
    // more than the largest chunk cuts it into. Those others, and the first two where pairing
    // at the unpaired pick is not shorter by the margin, count only where the simulation
    // places every item in one wave (at most one an item slot). Each is kept only where
    // strictly shorter, the longest chunks tried first. Example: few-shot P=4000 + 50 x 200 at
    // GQA 4 pairs at 832 (5 chunks: 160 wide and 100 paired blocks fill one wave) rather than
    // at 1024 (4 chunks). The one-wave condition keeps the other chunks from picking plans of
    // two waves or more, which the simulation underrates (docs/tree-attention.md).
    int64_t longest = 0;
    const std::vector<int64_t>& runs = s_.span_unit_runs;
    for (size_t r = 0; r < runs.size(); r += 3) longest = std::max(longest, runs[r]);
    int64_t paired_span = INT64_MAX;
    int32_t paired_best = best, decode_chunk = 0;
    auto try_paired = [&](int32_t chunk, int32_t d, bool one_wave) {
      const int64_t span = simulated_span(chunk, c_.pair_heads, d, one_wave);
      if (span < paired_span) {
        paired_span = span;
        paired_best = chunk;
        decode_chunk = d;
      }
    };
    auto try_cuts = [&](int32_t chunk) {
      for (int64_t pieces = 2, last = std::min<int64_t>(chunk, longest_decode); pieces <= 3;
           ++pieces) {
        const int32_t d =
            int32_t(even_chunk_tokens(longest_decode, ceil_div(longest_decode, pieces), tile));
        if (d >= last) continue;
        last = d;
        try_paired(chunk, d, false);
      }
    };
    try_paired(best, 0, false);
    try_cuts(best);
    const bool pairs_at_best = paired_span * c_.pair_margin <= best_span * (c_.pair_margin - 1);
    // Candidates (chunk, one wave needed), longest first.
    std::pair<int32_t, bool> candidates[16];
    int n_candidates = 0;
    const int64_t best_pieces = ceil_div(longest, best);
    for (int32_t factor : {4, 3, 2, 1}) {
      if (base * factor <= c_.max_chunk_tokens) candidates[n_candidates++] = {base * factor, true};
    }
    const int64_t first_pieces = ceil_div(longest, std::min<int64_t>(c_.max_chunk_tokens, longest));
    for (int64_t pieces = first_pieces; pieces < first_pieces + 8 || pieces <= best_pieces + 2;
         ++pieces) {
      const int32_t chunk = int32_t(even_chunk_tokens(longest, ceil_div(longest, pieces), tile));
      if (chunk < base || n_candidates == 16) break;
      const bool next_cuts = pieces > best_pieces && pieces <= best_pieces + 2;
      candidates[n_candidates++] = {chunk, !(next_cuts && pairs_at_best)};
    }
    // Longest first; of equal chunks, the one without the one-wave condition.
    std::sort(candidates, candidates + n_candidates,
              [](const std::pair<int32_t, bool>& a, const std::pair<int32_t, bool>& b) {
                return a.first != b.first ? a.first > b.first : a.second < b.second;
              });
    const int32_t cut = decode_chunk;
    for (int i = 0; i < n_candidates; ++i) {
      const int32_t chunk = candidates[i].first;
      if (chunk == best || (i > 0 && chunk == candidates[i - 1].first)) continue;
      try_paired(chunk, cut < chunk ? cut : 0, candidates[i].second);
    }
    if (paired_span * c_.pair_margin > best_span * (c_.pair_margin - 1)) return {best, 1, best};
    if (c_.decode_chunk_tokens > 0) decode_chunk = c_.decode_chunk_tokens;
    return {paired_best, c_.pair_heads,
            decode_chunk > 0 ? std::min(decode_chunk, paired_best) : paired_best};
  }
  const int32_t min_tiles =
      std::min<int32_t>(max_tiles, int32_t(ceil_div(c_.min_split_tokens, tile)));
  if (count_items(min_tiles * tile) < target) return {min_tiles * tile, 1, min_tiles * tile};
  // Largest chunk (in KV tiles) that still reaches the target: count_items is monotone.
  int32_t lo = min_tiles, hi = max_tiles;  // count(lo) >= target > count(hi)
  while (hi - lo > 1) {
    const int32_t mid = (lo + hi) / 2;
    if (count_items(mid * tile) >= target) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  // Waves: num_sms items fill the GPU once, and the items past a full wave start only when
  // earlier ones end, so a count just over it (e.g. 36 for 33: 9 chunks x 4 query tiles)
  // costs a second round of chunk-long items for a few blocks. Among lo and the larger
  // chunks up to 2 lo, take the fewest waves x (KV tiles + a block's fixed cost in tiles),
  // the larger chunk on ties (P=4000 + 50 one-token branches at GQA 4, waves of 33: 32 items
  // of 512 tokens in one wave, not 36 items of 448 in two).
  constexpr int64_t kItemOverheadTiles = 2;
  const int64_t wave = std::max(1, c_.num_sms);
  int32_t best = lo;
  int64_t best_cost = ceil_div(count_items(lo * tile), wave) * (lo + kItemOverheadTiles);
  for (int32_t t = lo + 1; t <= std::min(max_tiles, 2 * lo); ++t) {
    const int64_t cost = ceil_div(count_items(t * tile), wave) * (t + kItemOverheadTiles);
    if (cost <= best_cost) {
      best = t;
      best_cost = cost;
    }
  }
  return {best * tile, 1, best * tile};
}

// Fills chain_runs (the group's context runs, root first) and group_queries.
void PlanBuilder::collect_group(int32_t u) {
  s_.chain_runs.clear();
  for (int32_t a = u; s_.unit_folded[a];) {  // ancestors folded into u, nearest first
    a = s_.unit_parent[a];
    s_.chain_runs.push_back(s_.unit_first_node[a]);
  }
  std::reverse(s_.chain_runs.begin(), s_.chain_runs.end());
  const int32_t first = s_.unit_first_node[u];
  s_.group_queries.clear();
  if (s_.unit_is_pack[u]) {
    for (int32_t n = first; n < s_.unit_end_node[u]; ++n) {
      if (view_.nodes[n].query_end > view_.nodes[n].query_begin) s_.chain_runs.push_back(n);
    }
    for (int32_t q = s_.first_query[first]; q < s_.first_query[s_.unit_end_node[u]]; ++q) {
      s_.group_queries.push_back(q);
    }
    return;
  }
  s_.chain_runs.push_back(first);
  // The run's queries minus those of child units it was folded into (ascending, disjoint).
  int32_t q = view_.nodes[first].query_begin;
  for (int32_t l = s_.unit_children_begin[u]; l < s_.unit_children_end[u]; ++l) {
    if (!s_.unit_folded[l]) continue;
    const int32_t lf = s_.unit_first_node[l];
    const int32_t l_end = s_.unit_is_pack[l] ? s_.unit_end_node[l] : s_.subtree_end[lf];
    for (; q < s_.first_query[lf]; ++q) s_.group_queries.push_back(q);
    q = s_.first_query[l_end];
  }
  for (; q < view_.nodes[first].query_end; ++q) s_.group_queries.push_back(q);
}

// Tokens of segment seg that query sees: always a prefix of the segment.
int32_t PlanBuilder::visible_in_segment(int32_t query, int32_t seg) const {
  const AttentionQuery& q = view_.queries[query];
  const int32_t m = out_->seg_node[seg];
  const int32_t len = out_->seg_num_tokens[seg];
  if (m < q.leaf && q.leaf < s_.subtree_end[m]) return len;  // strict ancestor
  if (m != q.leaf) return 0;
  return std::clamp(q.leaf_tokens - out_->seg_token_begin[seg], 0, len);
}

// Position of the first id >= `id` in the ascending ids[from, n): steps of 1, 2, 4, ... from
// `from`, then a binary search inside the last step (the targets sit close to `from`).
inline int32_t gallop(const std::vector<int32_t>& ids, int32_t from, int32_t n, int32_t id) {
  if (from >= n || ids[size_t(from)] >= id) return from;
  int32_t lo = from, step = 1;  // ids[lo] < id
  int32_t hi = from + 1;
  while (hi < n && ids[size_t(hi)] < id) {
    lo = hi;
    step *= 2;
    hi = lo + step;
  }
  hi = std::min(hi, n);
  return int32_t(std::lower_bound(ids.begin() + lo + 1, ids.begin() + hi, id) - ids.begin());
}

PlanBuilder::SegmentViewers PlanBuilder::segment_viewers(const std::vector<int32_t>& ids, int32_t n,
                                                         int32_t seg, int32_t from) const {
  // Node m's queries are the ids [first_query[m], first_query[m + 1]) (leaf m) and
  // [first_query[m + 1], first_query[subtree_end[m]]) (below it), contiguous as the queries are
  // sorted by leaf: three searches in ids, each starting where the previous one ended.
  const int32_t m = out_->seg_node[seg];
  SegmentViewers v;
  v.leaf_begin = gallop(ids, from, n, s_.first_query[m]);
  v.whole_begin = gallop(ids, v.leaf_begin, n, s_.first_query[m + 1]);
  v.whole_end = gallop(ids, v.whole_begin, n, s_.first_query[s_.subtree_end[m]]);
  return v;
}

void PlanBuilder::emit_group(int32_t u, int32_t chunk) {
  collect_group(u);
  int64_t total = 0;
  for (int32_t n : s_.chain_runs) total += view_.nodes[n].num_tokens;
  // Even split into multiples of the KV tile (DeFT-Flatten evenly block-wise).
  const int64_t per = even_chunk_tokens(total, chunk, c_.kv_tile_tokens);
  size_t run = 0;
  int32_t run_offset = 0;  // tokens of chain_runs[run] already emitted
  for (int64_t begin = 0; begin < total; begin += per) {
    const int32_t chunk_tokens = int32_t(std::min<int64_t>(per, total - begin));
    const int32_t seg_begin = out_->num_segments();
    for (int32_t need = chunk_tokens; need > 0;) {
      const KvNodeRun& node = view_.nodes[s_.chain_runs[run]];
      const int32_t take = std::min(need, node.num_tokens - run_offset);
      const int32_t slot = node.first_slot + run_offset;
      out_->seg_page_begin.push_back(node.page_begin + slot / view_.page_size);
      out_->seg_first_slot.push_back(slot % view_.page_size);
      out_->seg_num_tokens.push_back(take);
      out_->seg_node.push_back(s_.chain_runs[run]);
      out_->seg_token_begin.push_back(run_offset);
      need -= take;
      run_offset += take;
      if (run_offset == node.num_tokens) {
        ++run;
        run_offset = 0;
      }
    }
    emit_chunk(seg_begin, out_->num_segments(), chunk_tokens);
  }
}

// Sets bits [a, b) of a mask row.
void set_mask_bits(uint32_t* row, int32_t a, int32_t b) {
  while (a < b) {
    const int32_t lo = a & 31, n = std::min(32 - lo, b - a);
    row[a >> 5] |= (n == 32 ? ~0u : ((1u << n) - 1u) << lo);
    a += n;
  }
}

void PlanBuilder::emit_chunk(int32_t seg_begin, int32_t seg_end, int32_t num_tokens) {
  // Keep the group's queries that see something of this chunk; note who sees only part. Each
  // segment costs three binary searches in the group's (ascending) queries plus its leaf's
  // queries (segment_viewers), not a test per query (speculative trees: hundreds of one-token
  // segments x hundreds of queries per chunk).
  const std::vector<int32_t>& group = s_.group_queries;
  const int32_t ng = int32_t(group.size());
  // The common cases, a shared prefix and a decode branch's own run: every query of the group
  // has its leaf in each segment's subtree and, where the leaf is the segment's node, sees the
  // segment whole, so every query sees the whole chunk (an O(1) test per segment on the
  // group's smallest and largest query: queries are sorted by (leaf, leaf_tokens), so the
  // smallest one at the segment's node sees the fewest of its tokens): all are kept and no
  // tile is masked.
  bool all_whole = ng > 0;
  for (int32_t g = seg_begin; all_whole && g < seg_end; ++g) {
    const int32_t m = out_->seg_node[g];
    const int32_t front = group.front();
    all_whole =
        front >= s_.first_query[m] && group.back() < s_.first_query[s_.subtree_end[m]] &&
        (front >= s_.first_query[m + 1] ||
         view_.queries[front].leaf_tokens >= out_->seg_token_begin[g] + out_->seg_num_tokens[g]);
  }
  std::vector<int32_t>& vis = s_.chunk_visible;
  int32_t nq = ng;
  if (!all_whole) {
    vis.assign(size_t(ng) + 1, 0);
    // Each query's visible tokens as a difference array: + the segment's length over the
    // whole viewers, + the part a leaf query sees at its own position.
    for (int32_t g = seg_begin, from = 0; g < seg_end; ++g) {
      const SegmentViewers v = segment_viewers(group, ng, g, from);
      from = v.leaf_begin;
      vis[size_t(v.whole_begin)] += out_->seg_num_tokens[g];
      vis[size_t(v.whole_end)] -= out_->seg_num_tokens[g];
      for (int32_t i = v.leaf_begin; i < v.whole_begin; ++i) {
        const int32_t part = visible_in_segment(group[size_t(i)], g);
        vis[size_t(i)] += part;
        vis[size_t(i) + 1] -= part;
      }
    }
    for (int32_t i = 1; i < ng; ++i) vis[size_t(i)] += vis[size_t(i) - 1];
    s_.chunk_queries.clear();
    nq = 0;
    for (int32_t i = 0; i < ng; ++i) {
      if (vis[size_t(i)] == 0) continue;
      s_.chunk_queries.push_back(group[size_t(i)]);
      vis[size_t(nq++)] = vis[size_t(i)];
    }
    vis.resize(size_t(nq));
  }
  const std::vector<int32_t>& chunk_queries = all_whole ? group : s_.chunk_queries;
  const int32_t words = AttentionPlan::mask_words_per_row(num_tokens);
  // Items: one per query tile; a masked one gets zeroed rows, at row_offset[i] for query i.
  std::vector<int64_t>& row_offset = s_.chunk_row_offset;
  bool any_masked = false;
  const int32_t num_tiles = int32_t(ceil_div(nq, tile_queries_));
  for (int32_t ti = 0, t0 = 0, t1 = 0; ti < num_tiles; ++ti, t0 = t1) {
    t1 = c_.balance_query_tiles ? t0 + int32_t(ceil_div(nq - t0, num_tiles - ti))
                                : std::min(nq, t0 + tile_queries_);
    bool masked = false;
    if (!all_whole) {
      for (int32_t i = t0; i < t1; ++i) masked |= vis[size_t(i)] < num_tokens;
    }
    out_->item_segment_begin.push_back(seg_begin);
    out_->item_segment_end.push_back(seg_end);
    out_->item_query_begin.push_back(out_->num_partials());
    out_->item_queries.insert(out_->item_queries.end(), chunk_queries.begin() + t0,
                              chunk_queries.begin() + t1);
    out_->item_query_end.push_back(out_->num_partials());
    out_->item_num_tokens.push_back(num_tokens);
    out_->max_item_tokens = std::max(out_->max_item_tokens, num_tokens);
    if (!masked) {
      out_->item_mask_offset.push_back(-1);
      continue;
    }
    if (!any_masked) row_offset.assign(size_t(nq), -1);
    any_masked = true;
    const size_t offset = out_->mask_words.size();
    out_->item_mask_offset.push_back(int32_t(offset));
    out_->mask_words.resize(offset + size_t(t1 - t0) * words, 0u);
    for (int32_t i = t0; i < t1; ++i) {
      row_offset[size_t(i)] = int64_t(offset) + int64_t(i - t0) * words;
    }
  }
  if (!any_masked) return;
  // Mask bits, segment by segment: the rows of the queries that see it (as above), in every
  // masked tile at once.
  uint32_t* mask = out_->mask_words.data();
  int32_t pos = 0;  // token offset of the segment inside the chunk
  for (int32_t g = seg_begin, from = 0; g < seg_end; ++g) {
    const int32_t len = out_->seg_num_tokens[g];
    const SegmentViewers v = segment_viewers(chunk_queries, nq, g, from);
    from = v.leaf_begin;
    for (int32_t i = v.whole_begin; i < v.whole_end; ++i) {
      if (row_offset[size_t(i)] >= 0) set_mask_bits(mask + row_offset[size_t(i)], pos, pos + len);
    }
    for (int32_t i = v.leaf_begin; i < v.whole_begin; ++i) {
      if (row_offset[size_t(i)] < 0) continue;
      const int32_t part = visible_in_segment(chunk_queries[size_t(i)], g);
      set_mask_bits(mask + row_offset[size_t(i)], pos, pos + part);
    }
    pos += len;
  }
}

Status PlanBuilder::build_reduction_map() {
  const int32_t num_queries = int32_t(view_.queries.size());
  const int32_t num_partials = out_->num_partials();
  const int32_t* item_queries = out_->item_queries.data();
  out_->query_merge_begin.assign(num_queries + 1, 0);
  int32_t* begin = out_->query_merge_begin.data();
  for (int32_t p = 0; p < num_partials; ++p) ++begin[item_queries[p] + 1];
  for (int32_t q = 0; q < num_queries; ++q) {
    if (begin[q + 1] == 0) {
      return Internal("plan left queries[" + std::to_string(q) + "] without a work item");
    }
    begin[q + 1] += begin[q];
  }
  s_.query_cursor.assign(begin, begin + num_queries);
  int32_t* cursor = s_.query_cursor.data();
  out_->merge_partials.resize(size_t(num_partials));
  int32_t* merge = out_->merge_partials.data();
  for (int32_t p = 0; p < num_partials; ++p) merge[cursor[item_queries[p]]++] = p;
  out_->query_rows.resize(num_queries);
  for (int32_t q = 0; q < num_queries; ++q) out_->query_rows[q] = view_.queries[q].row;
  return Status::Ok();
}

// Items reference segments, partial slots and mask words by offset, so a permutation of the
// per-item arrays is all a reordering needs (partial slots stay where they are).
void PlanBuilder::reorder_items() {
  AttentionPlan& p = *out_;
  const int32_t n = p.num_items();
  std::vector<int32_t>& order = s_.item_order;
  // Sort keys, ascending: kv-major, the (node, token offset) of the item's first segment;
  // otherwise the negated cost (longest first).
  std::vector<int64_t>& key = s_.item_cost;
  order.resize(size_t(n));
  key.resize(size_t(n));
  for (int32_t i = 0; i < n; ++i) {
    order[size_t(i)] = i;
    if (c_.item_order == AttentionPlanConfig::ItemOrder::kKvMajor ||
        c_.item_order == AttentionPlanConfig::ItemOrder::kKvMixed) {
      const int32_t g = p.item_segment_begin[size_t(i)];
      key[size_t(i)] = (int64_t(p.seg_node[size_t(g)]) << 32) | p.seg_token_begin[size_t(g)];
    } else {
      key[size_t(i)] =
          -int64_t(p.item_num_tokens[size_t(i)]) * (c_.query_tile_rows + p.item_rows(i));
    }
  }
  // Plans are often built in kv-major order already (groups are emitted root first): then
  // the stable sort is the identity, and for the plain orders nothing moves.
  const bool sorted = std::is_sorted(key.begin(), key.end());
  if (sorted && (c_.item_order == AttentionPlanConfig::ItemOrder::kKvMajor ||
                 c_.item_order == AttentionPlanConfig::ItemOrder::kLongestFirst)) {
    return;
  }
  if (!sorted) {
    std::stable_sort(order.begin(), order.end(),
                     [&](int32_t a, int32_t b) { return key[size_t(a)] < key[size_t(b)]; });
  }
  std::vector<int32_t>& tmp = s_.permuted;
  if (c_.item_order == AttentionPlanConfig::ItemOrder::kInterleaved) {
    tmp.resize(size_t(n));
    for (int32_t i = 0, lo = 0, hi = n - 1; i < n; ++i) {
      tmp[size_t(i)] = order[size_t(i % 2 == 0 ? lo++ : hi--)];
    }
    order.swap(tmp);
  } else if (c_.item_order == AttentionPlanConfig::ItemOrder::kKvMixed) {
    auto narrow = [&](int32_t i) { return p.item_rows(i) <= c_.narrow_rows; };
    int64_t num_narrow = 0;
    for (int32_t i = 0; i < n; ++i) num_narrow += narrow(i) ? 1 : 0;
    const int64_t num_wide = n - num_narrow;
    // Two cursors over the kv-major order, one per kind; the next item is the kind that is
    // behind its share (wide first on ties).
    tmp.resize(size_t(n));
    int32_t wide_at = 0, narrow_at = 0;
    int64_t wide_done = 0, narrow_done = 0;
    for (int32_t i = 0; i < n; ++i) {
      const bool take_wide =
          wide_done < num_wide &&
          (narrow_done == num_narrow || wide_done * num_narrow <= narrow_done * num_wide);
      int32_t& at = take_wide ? wide_at : narrow_at;
      while (narrow(order[size_t(at)]) == take_wide) ++at;
      tmp[size_t(i)] = order[size_t(at++)];
      ++(take_wide ? wide_done : narrow_done);
    }
    order.swap(tmp);
  }
  permute_items(s_.item_order, &p);
}

Status PlanBuilder::build() {
  AttentionPlan& p = *out_;
  p.gqa_group_size = c_.gqa_group_size;
  tile_queries_ = std::max(1, c_.query_tile_rows / c_.gqa_group_size);
  p.queries_per_tile = tile_queries_;
  p.heads_first = true;
  p.page_size = view_.page_size;
  p.max_item_tokens = 0;
  p.num_groups = p.num_folded_edges = p.num_packs = 0;
  for (auto* v :
       {&p.item_segment_begin, &p.item_segment_end, &p.item_query_begin, &p.item_query_end,
        &p.item_num_tokens, &p.item_mask_offset, &p.seg_page_begin, &p.seg_first_slot,
        &p.seg_num_tokens, &p.seg_node, &p.seg_token_begin, &p.item_queries, &p.merge_partials}) {
    v->clear();
  }
  p.mask_words.clear();
  p.page_table.assign(view_.pages.begin(), view_.pages.end());

  compute_subtree_tokens();
  build_units_and_assign();
  const auto [chunk, pair, decode_chunk] = choose_chunk_tokens();
  p.split_chunk_tokens = chunk;
  p.decode_chunk_tokens = decode_chunk;
  p.pair_heads = 0;
  p.paired_items_begin = 0;
  for (int32_t u = 0; u < int32_t(s_.unit_first_node.size()); ++u) {
    if (s_.unit_remaining[u] == 0) continue;
    ++p.num_groups;
    emit_group(u, decode_shaped_queries(s_.unit_remaining[u]) ? decode_chunk : chunk);
  }
  if (c_.item_order != AttentionPlanConfig::ItemOrder::kPlan) reorder_items();
  if (pair > 1) pair_decode_items(&p, pair, c_.paired_longest_first);
  TS_RETURN_IF_ERROR(build_reduction_map());

  auto over = [](const char* what, int64_t have, int32_t bound) {
    return ResourceExhausted(std::string("attention plan needs ") + std::to_string(have) + " " +
                             what + ", workspace holds " + std::to_string(bound));
  };
  if (c_.max_work_items > 0 && p.num_items() > c_.max_work_items) {
    return over("work items", p.num_items(), c_.max_work_items);
  }
  if (c_.max_partials > 0 && p.num_partials() > c_.max_partials) {
    return over("partials", p.num_partials(), c_.max_partials);
  }
  if (c_.max_segments > 0 && p.num_segments() > c_.max_segments) {
    return over("segments", p.num_segments(), c_.max_segments);
  }
  if (c_.max_mask_words > 0 && int64_t(p.mask_words.size()) > c_.max_mask_words) {
    return over("mask words", int64_t(p.mask_words.size()), c_.max_mask_words);
  }
  return Status::Ok();
}

}  // namespace

// List scheduling of n items of one cost c (each to a least-loaded slot) on slot loads kept
// in ascending order. While the loads spread by c or more, one item at a time (the least
// loaded slot moves up to its new place); once they spread by less than c, every slot in
// turn takes one, least loaded first, and ends above the others' loads, so whole rounds add
// c to every slot and the last partial round's r items go to the r least loaded slots. The
// loads end as the same multiset as one item at a time would leave them (which slot takes a
// tie does not change it).
void place_equal_items(std::vector<int64_t>* loads, int64_t n, int64_t c) {
  std::vector<int64_t>& load = *loads;
  const int64_t slots = int64_t(load.size());
  if (slots == 0 || c <= 0) return;
  while (n > 0 && load.back() - load.front() >= c) {
    const int64_t moved = load.front() + c;
    auto to = std::upper_bound(load.begin() + 1, load.end(), moved);
    std::move(load.begin() + 1, to, load.begin());
    *(to - 1) = moved;
    --n;
  }
  if (n <= 0) return;
  const int64_t rounds = n / slots, rest = n % slots;
  for (int64_t& l : load) l += rounds * c;
  for (int64_t i = 0; i < rest; ++i) load[size_t(i)] += c;
  std::rotate(load.begin(), load.begin() + rest, load.end());
}

int32_t item_visible_tokens(const AttentionPlan& plan, int32_t item) {
  const size_t i = size_t(item);
  const int32_t n = plan.item_num_tokens[i];
  if (plan.item_mask_offset[i] < 0) return n;
  const int32_t words = AttentionPlan::mask_words_per_row(n);
  const int32_t queries = plan.item_query_end[i] - plan.item_query_begin[i];
  if (n <= 0 || queries <= 0 ||
      int64_t(plan.item_mask_offset[i]) + int64_t(queries) * words >
          int64_t(plan.mask_words.size())) {
    return 0;
  }
  int32_t prefix = n;
  for (int32_t q = 0; q < queries && prefix > 0; ++q) {
    const uint32_t* row = plan.mask_words.data() + plan.item_mask_offset[i] + int64_t(q) * words;
    // Only the words below the shortest prefix so far can shorten it.
    const int32_t limit = std::min(words, (prefix + 31) / 32);
    for (int32_t w = 0; w < limit; ++w) {
      if (row[w] != 0xffffffffu) {
        prefix = std::min(prefix, 32 * w + __builtin_ctz(~row[w]));
        break;
      }
    }
  }
  return prefix;
}

void pair_decode_items(AttentionPlan* plan, int32_t pair_heads, bool longest_first) {
  AttentionPlan& p = *plan;
  const int32_t n = p.num_items();
  auto narrow = [&](int32_t i) { return p.item_rows(i) <= kDecodeShapedRows; };
  std::vector<int32_t>& order = p.scratch.item_order;
  order.resize(size_t(n));
  int32_t at = 0;
  for (int32_t i = 0; i < n; ++i) {
    if (!narrow(i)) order[size_t(at++)] = i;
  }
  p.pair_heads = pair_heads;
  p.paired_items_begin = at;
  for (int32_t i = 0; i < n; ++i) {
    if (narrow(i)) order[size_t(at++)] = i;
  }
  if (longest_first) {
    // Stable by the index tie-break (the indices are ascending here): std::sort, which does not
    // allocate, where std::stable_sort would on every build. Branches decoded in step have
    // equal lengths, so the items are often in order already: checked first (O(n)), which
    // saves the sort on those builds.
    auto longer = [&](int32_t a, int32_t b) {
      const int32_t ta = p.item_num_tokens[size_t(a)], tb = p.item_num_tokens[size_t(b)];
      return ta != tb ? ta > tb : a < b;
    };
    if (!std::is_sorted(order.begin() + p.paired_items_begin, order.end(), longer)) {
      std::sort(order.begin() + p.paired_items_begin, order.end(), longer);
    }
  }
  if (p.paired_items_begin < n) permute_items(order, plan);
}

Status build_attention_plan(const AttentionView& view, const AttentionPlanConfig& config,
                            AttentionPlan* out) {
  if (out == nullptr) return InvalidArgument("build_attention_plan: out is null");
  TS_RETURN_IF_ERROR(check_config(config));
  TS_RETURN_IF_ERROR(validate_attention_view(view, config.num_pages, &out->scratch));
  PlanBuilder builder(view, config, out);
  return builder.build();
}

}  // namespace treeserve
