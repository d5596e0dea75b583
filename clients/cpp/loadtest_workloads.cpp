// The workloads of clients/loadtest_workloads.py, ported one for one (same prompt construction
// and seeds, same records; the presets and parameter table are the same file,
// clients/loadtest_presets.json, compiled in), and the RPC wrapper they call the server with.
#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "clients/cpp/loadtest.h"
#include "clients/cpp/loadtest_presets_json.h"  // kPresetsJson, from embed_presets.cmake
#include "common/route_key.h"

namespace treeserve::loadtest {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::string status_code_name(grpc::StatusCode code) {
  // grpc::StatusCode's values 0..16 in order, named as grpc.StatusCode names them in Python.
  std::istringstream names(
      "OK CANCELLED UNKNOWN INVALID_ARGUMENT DEADLINE_EXCEEDED NOT_FOUND ALREADY_EXISTS "
      "PERMISSION_DENIED RESOURCE_EXHAUSTED FAILED_PRECONDITION ABORTED OUT_OF_RANGE "
      "UNIMPLEMENTED INTERNAL UNAVAILABLE DATA_LOSS UNAUTHENTICATED");
  std::string name;
  for (int c = 0; names >> name; ++c) {
    if (c == static_cast<int>(code)) return name;
  }
  return "CODE_" + std::to_string(static_cast<int>(code));
}

RpcError::RpcError(const grpc::Status& status)
    : std::runtime_error(status_code_name(status.error_code()) + ": " + status.error_message()),
      code_(status.error_code()),
      details_(status.error_message()) {}

// ---- RPC wrapper ---------------------------------------------------------------------------

Client::Client(std::shared_ptr<grpc::Channel> channel, std::string auth_token, double timeout_s)
    : stub_(pb::TreeServe::NewStub(channel)),
      auth_token_(std::move(auth_token)),
      timeout_s_(timeout_s) {}

void Client::prepare(grpc::ClientContext& ctx, const std::string& route) const {
  if (!auth_token_.empty()) ctx.AddMetadata("authorization", "Bearer " + auth_token_);
  if (!route.empty()) ctx.AddMetadata(kRouteHeader, route);
  if (timeout_s_ > 0) {
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::microseconds(int64_t(timeout_s_ * 1e6)));
  }
}

namespace {
template <typename Req, typename Resp, typename Method>
Resp call(pb::TreeServe::Stub* stub, Method method, const Req& req,
          const std::function<void(grpc::ClientContext&)>& prepare) {
  grpc::ClientContext ctx;
  prepare(ctx);
  Resp resp;
  grpc::Status st = (stub->*method)(&ctx, req, &resp);
  if (!st.ok()) throw RpcError(st);
  return resp;
}

void set_prompt(pb::Prompt* out, const Prompt& p) {
  if (p.is_text) {
    out->set_text(p.text);
  } else {
    out->mutable_tokens()->mutable_ids()->Assign(p.ids.begin(), p.ids.end());
  }
}
}  // namespace

// `route`: the call's x-treeserve-route ("" = none).
#define TS_CALL(Method, Req, Resp, req, route)                    \
  call<Req, Resp>(stub_.get(), &pb::TreeServe::Stub::Method, req, \
                  [this, r = std::string(route)](auto& c) { prepare(c, r); })

pb::ServerInfo Client::server_info() {
  return TS_CALL(GetServerInfo, pb::GetServerInfoRequest, pb::ServerInfo, {}, "");
}

std::string Client::detokenize(const std::vector<int32_t>& ids) {
  pb::DetokenizeRequest req;
  req.mutable_ids()->Assign(ids.begin(), ids.end());
  return TS_CALL(Detokenize, pb::DetokenizeRequest, pb::DetokenizeResponse, req, "").text();
}

pb::CreateTreeResponse Client::create_tree(const Prompt& prompt) {
  pb::CreateTreeRequest req;
  set_prompt(req.mutable_prompt(), prompt);
  // The prompt's routing key, as the Python client sends it (common/route_key.h).
  const std::string route =
      prompt.is_text ? route_key_text(prompt.text) : route_key_ids(prompt.ids);
  return TS_CALL(CreateTree, pb::CreateTreeRequest, pb::CreateTreeResponse, req, route);
}

std::vector<std::string> Client::branch(const std::string& tree, const std::string& branch, int n) {
  pb::BranchRequest req;
  req.set_tree_id(tree);
  req.set_branch_id(branch);
  req.set_n(n);
  auto r = TS_CALL(Branch, pb::BranchRequest, pb::BranchResponse, req, route_of_tree(tree));
  return {r.branch_ids().begin(), r.branch_ids().end()};
}

void Client::prune(const std::string& tree, const std::vector<std::string>& branches) {
  pb::PruneRequest req;
  req.set_tree_id(tree);
  for (const auto& b : branches) req.add_branch_ids(b);
  TS_CALL(Prune, pb::PruneRequest, pb::PruneResponse, req, route_of_tree(tree));
}

pb::VerifyResponse Client::verify(const std::string& tree, const std::string& branch,
                                  const std::vector<int32_t>& tokens,
                                  const std::vector<int32_t>& parents, float temperature) {
  pb::VerifyRequest req;
  req.set_tree_id(tree);
  req.set_branch_id(branch);
  req.mutable_tokens()->Assign(tokens.begin(), tokens.end());
  req.mutable_parents()->Assign(parents.begin(), parents.end());
  req.mutable_sampling()->set_temperature(temperature);
  return TS_CALL(Verify, pb::VerifyRequest, pb::VerifyResponse, req, route_of_tree(tree));
}

void Client::delete_tree(const std::string& tree) {
  pb::DeleteTreeRequest req;
  req.set_tree_id(tree);
  TS_CALL(DeleteTree, pb::DeleteTreeRequest, pb::DeleteTreeResponse, req, route_of_tree(tree));
}

#undef TS_CALL

std::optional<pb::TreeSearchDone> Client::tree_search(
    const pb::TreeSearchStart& start,
    const std::function<bool(const pb::TreeSearchLevel&)>& on_level) {
  grpc::ClientContext ctx;
  prepare(ctx, route_of_tree(start.tree_id()));
  auto stream = stub_->TreeSearch(&ctx);
  pb::TreeSearchRequest req;
  *req.mutable_start() = start;
  stream->Write(req);    // a failed write shows in Finish()'s status
  stream->WritesDone();  // logprob scoring: nothing more to send
  std::optional<pb::TreeSearchDone> done;
  bool cancelled = false;
  pb::TreeSearchResponse resp;
  while (stream->Read(&resp)) {
    if (resp.has_level() && !on_level(resp.level())) {
      ctx.TryCancel();
      cancelled = true;
      while (stream->Read(&resp)) {
      }
      break;
    }
    if (resp.has_done()) done = resp.done();
  }
  grpc::Status st = stream->Finish();
  if (cancelled) return std::nullopt;
  if (!st.ok()) throw RpcError(st);
  return done;
}

std::vector<BranchStream> Client::generate_collect(const std::string& tree,
                                                   const std::vector<std::string>& branches,
                                                   int max_tokens, float temperature,
                                                   uint64_t seed) {
  pb::GenerateRequest req;
  req.set_tree_id(tree);
  for (const auto& b : branches) req.add_branch_ids(b);
  auto* s = req.mutable_sampling();
  s->set_max_tokens(max_tokens);
  s->set_temperature(temperature);
  s->set_seed(seed);
  grpc::ClientContext ctx;
  prepare(ctx, route_of_tree(tree));
  auto reader = stub_->Generate(&ctx, req);
  std::vector<BranchStream> out;
  std::map<std::string, size_t> index;
  pb::GenerateResponse m;
  while (reader->Read(&m)) {
    double now = now_s();
    auto [it, added] = index.emplace(m.branch_id(), out.size());
    if (added) out.push_back(BranchStream{m.branch_id(), {}, {}, pb::FINISH_NONE});
    BranchStream& b = out[it->second];
    if (m.token_id() >= 0) {
      b.token_ids.push_back(m.token_id());
      b.times.push_back(now);
    }
    if (m.finish_reason() != pb::FINISH_NONE) b.finish_reason = m.finish_reason();
  }
  grpc::Status st = reader->Finish();
  if (!st.ok()) throw RpcError(st);
  return out;
}

int Client::vocab_size() {
  auto valid = [&](int id) {
    try {
      detokenize({id});
      return true;
    } catch (const RpcError& e) {
      if (e.code() == grpc::StatusCode::INVALID_ARGUMENT) return false;
      throw;
    }
  };
  int lo = 0, hi = 1 << 22;  // invariant: valid(lo), not valid(hi)
  while (hi - lo > 1) {
    int mid = (lo + hi) / 2;
    (valid(mid) ? lo : hi) = mid;
  }
  return hi;
}

int64_t kv_pages_in_use(const pb::ServerInfo& i) {
  return i.kv_pages_total() - i.kv_pages_free() - i.kv_pages_evictable();
}
bool is_idle(const pb::ServerInfo& i) {
  return i.kv_pages_free() + i.kv_pages_evictable() == i.kv_pages_total();
}

// ---- the workloads ---------------------------------------------------------------------------

namespace {

std::vector<int64_t> parse_ints(const std::string& text, const char* what) {
  std::vector<int64_t> out;
  std::stringstream ss(text);
  for (std::string item; std::getline(ss, item, ',');) {
    if (item.find_first_not_of(" \t") == std::string::npos) continue;
    try {
      size_t used = 0;
      out.push_back(std::stoll(item, &used));
      if (item.find_first_not_of(" \t", used) != std::string::npos) throw std::invalid_argument("");
    } catch (const std::logic_error&) {
      throw UsageError(std::string(what) + ": not a comma-separated list of integers: " + text);
    }
  }
  return out;
}

Json read_json(const std::filesystem::path& path) {
  std::ifstream in(path);
  if (!in) throw UsageError("cannot read " + path.string());
  try {
    return Json::parse(in);
  } catch (const Json::parse_error& e) {
    throw UsageError(path.string() + ": " + e.what());
  }
}

// Python's s[:n] on a str: the first n code points of UTF-8 text.
std::string utf8_prefix(const std::string& s, size_t n) {
  size_t i = 0;
  for (size_t cp = 0; i < s.size() && cp < n; ++cp) {
    ++i;
    while (i < s.size() && (static_cast<unsigned char>(s[i]) & 0xC0) == 0x80) ++i;
  }
  return s.substr(0, i);
}

int64_t json_int(const Json& v) {  // Python's int(x) on a JSON number or numeric string
  if (v.is_string()) return std::stoll(v.get<std::string>());
  if (v.is_number_float()) return int64_t(v.get<double>());
  return v.get<int64_t>();
}

struct GenResult {
  std::optional<double> first;
  int64_t tokens = 0;
};

// One Generate call, recorded: the first token's arrival time and the tokens produced.
GenResult run_generate(RunContext& ctx, const std::string& tree,
                       const std::vector<std::string>& branches, int64_t max_tokens, int64_t seed) {
  auto streams = ctx.client.generate_collect(tree, branches, int(max_tokens), ctx.temperature(),
                                             ctx.sampling_seed(seed));
  GenResult r;
  for (const auto& s : streams) {
    std::vector<double> gaps;
    for (size_t k = 1; k < s.times.size(); ++k) gaps.push_back(s.times[k] - s.times[k - 1]);
    ctx.rec.add_itl(
        gaps, std::vector<double>(s.times.begin() + (s.times.empty() ? 0 : 1), s.times.end()));
    ctx.rec.finish(s.finish_reason);
    r.tokens += int64_t(s.token_ids.size());
    if (!s.times.empty() && (!r.first || s.times[0] < *r.first)) r.first = s.times[0];
  }
  return r;
}

// Few-shot prompting (DeFT): a P-token prompt forked b ways, each branch decoding T tokens.
// With requests > 1 every tree has the same prompt, so later trees hit the radix cache.
std::vector<Unit> fewshot_units(RunContext& ctx) {
  Prompt prompt = ctx.segment("fewshot-prompt", ctx.p_int("prompt_tokens"));
  std::vector<Unit> units;
  for (int64_t i = 0; i < ctx.p_int("requests"); ++i) {
    units.push_back([&ctx, i, prompt] {
      double t0 = now_s();
      GenResult g;
      ctx.with_tree(prompt, [&](const std::string& tree, const std::string& root) {
        auto branches = ctx.client.branch(tree, root, int(ctx.p_int("branches")));
        g = run_generate(ctx, tree, branches, ctx.p_int("gen_tokens"), i);
      });
      ctx.rec.request(t0, g.first, now_s(), g.tokens);
    });
  }
  return units;
}

std::vector<std::string> child_ids(const Json& data, const std::string& node) {
  std::vector<std::string> kids;
  for (const auto& c : data.at(node).at("children")) {
    std::string id = c.is_string() ? c.get<std::string>() : std::to_string(json_int(c));
    if (data.contains(id)) kids.push_back(id);
  }
  return kids;
}

// --server-side-search: the server runs the BFS (one TreeSearch, logprob scoring) in the
// template's shape: expand = the most children of an expanded node, keep = the most expanded
// nodes of a level, depth = the levels below the root, every thought the median node `value`
// tokens (capped by max_node_tokens). TTFT is the time to the first level (thoughts are not
// streamed token by token, so there is no ITL).
void tot_one_server_side(RunContext& ctx, int64_t i, const Json& data, const Prompt& prompt,
                         const std::function<int64_t(const Json&)>& node_tokens) {
  int64_t expand = 0, keep = 0, depth = 0;
  std::vector<int64_t> values;
  for (std::vector<std::string> level = {"0"};;) {
    std::vector<std::string> children;
    int64_t expanded = 0;
    for (const auto& n : level) {
      const Json& kids = data.at(n).at("children");
      if (kids.empty()) continue;
      ++expanded;
      expand = std::max<int64_t>(expand, int64_t(kids.size()));
      for (auto& c : child_ids(data, n)) children.push_back(std::move(c));
    }
    if (children.empty()) break;
    keep = std::max(keep, expanded);
    for (const auto& c : children) values.push_back(node_tokens(data.at(c)));
    level = std::move(children);
    ++depth;
  }
  if (values.empty()) throw std::runtime_error("tot: a problem whose root has no children");
  std::sort(values.begin(), values.end());
  pb::TreeSearchStart start;
  start.set_expand(int32_t(expand));
  start.set_keep(int32_t(keep));
  start.set_depth(int32_t(depth));
  start.mutable_sampling()->set_max_tokens(int32_t(values[values.size() / 2]));
  start.mutable_sampling()->set_temperature(ctx.temperature());
  start.mutable_sampling()->set_seed(ctx.sampling_seed(i * 1000));
  start.set_score_mode(pb::SCORE_LOGPROB);
  double t0 = now_s();
  std::optional<double> first;
  int64_t tokens = 0, levels = 0;
  ctx.with_tree(prompt, [&](const std::string& tree, const std::string& root) {
    start.set_tree_id(tree);
    start.set_branch_id(root);
    auto done = ctx.client.tree_search(start, [&](const pb::TreeSearchLevel& level) {
      if (!first) first = now_s();
      ++levels;
      for (const auto& c : level.candidates()) {
        tokens += c.tokens();
        ctx.rec.finish(c.finish_reason());
      }
      ctx.rec.count("tot_branches", level.candidates_size());
      ctx.rec.count("tot_pruned", std::max<int64_t>(0, level.candidates_size() - keep));
      return !ctx.over_budget();  // false cancels: the server prunes what it made
    });
    if (done) ctx.rec.count("tot_leaves", done->leaves_size());
  });
  ctx.rec.count("tot_levels", levels);
  ctx.rec.request(t0, first, now_s(), tokens);
}

// Tree-of-thought BFS (DeFT's reasoning templates): prefill the prompt, branch node 0 into its
// children, decode each child for its `value` tokens (capped by max_node_tokens), prune the
// childless ones, branch the survivors into their children, and so on.
void tot_one(RunContext& ctx, int64_t i, const Json& item) {
  const Json& data = item.at("data");
  int64_t cap = ctx.p_int("max_node_tokens"), max_prompt = ctx.p_int("max_prompt_tokens");
  Prompt prompt;
  if (ctx.opts.text_mode) {
    prompt.is_text = true;
    prompt.text = item.at("prompt").get<std::string>();
    if (max_prompt > 0) prompt.text = utf8_prefix(prompt.text, 4 * max_prompt);  // ~4 chars/token
  } else {
    int64_t n = json_int(data.at("0").at("value"));
    if (max_prompt > 0) n = std::min(n, max_prompt);
    prompt = ctx.segment("tot-" + std::to_string(i), n);
  }
  auto node_tokens = [&](const Json& node) {
    int64_t v = std::max<int64_t>(1, json_int(node.at("value")));
    return cap > 0 ? std::min(v, cap) : v;
  };
  if (ctx.p_bool("server_side_search"))
    return tot_one_server_side(ctx, i, data, prompt, node_tokens);
  double t0 = now_s();
  std::optional<double> first;
  int64_t tokens = 0, depth = 0;
  ctx.with_tree(prompt, [&](const std::string& tree, const std::string& root) {
    std::vector<std::pair<std::string, std::string>> level = {{"0", root}};  // (node, branch)
    while (!level.empty() && !ctx.over_budget()) {
      std::vector<std::pair<std::string, std::string>> children;
      for (const auto& [node, branch] : level) {
        std::vector<std::string> kids = child_ids(data, node);
        auto ids = ctx.client.branch(tree, branch, int(kids.size()));
        for (size_t k = 0; k < kids.size() && k < ids.size(); ++k) {
          children.emplace_back(kids[k], ids[k]);
        }
      }
      ctx.rec.count("tot_branches", int64_t(children.size()));
      // One Generate per distinct token budget, all in flight together (they share decode
      // steps on the server); groups in first-seen order, as the Python dict.
      std::vector<std::pair<int64_t, std::vector<std::string>>> groups;
      for (const auto& [node, branch] : children) {
        int64_t n = node_tokens(data.at(node));
        auto it = std::find_if(groups.begin(), groups.end(), [n](auto& g) { return g.first == n; });
        if (it == groups.end()) it = groups.insert(groups.end(), {n, {}});
        it->second.push_back(branch);
      }
      std::vector<GenResult> results(groups.size());
      std::vector<std::function<void()>> calls;
      for (size_t g = 0; g < groups.size(); ++g) {
        calls.push_back([&, g] {
          results[g] = run_generate(ctx, tree, groups[g].second, groups[g].first, i * 1000 + depth);
        });
      }
      ctx.parallel(calls);
      for (const auto& r : results) {
        tokens += r.tokens;
        if (r.first && (!first || *r.first < *first)) first = r.first;
      }
      std::vector<std::pair<std::string, std::string>> survivors;
      std::vector<std::string> dead;
      for (const auto& [node, branch] : children) {
        if (data.at(node).at("children").empty()) {
          dead.push_back(branch);
        } else {
          survivors.emplace_back(node, branch);
        }
      }
      if (!dead.empty()) {
        ctx.client.prune(tree, dead);
        ctx.rec.count("tot_pruned", int64_t(dead.size()));
      }
      level = std::move(survivors);
      ++depth;
    }
  });
  ctx.rec.count("tot_levels", depth);
  ctx.rec.request(t0, first, now_s(), tokens);
}

std::vector<Unit> tot_units(RunContext& ctx) {
  namespace fs = std::filesystem;
  fs::path dir = fs::path(ctx.opts.workloads_dir) / "deft-templates" / "reasoning";
  fs::path path = dir / (ctx.p_str("template") + ".json");
  if (!fs::exists(path)) {
    std::vector<std::string> have;
    if (fs::is_directory(dir)) {
      for (const auto& e : fs::directory_iterator(dir)) {
        if (e.path().extension() == ".json") have.push_back(e.path().stem().string());
      }
    }
    std::sort(have.begin(), have.end());
    std::string list;
    for (const auto& h : have) list += (list.empty() ? "" : ", ") + h;
    throw UsageError("tot: template " + path.string() +
                     " not found (choose with --template; have: " + list + ")");
  }
  auto items = std::make_shared<std::vector<Json>>();
  for (auto& it : read_json(path)) {
    if (items->size() >= size_t(std::max<int64_t>(0, ctx.p_int("problems")))) break;
    if (it.contains("data") && it["data"].is_object() && !it["data"].empty() &&
        it["data"].contains("0")) {
      items->push_back(std::move(it));
    }
  }
  ctx.rec.note("template", path.string());
  std::vector<Unit> units;
  for (size_t i = 0; i < items->size(); ++i) {
    units.push_back([&ctx, i, items] { tot_one(ctx, int64_t(i), (*items)[i]); });
  }
  return units;
}

// Medusa token-tree replay (DeFT's APPS records): every step Verifies the whole token tree
// against the branch in one forward pass. Candidates are random in-vocab ids (the model is not
// the recorded one), so what this measures is verify latency per step.
std::vector<Unit> speculative_units(RunContext& ctx) {
  namespace fs = std::filesystem;
  fs::path path = fs::path(ctx.opts.workloads_dir) / "deft-templates" / "speculative" /
                  ("APPS_tree_size" + std::to_string(ctx.p_int("tree_size")) + ".json");
  if (!fs::exists(path)) {
    throw UsageError("speculative: " + path.string() +
                     " not found (--tree-size is one of 32, 64, 128, 256)");
  }
  Json doc = read_json(path);
  // Parent index per candidate from Medusa paths ([0, 1] = 2nd child of the 1st child); -1 =
  // hangs off the branch's last token. Paths are listed parents-first.
  std::map<std::vector<int64_t>, int32_t> index;
  auto parents = std::make_shared<std::vector<int32_t>>();
  for (const auto& p : doc.at("Tree_Structure")) {
    auto path_ids = p.get<std::vector<int64_t>>();
    int32_t parent = -1;
    if (path_ids.size() > 1) {
      auto it = index.find(std::vector<int64_t>(path_ids.begin(), path_ids.end() - 1));
      if (it == index.end()) throw UsageError(path.string() + ": Tree_Structure not parents-first");
      parent = it->second;
    }
    index.emplace(path_ids, int32_t(parents->size()));
    parents->push_back(parent);
  }
  auto records = std::make_shared<std::vector<Json>>();
  double accept_sum = 0;
  for (const auto& r : doc.at("Records")) {
    if (records->size() >= size_t(std::max<int64_t>(0, ctx.p_int("prompts")))) break;
    accept_sum += r.at("Avg_accept_length").get<double>();
    records->push_back(r);
  }
  ctx.rec.note("template", path.string());
  ctx.rec.note("candidates_per_step", parents->size());
  ctx.rec.note("recorded_avg_accept_length",
               accept_sum / double(std::max<size_t>(1, records->size())));
  std::vector<Unit> units;
  for (size_t i = 0; i < records->size(); ++i) {
    units.push_back([&ctx, i, records, parents] {
      const Json& record = (*records)[i];
      Prompt prompt;
      if (ctx.opts.text_mode) {  // the recorded APPS prompt, cut at ~4 characters per token
        prompt.is_text = true;
        prompt.text = utf8_prefix(record.at("prompt").get<std::string>(),
                                  size_t(4 * ctx.p_int("prompt_tokens")));
      } else {
        prompt = ctx.segment("spec-" + std::to_string(i), ctx.p_int("prompt_tokens"));
      }
      const Json& accept = record.at("Accept_length");
      int64_t steps = int64_t(accept.size());
      if (ctx.p_int("steps") > 0) steps = std::min(steps, ctx.p_int("steps"));
      PyRandom rng = ctx.rng("spec-candidates-" + std::to_string(i));
      double t0 = now_s();
      std::optional<double> first, last;
      int64_t tokens = 0;
      ctx.with_tree(prompt, [&](const std::string& tree, const std::string& root) {
        for (int64_t step = 0; step < steps && !ctx.over_budget(); ++step) {
          std::vector<int32_t> cand;
          for (size_t k = 0; k < parents->size(); ++k) {
            cand.push_back(int32_t(rng.randrange(ctx.token_lo, ctx.token_hi)));
          }
          double s = now_s();
          pb::VerifyResponse r = ctx.client.verify(tree, root, cand, *parents, 0.0f);  // greedy
          double now = now_s();
          ctx.rec.add("verify_latency_s", now - s);
          ctx.rec.add("accepted_per_step", double(r.accepted_tokens_size()));
          ctx.rec.add("recorded_accept_length", accept.at(step).get<double>());
          if (last) ctx.rec.add_itl({now - *last}, {now});
          tokens += r.accepted_tokens_size() + 1;  // accepted path + the bonus token
          if (!first) first = now;
          last = now;
        }
      });
      ctx.rec.request(t0, first, now_s(), tokens);
    });
  }
  return units;
}

// FastTree's serving workloads: independent requests whose prompts are concatenations of shared
// segments plus a private question; each is CreateTree (prefix reuse via the radix cache shows
// in cached_tokens), Branch into `chains` if > 1, Generate, DeleteTree. `segments(i)` says
// which (key, length) segments make up request i.
using SegmentsFn = std::function<std::vector<std::pair<std::string, int64_t>>(int64_t)>;

std::vector<Unit> serving_units(RunContext& ctx, int64_t requests, SegmentsFn segments) {
  std::vector<Unit> units;
  for (int64_t i = 0; i < requests; ++i) {
    units.push_back([&ctx, i, segments] {
      std::vector<Prompt> parts;
      for (const auto& [key, n] : segments(i)) parts.push_back(ctx.segment(key, n));
      Prompt prompt = ctx.join(parts);
      int64_t chains = ctx.params.contains("chains") ? ctx.p_int("chains") : 1;
      double t0 = now_s();
      GenResult g;
      ctx.with_tree(prompt, [&](const std::string& tree, const std::string& root) {
        std::vector<std::string> branches =
            chains > 1 ? ctx.client.branch(tree, root, int(chains)) : std::vector{root};
        g = run_generate(ctx, tree, branches, ctx.p_int("gen_tokens"), i);
      });
      ctx.rec.request(t0, g.first, now_s(), g.tokens);
    });
  }
  return units;
}

// Multi-level system prompt: level k has fanout[k] variants; request i uses variant
// (i mod fanout[k]) at level k (so requests form a prefix tree), then a private question.
std::vector<Unit> multilevel_units(RunContext& ctx) {
  auto levels = parse_ints(ctx.p_str("levels"), "--levels");
  auto fanout = parse_ints(ctx.p_str("fanout"), "--fanout");
  if (levels.size() != fanout.size()) {
    throw UsageError("multilevel: --levels and --fanout need the same count");
  }
  for (int64_t f : fanout) {
    if (f < 1) throw UsageError("multilevel: --fanout entries must be >= 1");
  }
  int64_t q = ctx.p_int("question_tokens");
  return serving_units(ctx, ctx.p_int("requests"), [=](int64_t i) {
    std::vector<std::pair<std::string, int64_t>> segs;
    std::string path;
    for (size_t k = 0; k < levels.size(); ++k) {
      path.append("/").append(std::to_string(i % fanout[k]));  // (GCC 12 -Wrestrict)
      segs.emplace_back("level" + std::to_string(k) + path, levels[k]);
    }
    segs.emplace_back("question-" + std::to_string(i), q);
    return segs;
  });
}

// Multi-document QA: a system prompt, a document set (docs_per_set documents drawn from a pool
// of doc_pool), a private question; questions_per_set questions per set, doc_sets sets.
std::vector<Unit> multidoc_units(RunContext& ctx) {
  ctx.params["requests"] = ctx.p_int("doc_sets") * ctx.p_int("questions_per_set");
  int64_t sets = ctx.p_int("doc_sets"), pool = ctx.p_int("doc_pool");
  int64_t per_set = std::min(ctx.p_int("docs_per_set"), pool);
  int64_t system = ctx.p_int("system_tokens"), doc = ctx.p_int("doc_tokens");
  int64_t q = ctx.p_int("question_tokens");
  if (sets < 1 || pool < 0 || per_set < 0) throw UsageError("multidoc: bad document counts");
  return serving_units(ctx, ctx.p_int("requests"), [=, &ctx](int64_t i) {
    std::vector<std::pair<std::string, int64_t>> segs = {{"system", system}};
    for (int64_t d : ctx.rng("docset-" + std::to_string(i % sets)).sample_range(pool, per_set)) {
      segs.emplace_back("doc-" + std::to_string(d), doc);
    }
    segs.emplace_back("question-" + std::to_string(i), q);
    return segs;
  });
}

// Multi-chain reasoning: a shared system prompt and a question per request, decoded by `chains`
// chains (self-consistency).
std::vector<Unit> multichain_units(RunContext& ctx) {
  int64_t system = ctx.p_int("system_tokens"), q = ctx.p_int("question_tokens");
  return serving_units(ctx, ctx.p_int("requests"), [=](int64_t i) {
    return std::vector<std::pair<std::string, int64_t>>{{"system", system},
                                                        {"question-" + std::to_string(i), q}};
  });
}

// Multiple few-shot learning: a system prompt, one of `combos` few-shot example sets, then a
// private question; questions_per_combo questions per set.
std::vector<Unit> multifewshot_units(RunContext& ctx) {
  ctx.params["requests"] = ctx.p_int("combos") * ctx.p_int("questions_per_combo");
  int64_t combos = ctx.p_int("combos"), system = ctx.p_int("system_tokens");
  int64_t fewshot = ctx.p_int("fewshot_tokens"), q = ctx.p_int("question_tokens");
  if (combos < 1) throw UsageError("multifewshot: --combos must be >= 1");
  return serving_units(ctx, ctx.p_int("requests"), [=](int64_t i) {
    return std::vector<std::pair<std::string, int64_t>>{
        {"system", system},
        {"fewshot-" + std::to_string(i % combos), fewshot},
        {"question-" + std::to_string(i), q}};
  });
}

// clients/loadtest_presets.json, the table loadtest.py reads too, compiled in by CMake.
const Json& presets_file() {
  static const Json kDoc = Json::parse(kPresetsJson);
  return kDoc;
}

}  // namespace

const std::vector<Workload>& workloads() {
  // The units of each workload are here; presets and needs_data come from the JSON, in its
  // order. A workload on one side only is a build that must not run (both clients run the same
  // set): it fails every invocation, the smoke test included.
  static const std::vector<Workload> kWorkloads = [] {
    const std::map<std::string, std::function<std::vector<Unit>(RunContext&)>> units = {
        {"fewshot", fewshot_units},          {"tot", tot_units},
        {"speculative", speculative_units},  {"multilevel", multilevel_units},
        {"multidoc", multidoc_units},        {"multichain", multichain_units},
        {"multifewshot", multifewshot_units}};
    std::vector<Workload> out;
    try {
      const Json& file = presets_file().at("workloads");
      for (const auto& [name, spec] : file.items()) {
        auto it = units.find(name);
        if (it == units.end()) {
          throw std::logic_error("workload " + name +
                                 " of clients/loadtest_presets.json has no C++ implementation");
        }
        out.push_back({name, spec.at("needs_data").get<bool>(), spec.at("small"), spec.at("full"),
                       it->second});
      }
      for (const auto& [name, fn] : units) {
        if (!file.contains(name)) {
          throw std::logic_error("workload " + name +
                                 " has no presets in clients/loadtest_presets.json");
        }
      }
    } catch (const Json::exception& e) {  // a key missing or of the wrong type
      throw std::logic_error(std::string("clients/loadtest_presets.json: ") + e.what());
    }
    return out;
  }();
  return kWorkloads;
}

const std::vector<ParamSpec>& param_specs() {
  static const std::vector<ParamSpec> kSpecs = [] {
    const std::map<std::string, ParamKind> kinds = {
        {"int", ParamKind::kInt}, {"str", ParamKind::kString}, {"bool", ParamKind::kSwitch}};
    std::vector<ParamSpec> out;
    try {
      for (const auto& p : presets_file().at("params")) {
        auto kind = kinds.find(p.at("type").get<std::string>());
        if (kind == kinds.end()) {
          throw std::logic_error("clients/loadtest_presets.json: parameter " + p.at("name").dump() +
                                 " has an unknown type " + p.at("type").dump());
        }
        out.push_back(
            {p.at("name").get<std::string>(), kind->second, p.at("help").get<std::string>()});
      }
    } catch (const Json::exception& e) {
      throw std::logic_error(std::string("clients/loadtest_presets.json: ") + e.what());
    }
    return out;
  }();
  return kSpecs;
}

}  // namespace treeserve::loadtest
