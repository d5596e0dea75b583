// TLS files: load_tls_material's checks (messages naming the key and the path), and the config
// keys and validation of TLS and of the request bound.
#include "server/tls.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "tests/common/temp_dir.h"

namespace treeserve {
namespace {

namespace fs = std::filesystem;

// A self-signed certificate and its key, a second key, with openssl.
class TlsFiles : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = fs::path(treeserve::testing_support::test_temp_dir()) / "treeserve-tls-unit";
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    const std::string d = dir_.string();
    const std::string ec = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
    ASSERT_EQ(std::system(("openssl req -x509 " + ec + " -keyout " + d + "/a.key -out " + d +
                           "/a.crt -days 1 -subj /CN=unit-a >/dev/null 2>&1")
                              .c_str()),
              0);
    ASSERT_EQ(std::system(("openssl req -x509 " + ec + " -keyout " + d + "/b.key -out " + d +
                           "/b.crt -days 1 -subj /CN=unit-b >/dev/null 2>&1")
                              .c_str()),
              0);
    std::ofstream(dir_ / "junk.pem") << "-----BEGIN NOTHING-----\n";
  }
  static std::string path(const char* name) { return (dir_ / name).string(); }
  static ServerOptions options(const char* cert, const char* key, const char* ca = "") {
    ServerOptions o;
    o.tls_cert_file = *cert ? path(cert) : "";
    o.tls_key_file = *key ? path(key) : "";
    o.tls_client_ca_file = *ca ? path(ca) : "";
    return o;
  }
  static inline fs::path dir_;
};

TEST_F(TlsFiles, NoCertificateMeansPlaintext) {
  auto tls = load_tls_material(ServerOptions{});
  ASSERT_TRUE(tls.ok());
  EXPECT_EQ(*tls, nullptr);
  EXPECT_NE(make_server_credentials(nullptr), nullptr);
}

TEST_F(TlsFiles, AMatchingPairLoads) {
  auto tls = load_tls_material(options("a.crt", "a.key"));
  ASSERT_TRUE(tls.ok()) << tls.status().message();
  ASSERT_NE(*tls, nullptr);
  EXPECT_FALSE((*tls)->mutual());
  EXPECT_NE((*tls)->subject.find("unit-a"), std::string::npos) << (*tls)->subject;
  EXPECT_NE((*tls)->cert_pem.find("BEGIN CERTIFICATE"), std::string::npos);
  auto mutual = load_tls_material(options("a.crt", "a.key", "b.crt"));
  ASSERT_TRUE(mutual.ok()) << mutual.status().message();
  EXPECT_TRUE((*mutual)->mutual());
  EXPECT_NE(make_server_credentials(mutual->get()), nullptr);
}

TEST_F(TlsFiles, ErrorsNameTheKeyAndThePath) {
  struct Case {
    ServerOptions options;
    std::string message;
  };
  ServerOptions missing = options("a.crt", "a.key");
  missing.tls_cert_file = "/nonexistent/a.crt";
  for (const Case& c :
       {Case{missing, "server.tls_cert_file: cannot read '/nonexistent/a.crt'"},
        Case{options("junk.pem", "a.key"),
             "server.tls_cert_file: '" + path("junk.pem") + "' holds no PEM certificate"},
        Case{options("a.crt", "junk.pem"),
             "server.tls_key_file: '" + path("junk.pem") + "' holds no unencrypted PEM"},
        Case{options("a.crt", "b.key"), "server.tls_key_file: the key in '" + path("b.key") +
                                            "' does not belong to the certificate in '" +
                                            path("a.crt") + "'"},
        Case{options("a.crt", "a.key", "junk.pem"),
             "server.tls_client_ca_file: '" + path("junk.pem") + "' holds no PEM certificate"}}) {
    auto tls = load_tls_material(c.options);
    ASSERT_FALSE(tls.ok()) << c.message;
    EXPECT_EQ(tls.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(tls.status().message().find(c.message), std::string::npos) << tls.status().message();
  }
}

TEST(TlsConfig, KeysParseAndValidate) {
  TreeserveConfig c;
  EXPECT_EQ(c.server.max_request_bytes, 0);  // derived at start
  ASSERT_TRUE(merge_config_json(R"({"server": {"tls_cert_file": "c.pem", "tls_key_file": "k.pem",
                                               "tls_client_ca_file": "ca.pem"}})",
                                "tls.json", &c)
                  .ok());
  EXPECT_EQ(c.server.tls_cert_file, "c.pem");
  EXPECT_EQ(c.server.tls_key_file, "k.pem");
  EXPECT_EQ(c.server.tls_client_ca_file, "ca.pem");
  EXPECT_TRUE(validate_config(c).ok());
  const std::string json = config_to_json(c);
  EXPECT_NE(json.find("\"tls_client_ca_file\":\"ca.pem\""), std::string::npos) << json;

  TreeserveConfig half;
  half.server.tls_cert_file = "c.pem";
  EXPECT_NE(validate_config(half).message().find("go together"), std::string::npos);
  TreeserveConfig ca_only;
  ca_only.server.tls_client_ca_file = "ca.pem";
  EXPECT_NE(validate_config(ca_only).message().find("server.tls_client_ca_file needs"),
            std::string::npos);
  TreeserveConfig small;
  small.server.max_request_bytes = 100;
  EXPECT_NE(validate_config(small).message().find("0 (derived) or at least 1024"),
            std::string::npos);
  small.server.max_request_bytes = 1024;
  EXPECT_TRUE(validate_config(small).ok());
}

}  // namespace
}  // namespace treeserve
