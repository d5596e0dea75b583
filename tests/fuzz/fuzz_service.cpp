// Fuzzes request handling end to end: the real TreeServeService, behind a gRPC server in this
// process, over the real Scheduler on the CPU backend with the tiny model and a small KV pool.
// Each input is a Session (fuzz_service.proto) of typed or raw calls, made in order over an
// in-process channel rather than to the handlers directly: the Generate and TreeSearch handlers
// then run with real streams, every request passes through the server's own request parsing
// (proto/request_parsing.h), and cancellation and deadlines reach the handlers as from a client.
//
// Invariants, per call: no status is INTERNAL, UNKNOWN or DATA_LOSS, and every error has a
// message; responses are well formed (token ids in the vocabulary, nothing streamed for a branch
// after its finish). Per input: once every tree the session saw is deleted, the scheduler is
// idle: no trees, no branches, no requests, and every KV page free or evictable cache.
//
// The tokenizer shim and ASan. This binary is ASan-instrumented and links gRPC's protobuf;
// sentencepiece carries its own protobuf runtime, so the shim must be loaded with RTLD_DEEPBIND
// (models/tokenizer.h), which ASan's dlopen interceptor refuses. LLVMFuzzerInitialize therefore
// loads the shim first through libc's own dlopen, with RTLD_DEEPBIND; the tokenizer's later
// dlopen of the same file returns that handle. The shim frees what it allocates (its C ABI),
// so ASan sees consistent pairs; only operator new/delete pairs inside sentencepiece look
// mismatched to it (alloc_dealloc_mismatch is off below).
#include <dlfcn.h>
#include <google/protobuf/descriptor.h>
#include <google/protobuf/dynamic_message.h>
#include <google/protobuf/stubs/logging.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "engine/backend.h"
#include "models/llama_weights.h"
#include "models/model_config.h"
#include "models/safetensors.h"
#include "models/tokenizer.h"
#include "scheduler/scheduler.h"
#include "server/config.h"
#include "server/treeserve_service.h"
#include "tests/fuzz/fuzz_service.pb.h"
#include "tests/fuzz/fuzz_util.h"
#include "tests/fuzz/proto_mutator.h"

extern "C" const char* __asan_default_options() { return "alloc_dealloc_mismatch=0"; }

// gRPC's sync server starts and ends worker threads as load changes; a leak check that stops
// the process while one of them is exiting sees its thread objects unreferenced.
extern "C" const char* __lsan_default_suppressions() {
  return "leak:grpc::ThreadManager\n"
         "leak:grpc_core::Thread::Thread\n"
         "leak:__cxa_thread_atexit_impl\n";
}

namespace {

namespace pb = google::protobuf;
using treeserve::fuzz::check;
using treeserve::fuzz::fail;

constexpr int kMaxCalls = 16;   // calls per input; the rest are ignored
constexpr int kMaxReads = 256;  // responses read per call before the client cancels it
constexpr size_t kMaxIds = 64;  // ids remembered per kind

// The server under test; built once, shared by every input.
struct Served {
  treeserve::TreeserveConfig config;
  std::unique_ptr<treeserve::Tokenizer> tokenizer;
  std::unique_ptr<treeserve::Backend> backend;
  std::unique_ptr<treeserve::Scheduler> scheduler;
  std::unique_ptr<treeserve::TreeServeService> service;
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<grpc::GenericStub> stub;
  const pb::ServiceDescriptor* api = nullptr;
};
Served* served = nullptr;
bool verbose = false;  // TREESERVE_FUZZ_VERBOSE=1: one line per call (to read a reproducer)

void load_shim_with_deepbind() {
  using DlopenFn = void* (*)(const char*, int);
  auto libc_dlopen = reinterpret_cast<DlopenFn>(dlsym(RTLD_NEXT, "dlopen"));
  if (libc_dlopen == nullptr) fail("no libc dlopen");
  if (libc_dlopen(TREESERVE_SPM_SHIM_PATH, RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND) == nullptr) {
    fail(std::string("cannot load the tokenizer shim: ") + dlerror());
  }
  setenv("TREESERVE_SPM_SHIM", TREESERVE_SPM_SHIM_PATH, 1);
}

// Limits small enough that the fuzzer reaches every one of them quickly.
treeserve::TreeserveConfig fuzz_config() {
  treeserve::TreeserveConfig c;
  c.server.max_request_bytes = 4096;
  c.kv_cache.page_size = 4;
  c.limits.max_prompt_tokens = 48;
  c.limits.max_n = 4;
  c.limits.max_tokens = 6;
  c.limits.max_verify_tokens = 12;
  c.limits.max_stop_strings = 3;
  c.limits.max_live_trees = 6;
  c.scheduler.max_step_tokens = 32;
  c.scheduler.max_step_rows = 24;
  c.scheduler.default_max_tokens = 3;
  // Short leases: a tree whose CreateTree the client gave up on just as the server finished it
  // (a race no server can close: the response is already on its way) is never named again and
  // goes when its lease runs out (check_idle_after_cleanup).
  c.server.tree_lease_default_s = 1;
  c.server.tree_lease_max_s = 1;
  return c;
}

constexpr int64_t kPages = 40;          // 160 tokens of KV
constexpr int64_t kContextTokens = 64;  // the served context (the model's is 2048)

void build_server() {
  served = new Served;
  Served& s = *served;
  s.config = fuzz_config();
  check(treeserve::validate_config(s.config).ok(), "the fuzz config is valid");
  const std::string dir = TREESERVE_TINY_MODEL_DIR;
  auto model = treeserve::load_model_config(dir);
  auto reader = treeserve::SafetensorsReader::open_dir(dir);
  check(model.ok() && reader.ok(), "the tiny model loads");
  auto weights = treeserve::load_llama_weights(*model, *reader);
  check(weights.ok(), "the tiny model's weights map");
  treeserve::CpuBackendOptions co;
  co.num_pages = kPages;
  co.page_size = s.config.kv_cache.page_size;
  co.num_threads = 1;
  auto backend = treeserve::create_cpu_backend(*model, *weights, co);
  check(backend.ok(), "the CPU backend starts");
  s.backend = std::move(*backend);
  auto tokenizer = treeserve::Tokenizer::load(dir + "/tokenizer.model");
  if (!tokenizer.ok()) fail("the tiny tokenizer loads: " + tokenizer.status().ToString());
  s.tokenizer = std::move(*tokenizer);

  treeserve::SchedulerOptions so;
  so.max_live_trees = s.config.limits.max_live_trees;
  so.max_step_tokens = s.config.scheduler.max_step_tokens;
  so.max_step_rows = s.config.scheduler.max_step_rows;
  so.default_max_tokens = s.config.scheduler.default_max_tokens;
  so.prefix_sharing = s.config.kv_cache.prefix_sharing;
  so.max_sequence_tokens = kContextTokens;
  auto scheduler = treeserve::Scheduler::create(s.backend.get(), s.tokenizer.get(), so, nullptr);
  check(scheduler.ok(), "the scheduler starts");
  s.scheduler = std::move(*scheduler);

  treeserve::ServingInfo info;
  info.model_name = "tiny-llama";
  info.backend = "cpu";
  info.page_size = s.config.kv_cache.page_size;
  info.kv_pages_total = kPages;
  info.max_sequence_tokens = kContextTokens;
  s.service = std::make_unique<treeserve::TreeServeService>(s.config, s.tokenizer.get(), info,
                                                            s.scheduler.get());
  grpc::ServerBuilder builder;
  builder.SetMaxReceiveMessageSize(s.config.server.max_request_bytes * 2 + (1 << 20));
  builder.RegisterService(s.service.get());
  s.server = builder.BuildAndStart();
  check(s.server != nullptr, "the in-process server starts");
  s.stub = std::make_unique<grpc::GenericStub>(s.server->InProcessChannel({}));
  s.api = pb::DescriptorPool::generated_pool()->FindServiceByName("treeserve.v1.TreeServe");
  check(s.api != nullptr, "the TreeServe descriptor");
}

// The ids a session has seen, for "$N" references.
struct Ids {
  std::vector<std::string> trees;
  std::vector<std::string> branches;
  std::set<std::string> all_trees;  // every tree id, to delete at the end
  int abandoned_creates = 0;        // CreateTree calls the client cancelled or let time out

  static void add(std::vector<std::string>* pool, const std::string& id) {
    if (id.empty() || pool->size() >= kMaxIds) return;
    for (const std::string& have : *pool) {
      if (have == id) return;
    }
    pool->push_back(id);
  }
  void add_tree(const std::string& id) {
    add(&trees, id);
    if (!id.empty()) all_trees.insert(id);
  }
  std::string resolve(const std::string& ref, bool tree) const {
    if (ref.empty() || ref[0] != '$') return ref;
    const std::vector<std::string>& pool = tree ? trees : branches;
    if (pool.empty()) return "";
    return pool[std::strtoul(ref.c_str() + 1, nullptr, 10) % pool.size()];
  }
};

bool names_tree(const pb::FieldDescriptor* f) {
  return f->name().find("tree") != std::string::npos;
}

// Replaces "$N" references in every id field of m (fuzz_service.proto).
void resolve_ids(pb::Message* m, const Ids& ids) {
  const pb::Descriptor* d = m->GetDescriptor();
  const pb::Reflection* r = m->GetReflection();
  for (int i = 0; i < d->field_count(); ++i) {
    const pb::FieldDescriptor* f = d->field(i);
    if (f->cpp_type() == pb::FieldDescriptor::CPPTYPE_MESSAGE) {
      if (f->is_repeated()) {
        for (int j = 0; j < r->FieldSize(*m, f); ++j) {
          resolve_ids(r->MutableRepeatedMessage(m, f, j), ids);
        }
      } else if (r->HasField(*m, f)) {
        resolve_ids(r->MutableMessage(m, f), ids);
      }
      continue;
    }
    if (!treeserve::fuzz::is_id_field(f)) continue;
    const bool tree = names_tree(f);
    if (f->is_repeated()) {
      for (int j = 0; j < r->FieldSize(*m, f); ++j) {
        r->SetRepeatedString(m, f, j, ids.resolve(r->GetRepeatedString(*m, f, j), tree));
      }
    } else {
      r->SetString(m, f, ids.resolve(r->GetString(*m, f), tree));
    }
  }
}

// Remembers every id a response names (tree_id, *branch_id*, branch_ids).
void collect_ids(const pb::Message& m, Ids* ids) {
  const pb::Descriptor* d = m.GetDescriptor();
  const pb::Reflection* r = m.GetReflection();
  for (int i = 0; i < d->field_count(); ++i) {
    const pb::FieldDescriptor* f = d->field(i);
    if (f->cpp_type() == pb::FieldDescriptor::CPPTYPE_MESSAGE) {
      if (f->is_repeated()) {
        for (int j = 0; j < r->FieldSize(m, f); ++j)
          collect_ids(r->GetRepeatedMessage(m, f, j), ids);
      } else if (r->HasField(m, f)) {
        collect_ids(r->GetMessage(m, f), ids);
      }
      continue;
    }
    if (!treeserve::fuzz::is_id_field(f)) continue;
    auto add = [&](const std::string& id) {
      if (names_tree(f)) {
        ids->add_tree(id);
      } else {
        Ids::add(&ids->branches, id);
      }
    };
    if (f->is_repeated()) {
      for (int j = 0; j < r->FieldSize(m, f); ++j) add(r->GetRepeatedString(m, f, j));
    } else {
      add(r->GetString(m, f));
    }
  }
}

void check_status(const grpc::Status& s, const std::string& method) {
  if (s.ok()) return;
  const auto code = s.error_code();
  if (code == grpc::StatusCode::INTERNAL || code == grpc::StatusCode::UNKNOWN ||
      code == grpc::StatusCode::DATA_LOSS || s.error_message().empty()) {
    fail(method + " answered code " + std::to_string(int(code)) + " '" + s.error_message() +
         "': bad input gets a clear status naming the field");
  }
}

// Per-response checks that need no request.
struct StreamCheck {
  std::set<std::string> finished;  // Generate: branches whose last message came

  void on_response(const pb::Message& m) {
    const int32_t vocab = served->tokenizer->vocab_size();
    if (auto* g = dynamic_cast<const treeserve::v1::GenerateResponse*>(&m)) {
      check(!g->branch_id().empty(), "a Generate message names its branch");
      check(g->token_id() >= 0 && g->token_id() < vocab, "streamed tokens are in the vocabulary");
      check(!finished.count(g->branch_id()), "nothing streams for a branch after its finish");
      if (g->finish_reason() != treeserve::v1::FINISH_NONE) finished.insert(g->branch_id());
    } else if (auto* t = dynamic_cast<const treeserve::v1::TokenizeResponse*>(&m)) {
      for (int32_t id : t->ids()) check(id >= 0 && id < vocab, "Tokenize ids in the vocabulary");
    } else if (auto* c = dynamic_cast<const treeserve::v1::CreateTreeResponse*>(&m)) {
      check(!c->tree_id().empty() && !c->root_branch_id().empty(), "CreateTree names its ids");
      check(c->cached_tokens() >= 0 && c->cached_tokens() <= c->prompt_tokens(),
            "cached tokens are part of the prompt");
    } else if (auto* i = dynamic_cast<const treeserve::v1::ServerInfo*>(&m)) {
      check(i->kv_pages_free() >= 0 && i->kv_pages_evictable() >= 0 &&
                i->kv_pages_free() + i->kv_pages_evictable() <= i->kv_pages_total(),
            "free + evictable pages <= total");
    } else if (auto* v = dynamic_cast<const treeserve::v1::VerifyResponse*>(&m)) {
      check(v->bonus_token() >= 0 && v->bonus_token() < vocab, "the bonus token is a token");
    }
  }
};

// One call: its request messages (typed ones resolved just before they are sent) to one
// method, responses read until the server ends the call.
class CallRunner {
 public:
  CallRunner(const pb::MethodDescriptor* method, Ids* ids) : method_(method), ids_(ids) {}

  void run(const std::vector<const pb::Message*>& typed, const std::vector<std::string>& raw,
           const treeserve::fuzz::Call& call) {
    const auto t0 = std::chrono::steady_clock::now();
    const std::string name = "/" + served->api->full_name() + "/" + method_->name();
    grpc::ClientContext ctx;
    if (call.has_deadline_ms()) {
      ctx.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::milliseconds(call.deadline_ms() % 200));
    }
    grpc::CompletionQueue cq;
    auto stream = served->stub->PrepareCall(&ctx, name, &cq);
    stream->StartCall(tag());
    const bool started = wait(cq);
    const bool bidi = method_->client_streaming();
    const size_t n_messages = bidi ? std::max(typed.size(), raw.size()) : 1;
    size_t sent = 0;
    bool open = started;
    auto close = [&] {
      if (!open) return;
      stream->WritesDone(tag());
      wait(cq);
      open = false;
    };
    auto send_next = [&] {
      if (!open) return;
      if (sent >= n_messages) {
        close();
        return;
      }
      std::string bytes;
      if (sent < typed.size()) {
        std::unique_ptr<pb::Message> m(typed[sent]->New());
        m->CopyFrom(*typed[sent]);
        resolve_ids(m.get(), *ids_);
        m->SerializeToString(&bytes);
      } else if (sent < raw.size()) {
        bytes = raw[sent];
      }
      ++sent;
      grpc::Slice slice(bytes);
      grpc::ByteBuffer buffer(&slice, 1);
      stream->Write(buffer, tag());
      open = wait(cq);
      if (!bidi) close();  // one message, then half-close
    };
    send_next();

    StreamCheck checks;
    uint32_t reads = 0;
    const pb::Message* prototype =
        pb::MessageFactory::generated_factory()->GetPrototype(method_->output_type());
    for (;;) {
      if ((call.has_cancel_after() && reads == call.cancel_after()) || reads == kMaxReads) {
        ctx.TryCancel();
      }
      grpc::ByteBuffer buffer;
      stream->Read(&buffer, tag());
      if (!wait(cq)) break;
      ++reads;
      std::vector<grpc::Slice> slices;
      check(buffer.Dump(&slices).ok(), "a response buffer dumps");
      std::string bytes;
      for (const grpc::Slice& s : slices)
        bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
      std::unique_ptr<pb::Message> response(prototype->New());
      check(response->ParseFromString(bytes), "responses parse");
      collect_ids(*response, ids_);
      checks.on_response(*response);
      if (bidi) send_next();
    }
    grpc::Status status;
    stream->Finish(&status, tag());
    wait(cq);
    cq.Shutdown();
    void* ignored_tag;
    bool ignored_ok;
    while (cq.Next(&ignored_tag, &ignored_ok)) {
    }
    if (verbose) {
      const double ms =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      std::fprintf(stderr, "%s: %u responses in %.1f ms, status %d '%s'\n", method_->name().c_str(),
                   reads, ms, int(status.error_code()), status.error_message().c_str());
    }
    const bool client_ended =
        (call.has_cancel_after() || call.has_deadline_ms() || reads >= kMaxReads) &&
        (status.error_code() == grpc::StatusCode::CANCELLED ||
         status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED);
    if (!client_ended) check_status(status, method_->name());
    if (client_ended && method_->name() == "CreateTree") ++ids_->abandoned_creates;
  }

 private:
  static void* tag() { return reinterpret_cast<void*>(1); }
  static bool wait(grpc::CompletionQueue& cq) {
    void* got = nullptr;
    bool ok = false;
    check(cq.Next(&got, &ok), "the completion queue delivers");
    return ok;
  }

  const pb::MethodDescriptor* method_;
  Ids* ids_;
};

// The call's request(s) and method: a typed request goes to the method that takes its type,
// TreeSearch gets its list of messages, a raw call its bytes.
void run_call(const treeserve::fuzz::Call& call, Ids* ids) {
  const pb::ServiceDescriptor* api = served->api;
  std::vector<const pb::Message*> typed;
  std::vector<std::string> raw;
  const pb::MethodDescriptor* target = nullptr;
  if (call.has_raw()) {
    target = api->method(int(call.raw().method() % uint32_t(api->method_count())));
    raw.assign(call.raw().messages().begin(), call.raw().messages().end());
  } else if (call.has_tree_search()) {
    target = api->FindMethodByName("TreeSearch");
    for (const auto& m : call.tree_search().messages()) typed.push_back(&m);
  } else {
    const pb::OneofDescriptor* oneof = call.GetDescriptor()->FindOneofByName("call");
    const pb::FieldDescriptor* field = call.GetReflection()->GetOneofFieldDescriptor(call, oneof);
    if (field == nullptr) return;
    for (int i = 0; i < api->method_count() && target == nullptr; ++i) {
      if (api->method(i)->input_type() == field->message_type()) target = api->method(i);
    }
    typed = {&call.GetReflection()->GetMessage(call, field)};
  }
  check(target != nullptr, "every call names a TreeServe method");
  CallRunner(target, ids).run(typed, raw, call);
}

// Deletes every tree the session saw, then waits (briefly: the loop may still be finishing a
// cancelled step) for the scheduler to be idle with every page free or evictable.
void check_idle_after_cleanup(Ids* ids) {
  for (const std::string& tree : ids->all_trees) {
    treeserve::v1::DeleteTreeRequest request;
    request.set_tree_id(tree);
    treeserve::fuzz::Call call;
    *call.mutable_delete_tree() = request;
    run_call(call, ids);
  }
  treeserve::SchedulerStats st;
  auto idle = [&] {
    st = served->scheduler->stats();
    return st.live_trees == 0 && st.live_branches == 0 && st.running_requests == 0 &&
           st.waiting_requests == 0 &&
           st.kv_pages_free + st.kv_pages_evictable == st.kv_pages_total;
  };
  // The loop may still be finishing a cancelled step; a call the client cancelled before its
  // handler ran may still start (gRPC delivers it late) and run until it sees the
  // cancellation; and each abandoned CreateTree may have left a tree nobody can name, until its
  // lease (1 s here) runs out. So the server counts as idle once it has stayed idle for
  // kSettled, and the verdict is that of the wait, not of a later look.
  constexpr auto kSettled = std::chrono::milliseconds(100);
  auto settles = [&](int ms) {
    const auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
    auto idle_since = std::chrono::steady_clock::time_point::max();
    for (;;) {
      const auto now = std::chrono::steady_clock::now();
      if (!idle()) {
        idle_since = std::chrono::steady_clock::time_point::max();
      } else if (idle_since == std::chrono::steady_clock::time_point::max()) {
        idle_since = now;
      } else if (now - idle_since >= kSettled) {
        return true;
      }
      if (now >= end) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  };
  bool settled = settles(2000);
  if (!settled && st.live_trees <= ids->abandoned_creates) settled = settles(3000);
  if (!settled) {
    fail("not idle once every tree is deleted: trees=" + std::to_string(st.live_trees) +
         " (abandoned CreateTree calls: " + std::to_string(ids->abandoned_creates) + ")" +
         " branches=" + std::to_string(st.live_branches) + " running=" +
         std::to_string(st.running_requests) + " waiting=" + std::to_string(st.waiting_requests) +
         " pages free=" + std::to_string(st.kv_pages_free) + " evictable=" +
         std::to_string(st.kv_pages_evictable) + " total=" + std::to_string(st.kv_pages_total));
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // Inputs that do not parse, and requests the server refuses, would log a line each.
  pb::SetLogHandler([](pb::LogLevel, const char*, int, const std::string&) {});
  setenv("GRPC_VERBOSITY", "NONE", 1);
  const char* v = std::getenv("TREESERVE_FUZZ_VERBOSE");
  verbose = v != nullptr && *v != '\0' && *v != '0';
  load_shim_with_deepbind();
  build_server();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  treeserve::fuzz::Session session;
  if (!session.ParseFromArray(data, int(size))) return -1;  // not a session: keep it out
  Ids ids;
  int calls = 0;
  for (const treeserve::fuzz::Call& call : session.calls()) {
    if (++calls > kMaxCalls) break;
    run_call(call, &ids);
  }
  check_idle_after_cleanup(&ids);
  return 0;
}

// Structure-aware mutation (proto_mutator.h); an input that does not parse starts over.
extern "C" size_t LLVMFuzzerCustomMutator(uint8_t* data, size_t size, size_t max_size,
                                          unsigned int seed) {
  treeserve::fuzz::Session session;
  if (!session.ParseFromArray(data, int(size))) session.Clear();
  treeserve::fuzz::ProtoMutator mutator(seed);
  const int changes = 1 + int(seed % 3);
  for (int i = 0; i < changes; ++i) mutator.mutate(&session);
  std::string out = session.SerializeAsString();
  if (out.size() > max_size) return size;  // too big: leave it for another try
  std::copy(out.begin(), out.end(), data);
  return out.size();
}

// Splices two sessions: a prefix of one's calls and a suffix of the other's.
extern "C" size_t LLVMFuzzerCustomCrossOver(const uint8_t* data1, size_t size1,
                                            const uint8_t* data2, size_t size2, uint8_t* out,
                                            size_t max_out_size, unsigned int seed) {
  treeserve::fuzz::Session a, b, joined;
  if (!a.ParseFromArray(data1, int(size1)) || !b.ParseFromArray(data2, int(size2))) return 0;
  std::mt19937 rng(seed);
  const int cut_a = a.calls_size() ? int(rng() % (a.calls_size() + 1)) : 0;
  const int cut_b = b.calls_size() ? int(rng() % (b.calls_size() + 1)) : 0;
  for (int i = 0; i < cut_a; ++i) *joined.add_calls() = a.calls(i);
  for (int i = cut_b; i < b.calls_size(); ++i) *joined.add_calls() = b.calls(i);
  const std::string bytes = joined.SerializeAsString();
  if (bytes.size() > max_out_size) return 0;
  std::copy(bytes.begin(), bytes.end(), out);
  return bytes.size();
}
