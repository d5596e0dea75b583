// Engine test helpers (see engine_test_util.h).
#include "tests/engine/engine_test_util.h"

#include <algorithm>
#include <cmath>

namespace treeserve::testing {

const TinyModel* tiny_model() {
  static std::unique_ptr<TinyModel> model = []() -> std::unique_ptr<TinyModel> {
    const std::string dir = TREESERVE_TINY_MODEL_DIR;
    StatusOr<ModelConfig> config = load_model_config(dir);
    if (!config.ok()) {
      ADD_FAILURE() << "tiny model config in " << dir << ": " << config.status().ToString()
                    << " (build the tiny_model target)";
      return nullptr;
    }
    SafetensorsOptions options;
    options.progress = false;
    StatusOr<SafetensorsReader> reader = SafetensorsReader::open_dir(dir, options);
    if (!reader.ok()) {
      ADD_FAILURE() << "tiny model weights in " << dir << ": " << reader.status().ToString();
      return nullptr;
    }
    StatusOr<LlamaWeights> weights = load_llama_weights(*config, *reader);
    if (!weights.ok()) {
      ADD_FAILURE() << "tiny model weights: " << weights.status().ToString();
      return nullptr;
    }
    auto m =
        std::unique_ptr<TinyModel>(new TinyModel{*config, std::move(weights).value(), nullptr});
    m->reference = std::make_unique<ReferenceModel>(m->config, m->weights);
    return m;
  }();
  if (model == nullptr) ADD_FAILURE() << "the tiny model is not available";
  return model.get();
}

std::unique_ptr<Backend> make_cpu_backend(const TinyModel& model, int32_t page_size,
                                          int64_t num_pages, int32_t num_threads,
                                          bool kv_cache_fp8) {
  CpuBackendOptions options;
  options.page_size = page_size;
  options.num_pages = num_pages;
  options.num_threads = num_threads;
  options.kv_cache_fp8 = kv_cache_fp8;
  StatusOr<std::unique_ptr<Backend>> backend =
      create_cpu_backend(model.config, model.weights, options);
  if (!backend.ok()) {
    ADD_FAILURE() << "create_cpu_backend: " << backend.status().ToString();
    return nullptr;
  }
  return std::move(backend).value();
}

std::vector<int32_t> test_tokens(int64_t n, uint64_t seed, int64_t vocab) {
  std::vector<int32_t> out(static_cast<size_t>(n));
  uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
  for (int32_t& t : out) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    t = int32_t(3 + (s >> 33) % uint64_t(vocab - 3));
  }
  return out;
}

float max_abs_diff(const float* a, const float* b, int64_t n) {
  float m = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float d = std::fabs(a[i] - b[i]);
    if (!(d <= m)) m = d;  // NaN propagates as a failure
  }
  return m;
}

TreeDriver::TreeDriver(Backend* backend, int32_t page_size, int32_t num_pages)
    : backend_(backend), page_size_(page_size) {
  KvCacheConfig config;
  config.page_size = page_size;
  config.num_pages = num_pages;
  StatusOr<std::unique_ptr<KvCache>> kv = KvCache::create(config);
  EXPECT_TRUE(kv.ok()) << kv.status().ToString();
  if (kv.ok()) kv_ = std::move(kv).value();
}

BranchId TreeDriver::start(std::span<const int32_t> prompt) {
  StatusOr<NewBranch> b = kv_->create_branch(prompt);
  EXPECT_TRUE(b.ok()) << b.status().ToString();
  if (!b.ok()) return -1;
  Pending& p = pending_[b->id];
  p.tokens.assign(prompt.begin() + b->cached_tokens, prompt.end());
  p.slots = b->slots;
  for (const PageCopy& c : b->copies) copies_.push_back({c.src_page, c.dst_page, c.num_slots});
  return b->id;
}

std::vector<BranchId> TreeDriver::fork(BranchId branch, int32_t n) {
  StatusOr<ForkResult> f = kv_->fork(branch, n);
  EXPECT_TRUE(f.ok()) << f.status().ToString();
  if (!f.ok()) return {};
  for (const PageCopy& c : f->copies) copies_.push_back({c.src_page, c.dst_page, c.num_slots});
  return f->branches;
}

void TreeDriver::append(BranchId branch, std::span<const int32_t> tokens) {
  Pending& p = pending_[branch];
  Status s = kv_->append(branch, tokens, &p.slots);
  EXPECT_TRUE(s.ok()) << s.ToString();
  if (s.ok()) p.tokens.insert(p.tokens.end(), tokens.begin(), tokens.end());
}

void TreeDriver::append_drafts(BranchId branch, std::span<const int32_t> tokens,
                               std::span<const int32_t> parents) {
  Pending& p = pending_[branch];
  Status s = kv_->append_token_tree(branch, tokens, parents, &p.draft_slots);
  EXPECT_TRUE(s.ok()) << s.ToString();
  if (!s.ok()) return;
  p.draft_tokens.assign(tokens.begin(), tokens.end());
  p.draft_parents.assign(parents.begin(), parents.end());
}

void TreeDriver::accept(BranchId branch, std::span<const int32_t> path) {
  std::vector<SlotMove> moves;
  Status s = kv_->accept(branch, path, &moves);
  EXPECT_TRUE(s.ok()) << s.ToString();
  for (const SlotMove& m : moves) {
    moves_.push_back({int64_t(m.src.page) * page_size_ + m.src.slot,
                      int64_t(m.dst.page) * page_size_ + m.dst.slot});
  }
}

void TreeDriver::prune(BranchId branch) {
  StatusOr<PruneResult> r = kv_->prune(branch, /*retain_kv=*/false);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  pending_.erase(branch);
}

void TreeDriver::build_step(std::span<const BranchId> branches, bool all_logits, StepBatch* batch) {
  batch->clear();
  std::vector<ViewQuery> queries;
  for (BranchId b : branches) queries.push_back({b, int32_t(pending_[b].tokens.size())});
  Status s = kv_->build_attention_view(queries, &batch->view);
  EXPECT_TRUE(s.ok()) << s.ToString();
  for (BranchId b : branches) {
    const Pending& p = pending_[b];
    const int32_t length = kv_->branch_length(b).value();
    const int32_t n = int32_t(p.tokens.size());
    for (int32_t i = 0; i < n; ++i) {
      if (all_logits || i == n - 1) batch->logit_rows.push_back(batch->num_rows());
      batch->token_ids.push_back(p.tokens[i]);
      batch->positions.push_back(length - n + i);
      batch->kv_slots.push_back(int64_t(p.slots[i].page) * page_size_ + p.slots[i].slot);
    }
    std::vector<int32_t> depth(p.draft_tokens.size());
    for (size_t i = 0; i < p.draft_tokens.size(); ++i) {
      depth[i] = p.draft_parents[i] < 0 ? 0 : depth[p.draft_parents[i]] + 1;
      batch->logit_rows.push_back(batch->num_rows());
      batch->token_ids.push_back(p.draft_tokens[i]);
      batch->positions.push_back(length + depth[i]);
      batch->kv_slots.push_back(int64_t(p.draft_slots[i].page) * page_size_ +
                                p.draft_slots[i].slot);
    }
  }
  batch->page_copies = copies_;
  batch->slot_moves = moves_;
}

Status TreeDriver::step(std::span<const BranchId> branches, bool all_logits, Logits* out) {
  build_step(branches, all_logits, &batch_);
  TS_RETURN_IF_ERROR(backend_->forward(batch_, out));
  for (BranchId b : branches) pending_[b] = Pending{};
  copies_.clear();
  moves_.clear();
  return Status::Ok();
}

std::vector<int32_t> TreeDriver::tokens(BranchId branch) const {
  std::vector<int32_t> out;
  Status s = kv_->branch_tokens(branch, &out);
  EXPECT_TRUE(s.ok()) << s.ToString();
  return out;
}

}  // namespace treeserve::testing
