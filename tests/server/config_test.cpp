// Config presets: strict parsing, CLI-free validation, and the shipped presets load.
#include "server/config.h"

#include <gtest/gtest.h>

#include <filesystem>

#include "models/quantization.h"

namespace treeserve {
namespace {

TEST(Config, DefaultsAreValid) {
  TreeserveConfig c;
  EXPECT_TRUE(validate_config(c).ok());
  EXPECT_EQ(c.server.listen, "127.0.0.1:50051");
  EXPECT_EQ(c.kv_cache.page_size, 16);
}

TEST(Config, MergeOverridesOnlyGivenKeys) {
  TreeserveConfig c;
  ASSERT_TRUE(
      merge_config_json(R"({"kv_cache": {"page_size": 32}, "log_level": "debug"})", "x.json", &c)
          .ok());
  EXPECT_EQ(c.kv_cache.page_size, 32);
  EXPECT_EQ(c.log_level, "debug");
  EXPECT_EQ(c.server.listen, "127.0.0.1:50051");
}

TEST(Config, SchedulerSection) {
  TreeserveConfig c;
  ASSERT_TRUE(
      merge_config_json(R"({"scheduler": {"max_step_tokens": 128, "default_max_tokens": 64}})",
                        "s.json", &c)
          .ok());
  EXPECT_EQ(c.scheduler.max_step_tokens, 128);
  EXPECT_EQ(c.scheduler.default_max_tokens, 64);
  EXPECT_TRUE(validate_config(c).ok());
  c.scheduler.default_max_tokens = c.limits.max_tokens + 1;
  EXPECT_NE(validate_config(c).message().find("scheduler.default_max_tokens"), std::string::npos);
  c.scheduler.default_max_tokens = 16;
  c.scheduler.max_step_tokens = 0;
  EXPECT_NE(validate_config(c).message().find("scheduler.max_step_tokens"), std::string::npos);
  Status s = merge_config_json(R"({"scheduler": {"chunk": 3}})", "t.json", &c);
  EXPECT_NE(s.message().find("scheduler.chunk"), std::string::npos) << s.message();
}

// Tree leases (server.tree_lease_*_s) and the TreeSearch score wait: defaults, parsing, and
// ranges named by key.
TEST(Config, LeasesAndScoreTimeout) {
  TreeserveConfig c;
  EXPECT_EQ(c.server.tree_lease_default_s, 600);
  EXPECT_EQ(c.server.tree_lease_max_s, 86400);
  EXPECT_EQ(c.limits.tree_search_score_timeout_ms, 60000);
  ASSERT_TRUE(merge_config_json(R"({"server": {"tree_lease_default_s": 5, "tree_lease_max_s": 60},
                                    "limits": {"tree_search_score_timeout_ms": 250}})",
                                "l.json", &c)
                  .ok());
  EXPECT_EQ(c.server.tree_lease_default_s, 5);
  EXPECT_EQ(c.server.tree_lease_max_s, 60);
  EXPECT_EQ(c.limits.tree_search_score_timeout_ms, 250);
  EXPECT_TRUE(validate_config(c).ok());
  TreeserveConfig back;
  ASSERT_TRUE(merge_config_json(config_to_json(c), "dump", &back).ok());
  EXPECT_EQ(back.server.tree_lease_max_s, 60);
  EXPECT_EQ(back.limits.tree_search_score_timeout_ms, 250);
  c.server.tree_lease_default_s = 61;  // over the maximum
  EXPECT_NE(validate_config(c).message().find("server.tree_lease_default_s"), std::string::npos);
  c.server.tree_lease_default_s = 0;
  EXPECT_NE(validate_config(c).message().find("server.tree_lease_default_s"), std::string::npos);
  c.server.tree_lease_default_s = 5;
  c.server.tree_lease_max_s = 0;
  EXPECT_NE(validate_config(c).message().find("server.tree_lease_max_s"), std::string::npos);
  c.server.tree_lease_max_s = 60;
  c.limits.tree_search_score_timeout_ms = 0;
  EXPECT_NE(validate_config(c).message().find("limits.tree_search_score_timeout_ms"),
            std::string::npos);
}

// server.replica_id: "local" by default, read and written back, its format checked by name.
TEST(Config, ReplicaId) {
  TreeserveConfig c;
  EXPECT_EQ(c.server.replica_id, "local");
  ASSERT_TRUE(merge_config_json(R"({"server": {"replica_id": "r-2"}})", "r.json", &c).ok());
  EXPECT_EQ(c.server.replica_id, "r-2");
  EXPECT_TRUE(validate_config(c).ok());
  TreeserveConfig back;
  ASSERT_TRUE(merge_config_json(config_to_json(c), "dump", &back).ok());
  EXPECT_EQ(back.server.replica_id, "r-2");
  for (const char* bad : {"", "R2", "r_2", "-r2", "r.2"}) {
    c.server.replica_id = bad;
    const Status s = validate_config(c);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_EQ(s.message().rfind("server.replica_id (--replica-id): must be 1 to 32 characters", 0),
              0u)
        << s.message();
  }
}

TEST(Config, ErrorsNameTheKeyAndSource) {
  TreeserveConfig c;
  Status s = merge_config_json(R"({"limits": {"max_n": "many"}})", "a.json", &c);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("limits.max_n"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("a.json"), std::string::npos);

  s = merge_config_json(R"({"servr": {}})", "b.json", &c);
  EXPECT_NE(s.message().find("unknown key servr"), std::string::npos) << s.message();

  s = merge_config_json(R"({"server": 3})", "c.json", &c);
  EXPECT_NE(s.message().find("server must be an object"), std::string::npos) << s.message();

  s = merge_config_json("[1, 2", "d.json", &c);
  EXPECT_NE(s.message().find("invalid JSON"), std::string::npos) << s.message();
}

// Found by tests/fuzz (fuzz_server_config): a number too large for a double escaped as an
// uncaught exception (the server aborted), and an integer field took a fraction, a boolean or an
// out-of-range value by converting it (1e21 into an int32: undefined behaviour).
TEST(Config, IntegerFieldsTakeOnlyIntegersInRange) {
  TreeserveConfig c;
  Status s = merge_config_json(R"({"kv_cache": {"page_size": 1e999}})", "e.json", &c);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("e.json: invalid JSON"), std::string::npos) << s.message();
  for (const char* value : {"1844674407370955161516", "2.5", "true", "4294967312", "-2147483649",
                            "18446744073709551615"}) {
    c = TreeserveConfig{};
    s = merge_config_json(std::string(R"({"kv_cache": {"page_size": )") + value + "}}", "f.json",
                          &c);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << value;
    EXPECT_NE(s.message().find("f.json: kv_cache.page_size must be an integer in "
                               "[-2147483648, 2147483647], got"),
              std::string::npos)
        << s.message();
    EXPECT_EQ(c.kv_cache.page_size, TreeserveConfig{}.kv_cache.page_size) << value;
  }
  ASSERT_TRUE(merge_config_json(R"({"kv_cache": {"page_size": 32, "memory_bytes": 8589934592},
                                    "model": {"random_weights_seed": -1}})",
                                "g.json", &c)
                  .ok());
  EXPECT_EQ(c.kv_cache.page_size, 32);
  EXPECT_EQ(c.kv_cache.memory_bytes, int64_t{8} << 30);
  EXPECT_EQ(c.model.random_weights_seed, -1);
}

TEST(Config, ValidationCatchesRanges) {
  TreeserveConfig c;
  c.kv_cache.page_size = 0;
  EXPECT_NE(validate_config(c).message().find("page_size"), std::string::npos);
  c = {};
  c.kv_cache.page_size = 257;
  EXPECT_FALSE(validate_config(c).ok());
  c = {};
  c.engine.backend = "gpu";
  EXPECT_NE(validate_config(c).message().find("backend"), std::string::npos);
  c = {};
  c.log_level = "loud";
  EXPECT_NE(validate_config(c).message().find("log_level"), std::string::npos);
  c = {};
  c.limits.max_n = 0;
  EXPECT_FALSE(validate_config(c).ok());
  c = {};
  c.model.random_weights_seed = -2;
  EXPECT_NE(validate_config(c).message().find("model.random_weights_seed"), std::string::npos);
  c = {};
  c.engine.attention = "flat";
  EXPECT_NE(validate_config(c).message().find("engine.attention"), std::string::npos);
}

TEST(Config, AttentionScheduleAndTheNoSharingPreset) {
  TreeserveConfig c;
  EXPECT_EQ(c.engine.attention, "tree");
  ASSERT_TRUE(merge_config_json(R"({"engine": {"attention": "baseline"}})", "a.json", &c).ok());
  EXPECT_EQ(c.engine.attention, "baseline");
  EXPECT_TRUE(validate_config(c).ok());
  EXPECT_TRUE(c.engine.cuda_graphs);
  ASSERT_TRUE(merge_config_json(R"({"engine": {"cuda_graphs": false}})", "b.json", &c).ok());
  EXPECT_FALSE(c.engine.cuda_graphs);
  EXPECT_EQ(c.engine.attention, "baseline");  // merged, not reset
  EXPECT_FALSE(merge_config_json(R"({"engine": {"cuda_graphs": "yes"}})", "c.json", &c).ok());
  EXPECT_TRUE(c.engine.gemm_autotune);
  ASSERT_TRUE(merge_config_json(R"({"engine": {"gemm_autotune": false}})", "d.json", &c).ok());
  EXPECT_FALSE(c.engine.gemm_autotune);
  EXPECT_FALSE(c.engine.cuda_graphs);  // merged, not reset
  EXPECT_NE(config_to_json(c).find("\"gemm_autotune\":false"), std::string::npos);
  EXPECT_FALSE(merge_config_json(R"({"engine": {"gemm_autotune": 1}})", "e.json", &c).ok());
  EXPECT_TRUE(c.engine.p2p_all_reduce);
  ASSERT_TRUE(merge_config_json(R"({"engine": {"p2p_all_reduce": false}})", "f.json", &c).ok());
  EXPECT_FALSE(c.engine.p2p_all_reduce);
  EXPECT_NE(config_to_json(c).find("\"p2p_all_reduce\":false"), std::string::npos);
  EXPECT_FALSE(merge_config_json(R"({"engine": {"p2p_all_reduce": "no"}})", "g.json", &c).ok());
  // Prefix sharing off, for comparisons: no radix reuse and prefix-unaware attention.
  TreeserveConfig off;
  ASSERT_TRUE(
      load_config_file(std::string(TREESERVE_SOURCE_DIR) + "/configs/server/no-prefix-sharing.json",
                       &off)
          .ok());
  EXPECT_FALSE(off.kv_cache.prefix_sharing);
  EXPECT_EQ(off.engine.attention, "baseline");
}

TEST(Config, GemmSplitK) {
  TreeserveConfig c;
  EXPECT_EQ(c.engine.gemm_split_k, 0);  // auto
  EXPECT_NE(config_to_json(c).find("\"gemm_split_k\":0"), std::string::npos);
  ASSERT_TRUE(merge_config_json(R"({"engine": {"gemm_split_k": 2}})", "s.json", &c).ok());
  EXPECT_EQ(c.engine.gemm_split_k, 2);
  EXPECT_TRUE(validate_config(c).ok());
  EXPECT_TRUE(c.engine.p2p_all_reduce);  // merged, not reset
  TreeserveConfig back;
  ASSERT_TRUE(merge_config_json(config_to_json(c), "dump", &back).ok());
  EXPECT_EQ(back.engine.gemm_split_k, 2);
  for (int32_t ok : {0, 1, 8}) {
    c.engine.gemm_split_k = ok;
    EXPECT_TRUE(validate_config(c).ok()) << ok;
  }
  for (int32_t bad : {-1, 9, 64}) {
    c.engine.gemm_split_k = bad;
    const Status s = validate_config(c);
    EXPECT_NE(s.message().find("engine.gemm_split_k must be in [0, 8]"), std::string::npos)
        << bad << ": " << s.message();
  }
  Status s = merge_config_json(R"({"engine": {"gemm_split_k": "auto"}})", "t.json", &c);
  EXPECT_NE(s.message().find("engine.gemm_split_k"), std::string::npos) << s.message();
}

TEST(Config, RandomWeightsSeed) {
  TreeserveConfig c;
  EXPECT_EQ(c.model.random_weights_seed, -1);  // off by default
  ASSERT_TRUE(merge_config_json(R"({"model": {"random_weights_seed": 7}})", "r.json", &c).ok());
  EXPECT_EQ(c.model.random_weights_seed, 7);
  EXPECT_TRUE(validate_config(c).ok());
  TreeserveConfig back;
  ASSERT_TRUE(merge_config_json(config_to_json(c), "dump", &back).ok());
  EXPECT_EQ(back.model.random_weights_seed, 7);
  Status s = merge_config_json(R"({"model": {"random_weights_seed": "x"}})", "r.json", &c);
  EXPECT_NE(s.message().find("model.random_weights_seed"), std::string::npos) << s.message();
}

TEST(Config, Quantization) {
  TreeserveConfig c;
  EXPECT_EQ(c.model.quantization, "auto");  // the checkpoint's own
  for (const char* ok : {"auto", "none", "fp8"}) {
    ASSERT_TRUE(merge_config_json(std::string(R"({"model": {"quantization": ")") + ok + "\"}}",
                                  "q.json", &c)
                    .ok());
    EXPECT_EQ(c.model.quantization, ok);
    EXPECT_TRUE(validate_config(c).ok()) << ok;
  }
  TreeserveConfig back;
  ASSERT_TRUE(merge_config_json(config_to_json(c), "dump", &back).ok());
  EXPECT_EQ(back.model.quantization, "fp8");
  c.model.quantization = "int4";
  Status s = validate_config(c);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("--quantization"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("'int4'"), std::string::npos) << s.message();
}

TEST(Config, KvCacheDtype) {
  TreeserveConfig c;
  EXPECT_EQ(c.kv_cache.dtype, "auto");  // the model's dtype
  EXPECT_TRUE(validate_config(c).ok());
  for (const char* ok : {"auto", "fp8", "fp8_e4m3"}) {
    ASSERT_TRUE(
        merge_config_json(std::string(R"({"kv_cache": {"dtype": ")") + ok + "\"}}", "kv.json", &c)
            .ok());
    EXPECT_EQ(c.kv_cache.dtype, ok);
    EXPECT_TRUE(validate_config(c).ok()) << ok;
  }
  TreeserveConfig back;
  ASSERT_TRUE(merge_config_json(config_to_json(c), "dump", &back).ok());
  EXPECT_EQ(back.kv_cache.dtype, "fp8_e4m3");
  EXPECT_EQ(*parse_kv_cache_dtype("fp8", "x"), KvCacheDtype::kFp8E4m3);
  EXPECT_EQ(*parse_kv_cache_dtype("fp8_e4m3", "x"), KvCacheDtype::kFp8E4m3);
  EXPECT_EQ(*parse_kv_cache_dtype("auto", "x"), KvCacheDtype::kAuto);

  c.kv_cache.dtype = "fp8_e5m2";
  Status s = validate_config(c);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(),
            "kv_cache.dtype (--kv-cache-dtype) 'fp8_e5m2' is not supported: only e4m3 is (fp8 or "
            "fp8_e4m3, with one float32 scale per token and kv head)");
  for (const char* bad : {"int8", "", "FP8", "fp16", "e4m3"}) {
    c.kv_cache.dtype = bad;
    s = validate_config(c);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_EQ(s.message(), std::string("kv_cache.dtype (--kv-cache-dtype) must be auto, fp8 or "
                                       "fp8_e4m3, got '") +
                               bad + "'");
  }
  s = merge_config_json(R"({"kv_cache": {"dtype": 8}})", "kv.json", &c);
  EXPECT_NE(s.message().find("kv_cache.dtype has the wrong type"), std::string::npos)
      << s.message();
}

TEST(Config, ListenAddresses) {
  for (const char* ok : {"127.0.0.1:50051", "0.0.0.0:0", "[::1]:8080", "localhost:1"}) {
    EXPECT_TRUE(validate_listen_address(ok, "listen").ok()) << ok;
  }
  for (const char* bad : {"", "127.0.0.1", ":80", "127.0.0.1:", "127.0.0.1:65536", "::1:80",
                          "[::1:80", "host:8x", "a b:80"}) {
    Status s = validate_listen_address(bad, "listen");
    EXPECT_FALSE(s.ok()) << bad;
    EXPECT_NE(s.message().find("not a valid listen address"), std::string::npos) << bad;
  }
}

TEST(Config, ShippedPresetsLoadAndValidate) {
  int n = 0;
  for (const auto& entry :
       std::filesystem::directory_iterator(std::string(TREESERVE_SOURCE_DIR) + "/configs/server")) {
    TreeserveConfig c;
    Status s = load_config_file(entry.path().string(), &c);
    ASSERT_TRUE(s.ok()) << entry.path() << ": " << s.message();
    EXPECT_TRUE(validate_config(c).ok()) << entry.path();
    ++n;
  }
  EXPECT_GE(n, 2);
}

TEST(Config, JsonDumpReparses) {
  TreeserveConfig c;
  c.kv_cache.page_size = 64;
  c.server.auth_token = "secret";
  std::string dumped = config_to_json(c);
  EXPECT_EQ(dumped.find("secret"), std::string::npos);  // never log the token
  TreeserveConfig back;
  ASSERT_TRUE(merge_config_json(dumped, "dump", &back).ok());
  EXPECT_EQ(back.kv_cache.page_size, 64);
}

TEST(Config, HttpListener) {
  TreeserveConfig c;
  EXPECT_TRUE(c.server.http_listen.empty());  // off unless asked for
  ASSERT_TRUE(
      merge_config_json(R"({"server": {"http_listen": "127.0.0.1:8000", "http_threads": 8}})",
                        "h.json", &c)
          .ok());
  EXPECT_EQ(c.server.http_listen, "127.0.0.1:8000");
  EXPECT_EQ(c.server.http_threads, 8);
  EXPECT_TRUE(validate_config(c).ok());
  c.server.http_listen = "8000";
  EXPECT_NE(validate_config(c).message().find("http_listen '8000' is not a valid listen address"),
            std::string::npos);
  c.server.http_listen = "[::1]:8000";
  c.server.http_threads = 0;
  EXPECT_NE(validate_config(c).message().find("server.http_threads must be in [1, 4096]"),
            std::string::npos);
  EXPECT_FALSE(merge_config_json(R"({"server": {"http_threads": "many"}})", "h.json", &c).ok());
}

}  // namespace
}  // namespace treeserve
