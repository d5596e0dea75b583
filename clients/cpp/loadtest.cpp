// treeserve_loadtest: load test for treeserve over its real gRPC API, the C++ port of
// clients/loadtest.py (same workloads, presets, prompts and seeds, same printed summary and the
// same --json schema), for machines that have no gRPC for Python. This file is the runner:
// command line, the Python-compatible PRNG and the run context the workloads draw their
// prompts from, the recorder, the thread pool that runs the workload units, the results and the
// end checks. The workloads are in loadtest_workloads.cpp, the pool checks (GetServerInfo of the
// server or of each replica, and its poller) in loadtest_pool.cpp.
#include "clients/cpp/loadtest.h"

#include <openssl/sha.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <bit>
#include <cmath>
#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <future>
#include <iostream>
#include <sstream>
#include <thread>

namespace treeserve::loadtest {

// ---- CPython's random.Random(str) --------------------------------------------------------

PyRandom::PyRandom(std::string_view seed) {
  // random.seed(str), version 2: a = int.from_bytes(s + sha512(s).digest(), "big"); the key is
  // a's 32-bit words, least significant first (CPython's random_seed + init_by_array).
  std::string bytes(seed);
  unsigned char digest[SHA512_DIGEST_LENGTH];
  SHA512(reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size(), digest);
  bytes.append(reinterpret_cast<const char*>(digest), sizeof digest);
  size_t n = bytes.size();
  while (n > 0 && bytes[bytes.size() - n] == 0) --n;  // leading zero bytes add no words
  std::vector<uint32_t> key(std::max<size_t>(1, (n + 3) / 4), 0);
  for (size_t i = 0; i < n; ++i) {  // i-th least significant byte
    key[i / 4] |= uint32_t(static_cast<unsigned char>(bytes[bytes.size() - 1 - i]))
                  << (8 * (i % 4));
  }
  constexpr int kN = 624;
  mt_[0] = 19650218U;
  for (int i = 1; i < kN; ++i) mt_[i] = 1812433253U * (mt_[i - 1] ^ (mt_[i - 1] >> 30)) + i;
  size_t i = 1, j = 0;
  for (size_t k = std::max<size_t>(kN, key.size()); k; --k) {
    mt_[i] = (mt_[i] ^ ((mt_[i - 1] ^ (mt_[i - 1] >> 30)) * 1664525U)) + key[j] + uint32_t(j);
    if (++i >= kN) mt_[0] = mt_[kN - 1], i = 1;
    if (++j >= key.size()) j = 0;
  }
  for (size_t k = kN - 1; k; --k) {
    mt_[i] = (mt_[i] ^ ((mt_[i - 1] ^ (mt_[i - 1] >> 30)) * 1566083941U)) - uint32_t(i);
    if (++i >= kN) mt_[0] = mt_[kN - 1], i = 1;
  }
  mt_[0] = 0x80000000U;
  index_ = kN;
}

uint32_t PyRandom::next_u32() {  // MT19937 genrand_uint32
  constexpr int kN = 624, kM = 397;
  if (index_ >= kN) {
    for (int k = 0; k < kN; ++k) {
      uint32_t y = (mt_[k] & 0x80000000U) | (mt_[(k + 1) % kN] & 0x7fffffffU);
      mt_[k] = mt_[(k + kM) % kN] ^ (y >> 1) ^ ((y & 1U) ? 0x9908b0dfU : 0U);
    }
    index_ = 0;
  }
  uint32_t y = mt_[index_++];
  y ^= y >> 11;
  y ^= (y << 7) & 0x9d2c5680U;
  y ^= (y << 15) & 0xefc60000U;
  return y ^ (y >> 18);
}

int64_t PyRandom::randbelow(int64_t n) {  // _randbelow_with_getrandbits
  // getrandbits(k) for k <= 32 is one 32-bit draw shifted down; wider ranges never occur here.
  if (n <= 0 || n >= (int64_t(1) << 32)) throw std::invalid_argument("randbelow: bad range");
  int k = std::bit_width(static_cast<uint64_t>(n));
  auto bits = [&] { return int64_t(next_u32() >> (32 - k)); };
  int64_t r = bits();
  while (r >= n) r = bits();
  return r;
}

int64_t PyRandom::randrange(int64_t lo, int64_t hi) {
  if (hi <= lo) throw std::invalid_argument("randrange: empty range");
  return lo + randbelow(hi - lo);
}

std::vector<int64_t> PyRandom::sample_range(int64_t n, int64_t k) {
  if (k < 0 || k > n) throw std::invalid_argument("sample: sample larger than population");
  std::vector<int64_t> out(k);
  int64_t setsize = 21;
  if (k > 5) setsize += int64_t(std::pow(4.0, std::ceil(std::log(double(k * 3)) / std::log(4.0))));
  if (n <= setsize) {
    std::vector<int64_t> pool(n);
    for (int64_t i = 0; i < n; ++i) pool[i] = i;
    for (int64_t i = 0; i < k; ++i) {
      int64_t j = randbelow(n - i);
      out[i] = pool[j];
      pool[j] = pool[n - i - 1];
    }
  } else {
    std::set<int64_t> selected;
    for (int64_t i = 0; i < k; ++i) {
      int64_t j = randbelow(n);
      while (selected.count(j)) j = randbelow(n);
      selected.insert(j);
      out[i] = j;
    }
  }
  return out;
}

// ---- recorder and run context --------------------------------------------------------------

void Recorder::request(double start, std::optional<double> first, double end, int64_t tokens) {
  std::lock_guard<std::mutex> l(mu_);
  requests_.push_back(
      {start - t0_, first ? std::optional<double>(*first - t0_) : std::nullopt, end - t0_, tokens});
}
void Recorder::add_itl(const std::vector<double>& gaps, const std::vector<double>& times) {
  std::lock_guard<std::mutex> l(mu_);
  itl_.insert(itl_.end(), gaps.begin(), gaps.end());
  for (size_t i = 0; i < gaps.size() && i < times.size(); ++i) {
    itl_points_.emplace_back(times[i] - t0_, gaps[i]);
  }
}
void Recorder::finish(pb::FinishReason reason) {
  std::lock_guard<std::mutex> l(mu_);
  ++finish_reasons_[pb::FinishReason_Name(reason)];
}
void Recorder::count(const std::string& key, int64_t n) {
  std::lock_guard<std::mutex> l(mu_);
  counters_[key] += n;
}
void Recorder::add(const std::string& key, double value) {
  std::lock_guard<std::mutex> l(mu_);
  lists_[key].push_back(value);
}
void Recorder::note(const std::string& key, Json value) {
  std::lock_guard<std::mutex> l(mu_);
  notes_[key] = std::move(value);
}
void Recorder::error(const std::string& what) {
  std::lock_guard<std::mutex> l(mu_);
  errors_.push_back(what);
}

RunContext::RunContext(Client& c, Json& p, const Options& o, int vocab, Recorder& r)
    : client(c), params(p), rec(r), opts(o) {
  // Skip the first 3 ids (unk/bos/eos in sentencepiece vocabularies) and, for big
  // vocabularies, the last 256 (where Llama 3 keeps its special tokens).
  token_lo = 3;
  token_hi = vocab > 4096 ? vocab - 256 : vocab;
  if (o.time_budget > 0) deadline_ = now_s() + o.time_budget;
}

PyRandom RunContext::rng(const std::string& key) const {
  return PyRandom(std::to_string(opts.seed) + ":" + key);
}

Prompt RunContext::segment(const std::string& key, int64_t n) {
  {
    std::lock_guard<std::mutex> l(mu_);
    if (auto it = segments_.find(key); it != segments_.end()) return it->second;
  }
  PyRandom r = rng(key);
  Prompt seg;
  for (int64_t i = 0; i < n; ++i) seg.ids.push_back(int32_t(r.randrange(token_lo, token_hi)));
  if (opts.text_mode) {
    seg.is_text = true;
    seg.text = client.detokenize(seg.ids);
    seg.ids.clear();
  }
  std::lock_guard<std::mutex> l(mu_);
  return segments_.emplace(key, std::move(seg)).first->second;
}

Prompt RunContext::join(const std::vector<Prompt>& segs) const {
  Prompt out;
  out.is_text = opts.text_mode;
  for (const auto& s : segs) {
    out.text += s.text;
    out.ids.insert(out.ids.end(), s.ids.begin(), s.ids.end());
  }
  return out;
}

uint64_t RunContext::sampling_seed(int64_t seed) const {
  return static_cast<uint64_t>(opts.seed * 1000003 + seed);
}

bool RunContext::over_budget() const {
  return interrupted_ || (deadline_ && now_s() >= *deadline_);
}

void RunContext::with_tree(const Prompt& prompt,
                           const std::function<void(const std::string&, const std::string&)>& fn) {
  pb::CreateTreeResponse r = client.create_tree(prompt);
  {
    std::lock_guard<std::mutex> l(mu_);
    live_trees_.insert(r.tree_id());
    ++created_trees_;
  }
  rec.count("prompt_tokens", r.prompt_tokens());
  rec.count("cached_tokens", r.cached_tokens());
  try {
    fn(r.tree_id(), r.root_branch_id());
  } catch (...) {
    try {
      client.delete_tree(r.tree_id());
      std::lock_guard<std::mutex> l(mu_);
      live_trees_.erase(r.tree_id());
    } catch (const RpcError&) {
      // Left in live_trees_: delete_leftovers() retries at the end.
    }
    throw;
  }
  client.delete_tree(r.tree_id());
  std::lock_guard<std::mutex> l(mu_);
  live_trees_.erase(r.tree_id());
}

void RunContext::parallel(const std::vector<std::function<void()>>& fns) {
  if (fns.size() == 1) return fns[0]();
  std::vector<std::future<void>> futures;
  for (const auto& fn : fns) futures.push_back(std::async(std::launch::async, fn));
  for (auto& f : futures) f.wait();
  for (auto& f : futures) f.get();
}

int RunContext::delete_leftovers() {
  std::vector<std::string> left;
  {
    std::lock_guard<std::mutex> l(mu_);
    left.assign(live_trees_.begin(), live_trees_.end());
  }
  for (const auto& t : left) {
    try {
      client.delete_tree(t);
    } catch (const RpcError&) {
    }
  }
  return int(left.size());
}

namespace {

std::atomic<bool> g_interrupted{false};
extern "C" void on_signal(int) { g_interrupted = true; }

// Linear-interpolated percentile (q in [0, 100]) of a non-empty list, as loadtest.py's.
double percentile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  double pos = double(v.size() - 1) * q / 100.0;
  size_t lo = size_t(pos), hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (v[hi] - v[lo]) * (pos - double(lo));
}

Json summary(const std::vector<double>& v) {
  if (v.empty())
    return {{"count", 0}, {"p50", nullptr}, {"p99", nullptr}, {"mean", nullptr}, {"max", nullptr}};
  double sum = 0;
  for (double x : v) sum += x;
  return {{"count", v.size()},
          {"p50", percentile(v, 50)},
          {"p99", percentile(v, 99)},
          {"mean", sum / double(v.size())},
          {"max", *std::max_element(v.begin(), v.end())}};
}

double round_to(double x, double digits) {
  double f = std::pow(10.0, digits);
  return std::round(x * f) / f;
}

struct RunOutcome {
  double wall = 0;
  int ran = 0, skipped = 0;
};

// Runs the first `warmup` units one at a time, then the rest on `concurrency` threads; units
// not started when the time budget runs out are skipped. On SIGINT/SIGTERM nothing new starts
// and this run's trees are deleted, which ends the streams still in flight.
RunOutcome run_units(RunContext& ctx, const std::vector<Unit>& units, int concurrency, int warmup) {
  std::atomic<int> ran{0};
  auto guarded = [&](const Unit& unit) {
    if (ctx.over_budget()) return;
    ++ran;
    try {
      unit();
    } catch (const RpcError& e) {
      ctx.rec.error(e.what());
    } catch (const std::exception& e) {  // a client-side bug: reported, and the exit status 1
      ctx.rec.error(std::string("CLIENT_ERROR: ") + e.what());
    }
  };
  double t0 = now_s();
  std::atomic<bool> done{false};
  std::thread runner([&] {
    size_t first = std::min(units.size(), size_t(std::max(0, warmup)));
    for (size_t i = 0; i < first; ++i) guarded(units[i]);
    std::atomic<size_t> next{first};
    std::vector<std::thread> pool;
    size_t threads = std::min(units.size() - first, size_t(std::max(1, concurrency)));
    for (size_t k = 0; k < threads; ++k) {
      pool.emplace_back([&] {
        for (size_t i; (i = next++) < units.size();) guarded(units[i]);
      });
    }
    for (auto& t : pool) t.join();
    done = true;
  });
  bool handled = false;
  while (!done) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    if (g_interrupted && !handled) {
      handled = true;
      ctx.interrupt();
      std::fprintf(stderr, "interrupted: deleting this run's trees\n");
      ctx.delete_leftovers();
      ctx.rec.error("INTERRUPTED: stopped by the user");
    }
  }
  runner.join();
  return {now_s() - t0, ran.load(), int(units.size()) - ran.load()};
}

struct Args {
  std::string target = "127.0.0.1:50051", auth_token, workload, scale = "small", replicas;
  bool proxy = false;
  std::string workloads_dir, prompt_kind = "tokens", json, plot;
  int64_t seed = 1;
  double temperature = 1.0;
  int vocab = 0, warmup = 0;
  double time_budget = 0, poll_interval = 0.1, idle_timeout = 10;
  bool quiet = false;
};

Json server_json(const pb::ServerInfo& info) {
  return {{"model", info.model()},
          {"backend", info.backend()},
          {"page_size", info.page_size()},
          {"kv_pages_total", info.kv_pages_total()},
          {"tensor_parallel", info.tensor_parallel()}};
}

// The addresses whose pools the checks sum; empty: the checks are skipped (--proxy alone).
std::vector<std::string> pool_targets(const Args& args) {
  std::vector<std::string> out;
  if (!args.replicas.empty()) {
    std::stringstream in(args.replicas);
    for (std::string t; std::getline(in, t, ',');) {
      if (!t.empty()) out.push_back(t);
    }
    return out;
  }
  if (!args.proxy) out.push_back(args.target);
  return out;
}

// `idle`: the pool at the end; none when the pool checks are skipped.
Json build_results(const Args& args, const Json& params, const pb::ServerInfo& info, Recorder& rec,
                   const std::vector<KvMonitor::Sample>& samples, const RunOutcome& run,
                   const std::optional<pb::ServerInfo>& idle, int leaks) {
  const auto& reqs = rec.requests_;
  int64_t tokens = 0;
  std::vector<double> ttft, latency, used;
  for (const auto& r : reqs) {
    tokens += r.tokens;
    if (r.first) ttft.push_back(*r.first - r.start);
    latency.push_back(r.end - r.start);
  }
  Json kv = {{"min", nullptr},
             {"max", nullptr},
             {"mean", nullptr},
             {"peak_occupied", nullptr},
             {"total", info.kv_pages_total()},
             {"samples", samples.size()}};
  if (!samples.empty()) {
    int64_t lo = samples[0].in_use, hi = lo, peak = 0;
    double sum = 0;
    for (const auto& s : samples) {
      lo = std::min(lo, s.in_use), hi = std::max(hi, s.in_use);
      peak = std::max(peak, s.in_use + s.evictable);
      sum += double(s.in_use);
    }
    kv["min"] = lo, kv["max"] = hi, kv["mean"] = sum / double(samples.size());
    kv["peak_occupied"] = peak;
  }
  Json counters = Json::object(), finish = Json::object(), lists = Json::object();
  for (const auto& [k, v] : rec.counters_) {
    if (k != "prompt_tokens" && k != "cached_tokens") counters[k] = v;
  }
  for (const auto& [k, v] : rec.finish_reasons_) finish[k] = v;
  for (const auto& [k, v] : rec.lists_) lists[k] = summary(v);
  auto counter = [&](const char* k) { return rec.counters_.count(k) ? rec.counters_.at(k) : 0; };

  Json tl_kv = Json::array(), tl_req = Json::array(), tl_itl = Json::array();
  for (const auto& s : samples) tl_kv.push_back({round_to(s.t, 4), s.in_use, s.evictable});
  for (const auto& r : reqs) {
    tl_req.push_back({round_to(r.end, 4), round_to(r.end - r.start, 4),
                      r.first ? Json(round_to(*r.first - r.start, 4)) : Json(nullptr)});
  }
  auto points = rec.itl_points_;  // [t, gap], thinned to at most ~5000 points
  std::sort(points.begin(), points.end());
  size_t stride = std::max<size_t>(1, points.size() / 5000);
  for (size_t i = 0; i < points.size(); i += stride) {
    tl_itl.push_back({round_to(points[i].first, 4), round_to(points[i].second, 5)});
  }

  Json res = {
      {"workload", args.workload},
      {"scale", args.scale},
      {"params", params},
      {"target", args.target},
      {"prompt_kind", args.prompt_kind},
      {"warmup", args.warmup},
      {"seed", args.seed},
      {"pool_checked", pool_targets(args).empty() ? Json(nullptr) : Json(pool_targets(args))},
      {"client", "treeserve_loadtest (C++)"},
      {"server", server_json(info)},
      {"wall_s", run.wall},
      {"requests_completed", reqs.size()},
      {"requests_started", run.ran},
      {"requests_skipped", run.skipped},
      {"errors", rec.errors_},
      {"generated_tokens", tokens},
      {"throughput_tok_s", run.wall > 0 ? double(tokens) / run.wall : 0.0},
      {"ttft_s", summary(ttft)},
      {"itl_s", summary(rec.itl_)},
      {"request_latency_s", summary(latency)},
      {"kv_pages", kv},
      {"decode_steps", samples.size() > 1
                           ? Json(samples.back().decode_steps - samples.front().decode_steps)
                           : Json(nullptr)},
      {"prompt_tokens", counter("prompt_tokens")},
      {"cached_tokens", counter("cached_tokens")},
      {"finish_reasons", finish},
      {"counters", counters},
      {"notes", rec.notes_},
      {"lists", lists},
      {"idle_after", idle ? Json(is_idle(*idle) && idle->live_trees() == 0) : Json(nullptr)},
      {"idle_state", idle ? Json{{"kv_pages_free", idle->kv_pages_free()},
                                 {"kv_pages_evictable", idle->kv_pages_evictable()},
                                 {"kv_pages_total", idle->kv_pages_total()},
                                 {"live_trees", idle->live_trees()},
                                 {"live_branches", idle->live_branches()}}
                          : Json(nullptr)},
      {"leftover_trees_deleted", leaks},
      {"timeline", {{"kv", tl_kv}, {"requests", tl_req}, {"itl", tl_itl}}},
  };
  if (rec.lists_.count("accepted_per_step")) {
    const auto& acc = rec.lists_.at("accepted_per_step");
    double sum = 0;
    for (double a : acc) sum += a;
    res["speculative"] = {
        {"verify_steps", acc.size()},
        {"mean_accepted_per_step", sum / double(acc.size())},
        {"recorded_mean_accept_length", rec.notes_.contains("recorded_avg_accept_length")
                                            ? rec.notes_["recorded_avg_accept_length"]
                                            : Json(nullptr)},
        {"verify_latency_s", summary(rec.lists_["verify_latency_s"])},
        {"note",
         "candidate ids are random and the model is not the recorded one, so accepted lengths "
         "do not follow the recorded Accept_length"}};
  }
  return res;
}

std::string ms(const Json& x) {
  if (x.is_null()) return "-";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.1f ms", 1000 * x.get<double>());
  return buf;
}

// A value as Python's "%s" prints it.
std::string scalar(const Json& v) {
  if (v.is_boolean()) return v.get<bool>() ? "True" : "False";
  return v.is_string() ? v.get<std::string>() : v.dump();
}

void print_results(const Json& res) {
  const Json& srv = res["server"];
  std::printf("workload %s (scale %s, %s prompts) on %s: model=%s backend=%s\n",
              scalar(res["workload"]).c_str(), scalar(res["scale"]).c_str(),
              scalar(res["prompt_kind"]).c_str(), scalar(res["target"]).c_str(),
              scalar(srv["model"]).c_str(), scalar(srv["backend"]).c_str());
  std::map<std::string, Json> params;
  for (const auto& [k, v] : res["params"].items()) params[k] = v;
  std::string line;
  for (const auto& [k, v] : params) line += (line.empty() ? "" : ", ") + k + "=" + scalar(v);
  std::printf("  params: %s\n", line.c_str());
  std::printf("  requests: %d completed, %d not run (time budget), %d errors; wall %.2f s\n",
              res["requests_completed"].get<int>(), res["requests_skipped"].get<int>(),
              int(res["errors"].size()), res["wall_s"].get<double>());
  std::printf(
      "  throughput: %.1f generated tokens/s (%lld tokens); prompt tokens %lld, cached %lld\n",
      res["throughput_tok_s"].get<double>(), res["generated_tokens"].get<long long>(),
      res["prompt_tokens"].get<long long>(), res["cached_tokens"].get<long long>());
  for (auto [key, label] :
       {std::pair{"ttft_s", "time to first token:"}, std::pair{"itl_s", "inter-token latency:"},
        std::pair{"request_latency_s", "request latency:"}}) {
    const Json& s = res[key];
    std::printf("  %-20s p50 %s  p99 %s  (n=%d)\n", label, ms(s["p50"]).c_str(),
                ms(s["p99"]).c_str(), s["count"].get<int>());
  }
  const Json& kv = res["kv_pages"];
  if (kv["samples"].get<int>() > 0) {
    std::printf(
        "  KV pages in use: min %lld  mean %.1f  max %lld  of %lld (peak incl. evictable cache "
        "%lld; %d samples)\n",
        kv["min"].get<long long>(), kv["mean"].get<double>(), kv["max"].get<long long>(),
        kv["total"].get<long long>(), kv["peak_occupied"].get<long long>(),
        kv["samples"].get<int>());
  }
  if (!res["decode_steps"].is_null()) {
    std::printf("  decode steps: %lld\n", res["decode_steps"].get<long long>());
  }
  for (auto [key, label] :
       {std::pair{"finish_reasons", "finish reasons"}, std::pair{"counters", "counters"}}) {
    if (res[key].empty()) continue;
    std::map<std::string, long long> sorted;
    for (const auto& [k, v] : res[key].items()) sorted[k] = v.get<long long>();
    line.clear();
    for (const auto& [k, v] : sorted)
      line += (line.empty() ? "" : ", ") + k + "=" + std::to_string(v);
    std::printf("  %s: %s\n", label, line.c_str());
  }
  if (res.contains("speculative")) {
    const Json& s = res["speculative"];
    const Json& rec_mean = s["recorded_mean_accept_length"];
    std::printf(
        "  verify: %d steps, latency p50 %s p99 %s; accepted/step %.2f (recorded Medusa "
        "mean %.2f; %s)\n",
        s["verify_steps"].get<int>(), ms(s["verify_latency_s"]["p50"]).c_str(),
        ms(s["verify_latency_s"]["p99"]).c_str(), s["mean_accepted_per_step"].get<double>(),
        rec_mean.is_null() ? 0.0 : rec_mean.get<double>(), scalar(s["note"]).c_str());
  }
  size_t shown = 0;
  for (const auto& e : res["errors"]) {
    if (shown++ == 10) break;
    std::printf("  error: %s\n", scalar(e).c_str());
  }
  std::fflush(stdout);
}

int run(int argc, char** argv) {
  Args args;
  namespace fs = std::filesystem;
  args.workloads_dir =
      fs::path(TREESERVE_SOURCE_DIR "/bench/workloads").lexically_normal().string();
  CLI::App app{
      "treeserve_loadtest: load test for treeserve over its real gRPC API (the C++ port of "
      "clients/loadtest.py). Workloads: fewshot, tot, speculative, multilevel, multidoc, "
      "multichain, multifewshot; --scale picks a preset and any preset parameter can be "
      "overridden (--branches 30, --gen-tokens 100, ...). Prints throughput (generated "
      "tokens/s), time to first token, inter-token latency and request latency (p50/p99) and KV "
      "pages in use over time; --json writes everything (loadtest.py's schema; plot it with "
      "clients/plot_loadtest.py). Every tree it creates is deleted at the end, and it checks "
      "the server's pool returns to idle. Exit status: 0, 1 when any request failed, 2 on a "
      "usage error."};
  std::vector<std::string> names;
  for (const auto& w : workloads()) names.push_back(w.name);
  app.add_option("--target", args.target,
                 "server host:port, or a proxy's in front of several replicas (every call "
                 "carries x-treeserve-route)")
      ->capture_default_str();
  app.add_option("--replicas", args.replicas,
                 "the replicas' own host:port, comma-separated: the pool checks (idle at start "
                 "and end, KV pages over time) sum their GetServerInfo (default: --target's)");
  app.add_flag("--proxy", args.proxy,
               "--target is a proxy: without --replicas the pool checks are skipped (through a "
               "proxy GetServerInfo reaches one replica)");
  app.add_option("--auth-token", args.auth_token, "bearer token for server.auth_token");
  app.add_option("--workload", args.workload)->required()->check(CLI::IsMember(names));
  app.add_option("--scale", args.scale)
      ->check(CLI::IsMember({"small", "full"}))
      ->capture_default_str();
  app.add_option("--workloads-dir", args.workloads_dir, "folder holding deft-templates/")
      ->capture_default_str();
  app.add_option("--prompt-kind", args.prompt_kind,
                 "prompts as random in-vocab token ids, or as text (tot/speculative use the "
                 "recorded prompt text; text prompts get BOS prepended)")
      ->check(CLI::IsMember({"tokens", "text"}))
      ->capture_default_str();
  app.add_option("--seed", args.seed)->capture_default_str();
  app.add_option("--temperature", args.temperature)->capture_default_str();
  app.add_option("--vocab", args.vocab, "vocabulary size (0 = probe server)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--time-budget", args.time_budget,
                 "seconds after which no new request (or ToT level / verify step) starts; 0 = "
                 "none")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--warmup", args.warmup,
                 "run the first N requests one at a time before the concurrent rest (they fill "
                 "the radix cache with the shared prefixes; counted in the figures)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--poll-interval", args.poll_interval, "GetServerInfo polling period, seconds")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--idle-timeout", args.idle_timeout,
                 "seconds to wait for the pool to return to idle at the end")
      ->capture_default_str();
  app.add_option("--json", args.json, "write the results here");
  app.add_option("--plot", args.plot, "not in the C++ client: use clients/plot_loadtest.py");
  app.add_flag("--quiet", args.quiet, "no summary on stdout");
  std::map<std::string, int64_t> int_params;
  std::map<std::string, std::string> str_params;
  std::map<std::string, bool> switches;
  for (const auto& p : param_specs()) {
    std::string flag = "--" + std::string(p.name);
    std::replace(flag.begin(), flag.end(), '_', '-');
    if (p.kind == ParamKind::kInt) {
      app.add_option(flag, int_params[p.name], p.help)->group("Workload parameters");
    } else if (p.kind == ParamKind::kString) {
      app.add_option(flag, str_params[p.name], p.help)->group("Workload parameters");
    } else {
      app.add_flag(flag, switches[p.name], p.help)->group("Workload parameters");
    }
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    app.exit(e);
    return 2;
  }
  if (!args.plot.empty()) {
    std::fprintf(stderr,
                 "error: --plot is Python-only: write --json FILE and run "
                 "clients/plot_loadtest.py --json FILE --png %s\n",
                 args.plot.c_str());
    return 2;
  }
  const Workload& workload =
      *std::find_if(workloads().begin(), workloads().end(),
                    [&](const Workload& w) { return w.name == args.workload; });
  if (workload.needs_data && !fs::is_directory(fs::path(args.workloads_dir) / "deft-templates")) {
    std::fprintf(stderr,
                 "error: workload %s needs the DeFT templates, but %s has no deft-templates/ "
                 "folder (pass --workloads-dir)\n",
                 workload.name.c_str(), args.workloads_dir.c_str());
    return 2;
  }
  Json params = args.scale == "full" ? workload.full : workload.small;
  for (const auto& p : param_specs()) {
    std::string flag = "--" + std::string(p.name);
    std::replace(flag.begin(), flag.end(), '_', '-');
    if (app.count(flag) == 0) continue;
    if (p.kind == ParamKind::kInt) {
      params[p.name] = int_params[p.name];
    } else if (p.kind == ParamKind::kString) {
      params[p.name] = str_params[p.name];
    } else {
      params[p.name] = true;
    }
  }

  auto channel = grpc::CreateChannel(args.target, grpc::InsecureChannelCredentials());
  Client client(channel, args.auth_token);
  pb::ServerInfo info;
  try {
    info = client.server_info();
  } catch (const RpcError& e) {
    std::fprintf(stderr, "error: cannot reach treeserve at %s: %s\n", args.target.c_str(),
                 e.details().c_str());
    return 2;
  }
  const std::vector<std::string> targets = pool_targets(args);
  std::optional<Pool> pool;
  if (targets.empty()) {
    std::fprintf(stderr,
                 "note: --proxy without --replicas: GetServerInfo through the proxy reaches one "
                 "replica, so the pool checks (idle at start and end, KV pages over time) are "
                 "skipped; pass --replicas HOST:PORT,... to sum the replicas' pools\n");
  } else {
    pool.emplace(targets, args.auth_token, /*timeout_s=*/10);
    try {
      info = pool->server_info();
    } catch (const RpcError& e) {
      std::fprintf(stderr, "error: cannot reach a replica of %s: %s\n", args.replicas.c_str(),
                   e.details().c_str());
      return 2;
    }
    if (!is_idle(info) || info.live_trees()) {
      std::fprintf(stderr,
                   "warning: server is not idle at start (%d trees, %lld pages in use); figures "
                   "include other clients' load\n",
                   info.live_trees(), static_cast<long long>(kv_pages_in_use(info)));
    }
  }
  Options opts;
  opts.seed = args.seed;
  opts.text_mode = args.prompt_kind == "text";
  opts.workloads_dir = args.workloads_dir;
  opts.temperature = args.temperature;
  opts.time_budget = args.time_budget;
  int vocab = args.vocab ? args.vocab : client.vocab_size();
  double t0 = now_s();
  Recorder rec(t0);
  RunContext ctx(client, params, opts, vocab, rec);
  std::vector<Unit> units;
  try {
    units = workload.units(ctx);
  } catch (const UsageError& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  }
  std::signal(SIGINT, on_signal);
  std::signal(SIGTERM, on_signal);
  std::optional<KvMonitor> mon;
  if (pool) {
    mon.emplace(*pool, t0, args.poll_interval);
    mon->start();
  }
  int concurrency = params.contains("concurrency") ? params["concurrency"].get<int>() : 1;
  RunOutcome run = run_units(ctx, units, concurrency, args.warmup);
  int leaks = ctx.delete_leftovers();
  if (mon) mon->stop();
  std::optional<pb::ServerInfo> idle;
  if (pool) idle = pool->wait_idle(args.idle_timeout);
  Json res = build_results(args, params, info, rec,
                           mon ? mon->samples : std::vector<KvMonitor::Sample>{}, run, idle, leaks);
  if (!args.quiet) {
    print_results(res);
  } else {
    for (size_t i = 0; i < rec.errors_.size() && i < 10; ++i) {
      std::fprintf(stderr, "error: %s\n", rec.errors_[i].c_str());
    }
  }
  if (idle && !res["idle_after"].get<bool>()) {
    std::fprintf(stderr,
                 "warning: server did not return to idle: free %lld + evictable %lld != total "
                 "%lld, %d live trees, %d live branches\n",
                 (long long)idle->kv_pages_free(), (long long)idle->kv_pages_evictable(),
                 (long long)idle->kv_pages_total(), idle->live_trees(), idle->live_branches());
  }
  if (leaks) {
    std::fprintf(stderr, "warning: %d trees were left by failed requests and deleted at the end\n",
                 leaks);
  }
  if (!args.json.empty()) {
    std::ofstream out(args.json);
    out << res.dump(1) << "\n";
    if (!out) {
      std::fprintf(stderr, "error: cannot write %s\n", args.json.c_str());
      return 1;
    }
  }
  return rec.errors_.empty() && !rec.requests_.empty() ? 0 : 1;
}

}  // namespace
}  // namespace treeserve::loadtest

int main(int argc, char** argv) {
  try {
    return treeserve::loadtest::run(argc, argv);
  } catch (const treeserve::loadtest::RpcError& e) {  // the server went away mid-run
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  } catch (const std::logic_error& e) {  // the compiled-in presets and the code disagree
    std::fprintf(stderr, "internal error: %s\n", e.what());
    return 1;
  }
}
