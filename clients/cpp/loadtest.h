// treeserve_loadtest: the C++ port of clients/loadtest.py (for machines without gRPC for
// Python). This header is what the runner (loadtest.cpp), the workloads
// (loadtest_workloads.cpp) and the pool checks (loadtest_pool.cpp) share: the RPC wrapper, the
// Python-compatible PRNG that makes the prompts token-for-token the ones loadtest.py sends, the
// recorder, the run context and the pool the checks read.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "proto/treeserve.grpc.pb.h"

namespace treeserve::loadtest {

namespace pb = ::treeserve::v1;
using Json = nlohmann::ordered_json;  // keeps loadtest.py's key order in the output

// Seconds on a monotonic clock (Python's time.perf_counter()).
double now_s();

// An RPC that did not return OK; recorded as "CODE_NAME: details" like loadtest.py does.
class RpcError : public std::runtime_error {
 public:
  explicit RpcError(const grpc::Status& status);
  grpc::StatusCode code() const { return code_; }
  const std::string& details() const { return details_; }

 private:
  grpc::StatusCode code_;
  std::string details_;
};
std::string status_code_name(grpc::StatusCode code);  // "RESOURCE_EXHAUSTED"

// Bad parameters or missing workload files, found before the load starts (exit status 2).
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// CPython's random.Random seeded with a str (MT19937 keyed by the string + its SHA-512), with
// the same randrange and sample algorithms, so `segment("system", n)` yields the ids
// loadtest.py yields for the same --seed.
class PyRandom {
 public:
  explicit PyRandom(std::string_view seed);
  int64_t randrange(int64_t lo, int64_t hi);                // lo <= x < hi, hi - lo < 2^32
  std::vector<int64_t> sample_range(int64_t n, int64_t k);  // random.sample(range(n), k)

 private:
  uint32_t next_u32();
  int64_t randbelow(int64_t n);
  uint32_t mt_[624];
  int index_ = 624;
};

// A prompt: token ids, or text (tokenized by the server with BOS first).
struct Prompt {
  bool is_text = false;
  std::string text;
  std::vector<int32_t> ids;
};

// What one branch of a Generate stream produced; times are now_s() at each arrival.
struct BranchStream {
  std::string branch_id;
  std::vector<int32_t> token_ids;
  std::vector<double> times;
  pb::FinishReason finish_reason = pb::FINISH_NONE;
};

// One synchronous stub over a shared channel; every method throws RpcError on a non-OK status.
// Thread-safe (gRPC stubs are). Calls on a tree carry x-treeserve-route with the tree's routing
// key (read from its id), CreateTree the key of its prompt (common/route_key.h), so the
// channel may lead to a proxy in front of several replicas.
class Client {
 public:
  Client(std::shared_ptr<grpc::Channel> channel, std::string auth_token, double timeout_s = 0);

  pb::ServerInfo server_info();
  std::string detokenize(const std::vector<int32_t>& ids);
  pb::CreateTreeResponse create_tree(const Prompt& prompt);
  std::vector<std::string> branch(const std::string& tree, const std::string& branch, int n);
  // Drains one Generate stream (branch order of first appearance).
  std::vector<BranchStream> generate_collect(const std::string& tree,
                                             const std::vector<std::string>& branches,
                                             int max_tokens, float temperature, uint64_t seed);
  void prune(const std::string& tree, const std::vector<std::string>& branches);
  pb::VerifyResponse verify(const std::string& tree, const std::string& branch,
                            const std::vector<int32_t>& tokens, const std::vector<int32_t>& parents,
                            float temperature);
  void delete_tree(const std::string& tree);
  // One TreeSearch (a BFS on the server): sends `start`, calls on_level for each level as it
  // arrives; on_level returning false cancels the search (the server prunes what it made) and
  // the result is empty. Otherwise returns the final done message.
  std::optional<pb::TreeSearchDone> tree_search(
      const pb::TreeSearchStart& start,
      const std::function<bool(const pb::TreeSearchLevel&)>& on_level);
  // The vocabulary size, by bisecting on Detokenize's INVALID_ARGUMENT (as the Python client).
  int vocab_size();

 private:
  void prepare(grpc::ClientContext& ctx, const std::string& route) const;
  std::unique_ptr<pb::TreeServe::Stub> stub_;
  std::string auth_token_;
  double timeout_s_;
};

int64_t kv_pages_in_use(const pb::ServerInfo& info);
bool is_idle(const pb::ServerInfo& info);

// The KV pool the checks read (loadtest_pool.cpp): one server's, or the sum over replicas'
// (each read directly: through a proxy a GetServerInfo reaches one replica). server_info()
// sums the counts and joins the replica ids with ",".
class Pool {
 public:
  Pool(const std::vector<std::string>& targets, const std::string& auth, double timeout_s);
  pb::ServerInfo server_info();
  // Polls until free + evictable == total or `timeout_s` passes.
  pb::ServerInfo wait_idle(double timeout_s, double interval_s = 0.1);

 private:
  std::deque<Client> clients_;
};

// Polls the pool's GetServerInfo every `interval` seconds on a thread of its own.
class KvMonitor {
 public:
  struct Sample {
    double t;
    int64_t in_use, evictable, free;
    int live_trees, live_branches;
    int64_t decode_steps;
  };
  KvMonitor(Pool& pool, double t0, double interval) : pool_(pool), t0_(t0), interval_(interval) {}
  void start();
  void stop();                  // and one last sample
  std::vector<Sample> samples;  // read after stop()

 private:
  void sample();
  Pool& pool_;
  double t0_, interval_;
  std::thread thread_;
  std::mutex mu_, samples_mu_;
  std::condition_variable cv_;
  bool stop_ = false;
};

// Thread-safe sink for what the workloads measure; times relative to t0.
class Recorder {
 public:
  struct Request {
    double start;
    std::optional<double> first;  // first token (none if nothing was generated)
    double end;
    int64_t tokens;
  };
  explicit Recorder(double t0) : t0_(t0) {}
  void request(double start, std::optional<double> first, double end, int64_t tokens);
  // Inter-token gaps and the arrival times (now_s()) that closed them.
  void add_itl(const std::vector<double>& gaps, const std::vector<double>& times);
  void finish(pb::FinishReason reason);
  void count(const std::string& key, int64_t n = 1);
  void add(const std::string& key, double value);
  void note(const std::string& key, Json value);
  void error(const std::string& what);

  // Read after the run (no concurrent writers left).
  double t0_;
  std::vector<Request> requests_;
  std::vector<double> itl_;
  std::vector<std::pair<double, double>> itl_points_;  // (t, gap)
  std::map<std::string, int64_t> counters_;
  std::map<std::string, std::vector<double>> lists_;
  Json notes_ = Json::object();
  std::map<std::string, int64_t> finish_reasons_;
  std::vector<std::string> errors_;

 private:
  std::mutex mu_;
};

// Command-line settings a workload sees (loadtest.py's args).
struct Options {
  int64_t seed = 1;
  bool text_mode = false;
  std::string workloads_dir;
  double temperature = 1.0;
  double time_budget = 0;
};

// What a workload unit sees: client, parameters, seeded prompt material, the recorder, the
// tree tracker (every created tree is deleted even when a unit fails) and the time budget.
class RunContext {
 public:
  RunContext(Client& client, Json& params, const Options& opts, int vocab, Recorder& rec);

  Client& client;
  Json& params;
  Recorder& rec;
  const Options& opts;
  int64_t token_lo, token_hi;  // random ids: skip unk/bos/eos and Llama 3's special tokens

  int64_t p_int(const char* name) const { return params.at(name).get<int64_t>(); }
  std::string p_str(const char* name) const { return params.at(name).get<std::string>(); }
  bool p_bool(const char* name) const { return params.value(name, false); }
  PyRandom rng(const std::string& key) const;
  // n seeded random in-vocab ids named by `key` (same key, same tokens: that is how requests
  // share prefixes); their text in --prompt-kind text.
  Prompt segment(const std::string& key, int64_t n);
  Prompt join(const std::vector<Prompt>& segments) const;
  uint64_t sampling_seed(int64_t seed) const;
  float temperature() const { return static_cast<float>(opts.temperature); }
  bool over_budget() const;
  void interrupt() { interrupted_ = true; }
  // CreateTree, fn(tree_id, root_branch_id), DeleteTree (also when fn throws).
  void with_tree(const Prompt& prompt,
                 const std::function<void(const std::string&, const std::string&)>& fn);
  // Runs callables on threads of their own; rethrows the first failure after all end.
  void parallel(const std::vector<std::function<void()>>& fns);
  int delete_leftovers();  // deletes trees failed units left behind; returns how many
  int created_trees() const { return created_trees_; }

 private:
  std::optional<double> deadline_;
  std::atomic<bool> interrupted_{false};
  std::mutex mu_;
  std::map<std::string, Prompt> segments_;
  std::set<std::string> live_trees_;
  int created_trees_ = 0;
};

// One logical request; a failed RPC inside throws RpcError.
using Unit = std::function<void()>;

struct Workload {
  std::string name;
  bool needs_data;                                      // reads --workloads-dir/deft-templates
  Json small, full;                                     // presets
  std::function<std::vector<Unit>(RunContext&)> units;  // may throw UsageError
};
// The workloads in clients/loadtest_presets.json's order, with its presets. Throws
// std::logic_error when the JSON and the implementations name different workloads.
const std::vector<Workload>& workloads();

// Parameter overrides (--requests, --gen-tokens, ...): name, kind, help, from
// clients/loadtest_presets.json. A switch is on when given, else the preset's value
// (loadtest.py's store_const).
enum class ParamKind { kInt, kString, kSwitch };
struct ParamSpec {
  std::string name;
  ParamKind kind;
  std::string help;
};
const std::vector<ParamSpec>& param_specs();

}  // namespace treeserve::loadtest
