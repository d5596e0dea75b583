// End-to-end: the server's edge against the real binary over loopback. TLS and mutual TLS
// (a CA, server and client certificates made with `openssl` at test time), HTTPS metrics,
// keys for reflection and /metrics, the failed-authentication log and metric, the API key
// from the environment, the non-loopback warning, readiness while the model loads, the codes
// of requests that do not parse or name empty ids, and the byte bounds on text (a 15 MB prompt
// refused in milliseconds without growing the server's memory).
#include <grpcpp/generic/generic_stub.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <thread>

#include "proto/treeserve.grpc.pb.h"
#include "tests/common/temp_dir.h"
#include "tests/e2e/health.grpc.pb.h"
#include "tests/e2e/server_process.h"

#ifndef TREESERVE_TINY_MODEL_DIR
#error "TREESERVE_TINY_MODEL_DIR must name the tiny model's build directory"
#endif

namespace treeserve::testing {
namespace {

namespace v1 = ::treeserve::v1;
namespace fs = std::filesystem;
using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

std::string read_text(const fs::path& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string write_temp(const std::string& name, const std::string& content) {
  const fs::path path = fs::path(treeserve::testing_support::test_temp_dir()) / name;
  std::ofstream(path) << content;
  return path.string();
}

// A CA ("ca"), another CA that signed nothing here ("other"), a server certificate for
// localhost / 127.0.0.1 and a client certificate, both signed by "ca"; EC P-256 keys.
class Pki {
 public:
  static const Pki& get() {
    static Pki pki;
    return pki;
  }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  std::string pem(const std::string& name) const { return read_text(dir_ / name); }
  ~Pki() {
    std::error_code ignored;
    fs::remove_all(dir_, ignored);
  }

 private:
  // One directory per test process: ctest runs this binary's tests as parallel processes.
  Pki()
      : dir_(fs::path(treeserve::testing_support::test_temp_dir()) /
             ("treeserve-pki-" + std::to_string(getpid()))) {
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    const std::string d = dir_.string();
    const std::string key = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
    auto run = [](const std::string& cmd) {
      ASSERT_EQ(std::system((cmd + " >/dev/null 2>&1").c_str()), 0) << cmd;
    };
    for (const char* ca : {"ca", "other"}) {
      run("openssl req -x509 " + key + " -keyout " + d + "/" + ca + ".key -out " + d + "/" + ca +
          ".crt -days 2 -subj /CN=treeserve-test-" + ca);
    }
    auto leaf = [&](const std::string& name, const std::string& san) {
      std::ofstream(dir_ / (name + ".ext")) << "subjectAltName=" << san << "\n";
      run("openssl req " + key + " -keyout " + d + "/" + name + ".key -out " + d + "/" + name +
          ".csr -subj /CN=" + name);
      run("openssl x509 -req -in " + d + "/" + name + ".csr -CA " + d + "/ca.crt -CAkey " + d +
          "/ca.key -CAcreateserial -days 2 -out " + d + "/" + name + ".crt -extfile " + d + "/" +
          name + ".ext");
    };
    leaf("server", "DNS:localhost,IP:127.0.0.1");
    leaf("client", "DNS:treeserve-test-client");
  }
  fs::path dir_;
};

std::shared_ptr<grpc::ChannelCredentials> tls_credentials(const std::string& ca,
                                                          bool client_cert = false) {
  const Pki& pki = Pki::get();
  grpc::SslCredentialsOptions options;
  options.pem_root_certs = pki.pem(ca + ".crt");
  if (client_cert) {
    options.pem_private_key = pki.pem("client.key");
    options.pem_cert_chain = pki.pem("client.crt");
  }
  return grpc::SslCredentials(options);
}

std::vector<std::string> tls_args(bool mutual = false) {
  const Pki& pki = Pki::get();
  std::vector<std::string> args = {"--backend",  "cpu",
                                   "--tls-cert", pki.path("server.crt"),
                                   "--tls-key",  pki.path("server.key")};
  if (mutual) {
    args.push_back("--tls-client-ca");
    args.push_back(pki.path("ca.crt"));
  }
  return args;
}

grpc::Status server_info(const std::shared_ptr<grpc::Channel>& channel,
                         const std::string& key = "") {
  auto stub = v1::TreeServe::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(3));
  if (!key.empty()) ctx.AddMetadata("authorization", "Bearer " + key);
  v1::ServerInfo info;
  return stub->GetServerInfo(&ctx, {}, &info);
}

grpc::health::v1::HealthCheckResponse::ServingStatus health(
    const std::shared_ptr<grpc::Channel>& channel, grpc::Status* status = nullptr) {
  auto stub = grpc::health::v1::Health::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(3));
  grpc::health::v1::HealthCheckResponse resp;
  grpc::Status s = stub->Check(&ctx, {}, &resp);
  if (status != nullptr) *status = s;
  return resp.status();
}

// One call of any kind with raw request bytes (a generic bidi call: unary and streaming calls
// look the same on the wire): each request is sent as is, then the responses are read.
struct RawResult {
  grpc::Status status;
  std::vector<std::string> responses;
};

RawResult raw_call_slices(const std::shared_ptr<grpc::Channel>& channel, const std::string& method,
                          const std::vector<grpc::Slice>& requests, const std::string& key = "") {
  grpc::GenericStub stub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  if (!key.empty()) ctx.AddMetadata("authorization", "Bearer " + key);
  grpc::CompletionQueue cq;
  void* tag = nullptr;
  bool ok = false;
  auto wait = [&] { return cq.Next(&tag, &ok) && ok; };
  RawResult out;
  auto call = stub.PrepareCall(&ctx, method, &cq);
  call->StartCall(reinterpret_cast<void*>(1));
  if (wait()) {
    for (const grpc::Slice& slice : requests) {
      grpc::ByteBuffer buffer(&slice, 1);
      call->Write(buffer, reinterpret_cast<void*>(2));
      if (!wait()) break;
    }
    call->WritesDone(reinterpret_cast<void*>(3));
    wait();
    for (;;) {
      grpc::ByteBuffer buffer;
      call->Read(&buffer, reinterpret_cast<void*>(4));
      if (!wait()) break;
      std::vector<grpc::Slice> slices;
      (void)buffer.Dump(&slices);
      std::string bytes;
      for (const grpc::Slice& s : slices) {
        bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
      }
      out.responses.push_back(bytes);
    }
  }
  call->Finish(&out.status, reinterpret_cast<void*>(5));
  cq.Next(&tag, &ok);
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
  return out;
}

RawResult raw_call(const std::shared_ptr<grpc::Channel>& channel, const std::string& method,
                   const std::vector<std::string>& requests, const std::string& key = "") {
  std::vector<grpc::Slice> slices;
  for (const std::string& r : requests) slices.emplace_back(r);
  return raw_call_slices(channel, method, slices, key);
}

// The serialized message with every "@BAD@" replaced by 5 bytes that are not UTF-8.
std::string with_bad_utf8(const google::protobuf::Message& message) {
  std::string bytes = message.SerializeAsString();
  for (size_t at = bytes.find("@BAD@"); at != std::string::npos; at = bytes.find("@BAD@", at)) {
    bytes.replace(at, 5, "\xff\xfe\xc3\x28\x80");
  }
  return bytes;
}

constexpr char kMethod[] = "/treeserve.v1.TreeServe/";
constexpr char kReflection[] = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo";
constexpr char kListServices[] = "\x3a\x00";  // ServerReflectionRequest{list_services: ""}

std::string list_services_request() { return std::string(kListServices, 2); }

int64_t rss_kib(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6));
  }
  return -1;
}

// Waits until the server's output holds `text`; false after timeout_s.
bool wait_for_output(const ServerProcess& server, const std::string& text, int timeout_s = 60) {
  const auto end = Clock::now() + std::chrono::seconds(timeout_s);
  while (Clock::now() < end) {
    if (server.output().find(text) != std::string::npos) return true;
    std::this_thread::sleep_for(milliseconds(20));
  }
  return false;
}

size_t count_of(const std::string& haystack, const std::string& needle) {
  size_t n = 0;
  for (size_t at = haystack.find(needle); at != std::string::npos;
       at = haystack.find(needle, at + 1)) {
    ++n;
  }
  return n;
}

// ---- TLS ----

TEST(Tls, RightCaSucceedsWrongCaAndPlaintextFail) {
  ServerProcess server(tls_args(), tls_credentials("ca"));
  ASSERT_TRUE(server.wait_ready()) << server.output();
  EXPECT_NE(server.output().find("(port "), std::string::npos);
  EXPECT_NE(server.output().find(", TLS, auth off)"), std::string::npos) << server.output();
  EXPECT_TRUE(server_info(server.channel()).ok());
  EXPECT_EQ(health(server.channel()), grpc::health::v1::HealthCheckResponse::SERVING);

  auto wrong_ca = grpc::CreateChannel(server.address(), tls_credentials("other"));
  EXPECT_EQ(server_info(wrong_ca).error_code(), grpc::StatusCode::UNAVAILABLE);
  auto plaintext = grpc::CreateChannel(server.address(), grpc::InsecureChannelCredentials());
  EXPECT_EQ(server_info(plaintext).error_code(), grpc::StatusCode::UNAVAILABLE);
  // The system's CAs did not sign the test certificate either.
  auto system_roots =
      grpc::CreateChannel(server.address(), grpc::SslCredentials(grpc::SslCredentialsOptions()));
  EXPECT_EQ(server_info(system_roots).error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(server.terminate(), 0) << server.output();
}

TEST(Tls, MutualTlsRefusesClientsWithoutACertificateTheCaSigned) {
  ServerProcess server(tls_args(/*mutual=*/true), tls_credentials("ca", /*client_cert=*/true));
  ASSERT_TRUE(server.wait_ready()) << server.output();
  EXPECT_TRUE(server_info(server.channel()).ok());
  auto no_cert = grpc::CreateChannel(server.address(), tls_credentials("ca"));
  EXPECT_EQ(server_info(no_cert).error_code(), grpc::StatusCode::UNAVAILABLE);
  // A certificate from a CA the server does not trust: "other" signs a client key here.
  const Pki& pki = Pki::get();
  grpc::SslCredentialsOptions foreign;
  foreign.pem_root_certs = pki.pem("ca.crt");
  foreign.pem_private_key = pki.pem("other.key");
  foreign.pem_cert_chain = pki.pem("other.crt");
  auto foreign_cert = grpc::CreateChannel(server.address(), grpc::SslCredentials(foreign));
  EXPECT_EQ(server_info(foreign_cert).error_code(), grpc::StatusCode::UNAVAILABLE);
  // Refused handshakes are failed authentications: logged and counted.
  EXPECT_TRUE(wait_for_output(server, "auth: refused the TLS handshake", 10)) << server.output();
  EXPECT_EQ(server.terminate(), 0) << server.output();
}

TEST(Tls, MetricsOverHttps) {
  signal(SIGPIPE, SIG_IGN);  // the HTTPS clients here write to sockets the server closes
  const int port = pick_free_port();
  std::vector<std::string> args = tls_args(/*mutual=*/true);
  args.push_back("--metrics-listen");
  args.push_back("127.0.0.1:" + std::to_string(port));
  ServerProcess server(args, tls_credentials("ca", true));
  ASSERT_TRUE(server.wait_ready()) << server.output();
  const Pki& pki = Pki::get();
  {
    httplib::SSLClient https("127.0.0.1", port, pki.path("client.crt"), pki.path("client.key"));
    https.set_ca_cert_path(pki.path("ca.crt"));
    https.enable_server_certificate_verification(true);
    auto res = https.Get("/metrics");
    ASSERT_TRUE(res) << httplib::to_string(res.error()) << server.output();
    EXPECT_EQ(res->status, 200);
    EXPECT_NE(res->body.find("treeserve:auth_failures_total"), std::string::npos);
  }
  {
    httplib::SSLClient wrong_ca("127.0.0.1", port, pki.path("client.crt"), pki.path("client.key"));
    wrong_ca.set_ca_cert_path(pki.path("other.crt"));
    wrong_ca.enable_server_certificate_verification(true);
    EXPECT_FALSE(wrong_ca.Get("/metrics"));
  }
  {
    httplib::SSLClient no_client_cert("127.0.0.1", port);
    no_client_cert.set_ca_cert_path(pki.path("ca.crt"));
    no_client_cert.enable_server_certificate_verification(true);
    EXPECT_FALSE(no_client_cert.Get("/metrics"));
  }
  {
    httplib::Client plain("127.0.0.1", port);
    auto res = plain.Get("/metrics");
    EXPECT_TRUE(!res || res->status != 200);
  }
  EXPECT_EQ(server.terminate(), 0) << server.output();
}

TEST(Tls, BadFilesStopTheServerNamingKeyAndPath) {
  const Pki& pki = Pki::get();
  auto start = [](std::vector<std::string> args) {
    args.insert(args.begin(), {"--backend", "cpu"});
    return run_treeserve_to_exit(args);
  };
  auto r = start({"--tls-cert", "/nonexistent/server.crt", "--tls-key", pki.path("server.key")});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("server.tls_cert_file: cannot read '/nonexistent/server.crt'"),
            std::string::npos)
      << r.output;
  r = start({"--tls-cert", pki.path("server.crt"), "--tls-key", pki.path("client.key")});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("does not belong to the certificate"), std::string::npos) << r.output;
  const std::string junk = write_temp("junk.pem", "not a certificate\n");
  r = start({"--tls-cert", junk, "--tls-key", pki.path("server.key")});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("holds no PEM certificate"), std::string::npos) << r.output;
  r = start({"--tls-cert", pki.path("server.crt"), "--tls-key", junk});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("server.tls_key_file: '" + junk + "' holds no unencrypted PEM"),
            std::string::npos)
      << r.output;
  r = start({"--tls-cert", pki.path("server.crt")});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("go together"), std::string::npos) << r.output;
  r = start({"--tls-client-ca", pki.path("ca.crt")});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("server.tls_client_ca_file needs"), std::string::npos) << r.output;
  r = start({"--tls-cert", pki.path("server.crt"), "--tls-key", pki.path("server.key"),
             "--tls-client-ca", junk});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("server.tls_client_ca_file: '" + junk + "' holds no PEM"),
            std::string::npos)
      << r.output;
}

// ---- keys: reflection, /metrics, health, the log and the metric ----

class AuthE2E : public ::testing::Test {
 protected:
  static constexpr char kKey[] = "s3cret-key";
  static void SetUpTestSuite() {
    metrics_port_ = pick_free_port();
    const std::string config =
        write_temp("auth-e2e.json", std::string(R"({"server": {"auth_token": ")") + kKey +
                                        R"("}, "engine": {"backend": "cpu"}})");
    server_ = new ServerProcess(
        {"--config", config, "--metrics-listen", "127.0.0.1:" + std::to_string(metrics_port_)});
    ASSERT_TRUE(server_->wait_ready()) << server_->output();
  }
  static void TearDownTestSuite() {
    EXPECT_EQ(server_->terminate(), 0) << server_->output();
    delete server_;
    server_ = nullptr;
  }
  static std::string metrics(const std::string& key, int* status) {
    httplib::Client http("127.0.0.1", metrics_port_);
    httplib::Headers headers;
    if (!key.empty()) headers.emplace("Authorization", "Bearer " + key);
    auto res = http.Get("/metrics", headers);
    *status = res ? res->status : -1;
    return res ? res->body : "";
  }
  static double auth_failures() {
    int status = 0;
    const std::string body = metrics(kKey, &status);
    EXPECT_EQ(status, 200);
    const std::string name = "\ntreeserve:auth_failures_total ";
    const size_t at = body.find(name);
    return at == std::string::npos ? -1 : std::stod(body.substr(at + name.size()));
  }
  static inline ServerProcess* server_ = nullptr;
  static inline int metrics_port_ = 0;
};

TEST_F(AuthE2E, ReflectionNeedsTheKey) {
  RawResult none = raw_call(server_->channel(), kReflection, {list_services_request()});
  EXPECT_EQ(none.status.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_NE(none.status.error_message().find("missing authorization"), std::string::npos)
      << none.status.error_message();
  EXPECT_TRUE(none.responses.empty());
  RawResult wrong = raw_call(server_->channel(), kReflection, {list_services_request()}, "nope");
  EXPECT_EQ(wrong.status.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_TRUE(wrong.responses.empty());
  RawResult right = raw_call(server_->channel(), kReflection, {list_services_request()}, kKey);
  EXPECT_TRUE(right.status.ok()) << right.status.error_message();
  ASSERT_EQ(right.responses.size(), 1u);
  EXPECT_NE(right.responses[0].find("treeserve.v1.TreeServe"), std::string::npos);
}

TEST_F(AuthE2E, MetricsNeedTheKeyHealthDoesNot) {
  int status = 0;
  std::string body = metrics("", &status);
  EXPECT_EQ(status, 401);
  EXPECT_EQ(body.find("treeserve:"), std::string::npos);
  metrics("wrong", &status);
  EXPECT_EQ(status, 401);
  body = metrics(kKey, &status);
  EXPECT_EQ(status, 200);
  EXPECT_NE(body.find("# TYPE treeserve:auth_failures_total counter"), std::string::npos);
  // Health answers without a key.
  EXPECT_EQ(health(server_->channel()), grpc::health::v1::HealthCheckResponse::SERVING);
  // TreeServe calls need it.
  EXPECT_EQ(server_info(server_->channel()).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_TRUE(server_info(server_->channel(), kKey).ok());
}

TEST_F(AuthE2E, FailuresAreCountedAndLoggedAtMostOnceAFewSeconds) {
  // A fresh log window: the previous line is at least kAuthLogInterval (5 s) old.
  std::this_thread::sleep_for(milliseconds(5200));
  const double before = auth_failures();
  const size_t lines_before = count_of(server_->output(), "auth: refused");
  for (int i = 0; i < 30; ++i) {
    EXPECT_EQ(server_info(server_->channel(), i % 2 ? "wrong" : "").error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
  }
  EXPECT_EQ(auth_failures() - before, 30);
  std::string out = server_->output();
  EXPECT_EQ(count_of(out, "auth: refused") - lines_before, 1u) << out;
  EXPECT_NE(out.find("auth: refused /treeserve.v1.TreeServe/GetServerInfo from ipv4:127.0.0.1:"),
            std::string::npos)
      << out;
  // The next line, once the interval has passed, counts those it did not log.
  std::this_thread::sleep_for(milliseconds(5200));
  EXPECT_EQ(server_info(server_->channel()).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  out = server_->output();
  EXPECT_NE(out.find("(29 more refused calls not logged"), std::string::npos) << out;
}

TEST(Auth, WithoutKeysReflectionAndMetricsAreOpen) {
  const int port = pick_free_port();
  ServerProcess server(
      {"--backend", "cpu", "--metrics-listen", "127.0.0.1:" + std::to_string(port)});
  ASSERT_TRUE(server.wait_ready()) << server.output();
  RawResult r = raw_call(server.channel(), kReflection, {list_services_request()});
  EXPECT_TRUE(r.status.ok()) << r.status.error_message();
  httplib::Client http("127.0.0.1", port);
  auto res = http.Get("/metrics");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200);
  EXPECT_EQ(server.output().find("NO AUTHENTICATION"), std::string::npos);
  EXPECT_EQ(server.terminate(), 0) << server.output();
}

TEST(Auth, KeyFromTheEnvironment) {
  ::setenv("TREESERVE_API_KEY", "from-env", 1);
  ServerProcess server({"--backend", "cpu"});
  ::unsetenv("TREESERVE_API_KEY");
  ASSERT_TRUE(server.wait_ready()) << server.output();
  EXPECT_NE(server.output().find("auth by key from $TREESERVE_API_KEY"), std::string::npos)
      << server.output();
  EXPECT_EQ(server.output().find("from-env"), std::string::npos) << "the key is never logged";
  EXPECT_EQ(server_info(server.channel()).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_TRUE(server_info(server.channel(), "from-env").ok());
  EXPECT_EQ(server.terminate(), 0) << server.output();

  // Both the variable and server.auth_token: a start-up error.
  const std::string config = write_temp("auth-both.json", R"({"server": {"auth_token": "a"}})");
  ::setenv("TREESERVE_API_KEY", "b", 1);
  auto both = run_treeserve_to_exit({"--config", config, "--backend", "cpu"});
  ::unsetenv("TREESERVE_API_KEY");
  EXPECT_EQ(both.exit_code, 1) << both.output;
  EXPECT_NE(both.output.find("are both set"), std::string::npos) << both.output;
}

// A model directory with the tiny model's config and tokenizer but no weights: the server
// listens, then fails to load (exit 1), which is enough to read its start-up warnings.
std::string weightless_model() {
  const fs::path dir = fs::path(treeserve::testing_support::test_temp_dir()) / "weightless-model";
  fs::remove_all(dir);
  fs::create_directories(dir);
  const fs::path tiny = TREESERVE_TINY_MODEL_DIR;
  fs::copy_file(tiny / "config.json", dir / "config.json");
  fs::copy_file(tiny / "tokenizer.model", dir / "tokenizer.model");
  return dir.string();
}

TEST(Auth, NonLoopbackWithoutKeyWarnsLoudly) {
  const std::string model = weightless_model();
  auto open =
      run_treeserve_to_exit({"--model", model, "--backend", "cpu", "--listen", "0.0.0.0:0"});
  EXPECT_EQ(open.exit_code, 1) << open.output;
  EXPECT_NE(open.output.find("*** NO AUTHENTICATION: 0.0.0.0:0 is not a loopback address"),
            std::string::npos)
      << open.output;
  EXPECT_NE(open.output.find("--random-weights SEED"), std::string::npos) << open.output;

  const std::string config = write_temp("auth-any.json", R"({"server": {"auth_token": "k"}})");
  auto keyed = run_treeserve_to_exit(
      {"--model", model, "--backend", "cpu", "--listen", "0.0.0.0:0", "--config", config});
  EXPECT_EQ(keyed.output.find("NO AUTHENTICATION"), std::string::npos) << keyed.output;
  EXPECT_NE(keyed.output.find("TLS is off"), std::string::npos) << keyed.output;

  auto loopback = run_treeserve_to_exit({"--model", model, "--backend", "cpu"});
  EXPECT_EQ(loopback.output.find("NO AUTHENTICATION"), std::string::npos) << loopback.output;
}

TEST(Listener, AnAddressInUseIsAStartUpError) {
  ServerProcess first({"--backend", "cpu"});
  ASSERT_TRUE(first.wait_ready()) << first.output();
  auto second = run_treeserve_to_exit({"--backend", "cpu", "--listen", first.address()});
  EXPECT_EQ(second.exit_code, 1) << second.output;
  EXPECT_NE(second.output.find("cannot listen on " + first.address()), std::string::npos)
      << second.output;
  EXPECT_TRUE(server_info(first.channel()).ok());
  EXPECT_EQ(first.terminate(), 0) << first.output();
}

// ---- readiness ----

TEST(Readiness, NotServingWhileTheModelLoadsThenServing) {
  ::setenv("TREESERVE_LOAD_DELAY_MS", "3000", 1);
  ServerProcess server({"--backend", "cpu"});
  ::unsetenv("TREESERVE_LOAD_DELAY_MS");
  ASSERT_TRUE(wait_for_output(server, "listening on")) << server.output();
  grpc::Status status;
  EXPECT_EQ(health(server.channel(), &status), grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  EXPECT_TRUE(status.ok()) << status.error_message();
  grpc::Status loading = server_info(server.channel());
  EXPECT_EQ(loading.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_NE(loading.error_message().find("the model is loading"), std::string::npos)
      << loading.error_message();
  EXPECT_EQ(server.output().find(" ready: "), std::string::npos);

  ASSERT_TRUE(server.wait_ready()) << server.output();
  EXPECT_EQ(health(server.channel()), grpc::health::v1::HealthCheckResponse::SERVING);
  EXPECT_TRUE(server_info(server.channel()).ok());
  // Progress lines (stderr is a file here, not a terminal): stage, percent, GiB.
  const std::string out = server.output();
  EXPECT_NE(out.find("load: reading the checkpoint: 100% ("), std::string::npos) << out;
  EXPECT_NE(out.find("load: float32 weights for the cpu backend: 0% (0.0 of "), std::string::npos)
      << out;
  EXPECT_NE(out.find("load: float32 weights for the cpu backend: 100% ("), std::string::npos)
      << out;
  EXPECT_NE(out.find(" GiB, "), std::string::npos) << out;
  EXPECT_EQ(server.terminate(), 0) << server.output();
}

TEST(Readiness, ASignalWhileLoadingEndsTheProcess) {
  ::setenv("TREESERVE_LOAD_DELAY_MS", "60000", 1);
  ServerProcess server({"--backend", "cpu"});
  ::unsetenv("TREESERVE_LOAD_DELAY_MS");
  ASSERT_TRUE(wait_for_output(server, "listening on")) << server.output();
  const auto start = Clock::now();
  EXPECT_EQ(server.terminate(10), 0) << server.output();
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(5));
  EXPECT_NE(server.output().find("received SIGTERM while loading the model"), std::string::npos)
      << server.output();
}

// ---- codes: requests that do not parse, empty ids ----

class EdgeE2E : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    server_ = new ServerProcess({"--backend", "cpu"});
    ASSERT_TRUE(server_->wait_ready()) << server_->output();
  }
  static void TearDownTestSuite() {
    EXPECT_EQ(server_->terminate(), 0) << server_->output();
    delete server_;
    server_ = nullptr;
  }
  static void expect_invalid(const RawResult& r, const std::string& field) {
    EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << field << ": " << r.status.error_message();
    EXPECT_EQ(r.status.error_message().rfind(field + ": ", 0), 0u)
        << field << ": " << r.status.error_message();
  }
  static inline ServerProcess* server_ = nullptr;
};

TEST_F(EdgeE2E, InvalidUtf8IsInvalidArgumentNamingTheField) {
  auto call = [](const std::string& method, const google::protobuf::Message& m) {
    return raw_call(server_->channel(), kMethod + method, {with_bad_utf8(m)});
  };
  v1::TokenizeRequest tokenize;
  tokenize.set_text("ok @BAD@ ok");
  RawResult r = call("Tokenize", tokenize);
  expect_invalid(r, "text");
  EXPECT_NE(r.status.error_message().find("not valid UTF-8"), std::string::npos);

  v1::CreateTreeRequest create;
  create.mutable_prompt()->set_text("@BAD@");
  expect_invalid(call("CreateTree", create), "prompt.text");

  v1::GenerateRequest generate;  // server streaming
  generate.mutable_prompt()->set_text("fine");
  generate.mutable_sampling()->add_stop("fine");
  generate.mutable_sampling()->add_stop("@BAD@");
  expect_invalid(call("Generate", generate), "sampling.stop[1]");

  v1::PruneRequest prune;
  prune.set_tree_id("t");
  prune.add_branch_ids("b");
  prune.add_branch_ids("@BAD@");
  expect_invalid(call("Prune", prune), "branch_ids[1]");

  v1::TreeSearchRequest search;  // bidi streaming
  search.mutable_start()->set_tree_id("@BAD@");
  expect_invalid(call("TreeSearch", search), "start.tree_id");

  v1::GetTreeRequest get;
  get.set_tree_id("@BAD@");
  expect_invalid(call("GetTree", get), "tree_id");

  // A TreeSearch scores message (after the first level) whose map key is not UTF-8.
  {
    auto stub = v1::TreeServe::NewStub(server_->channel());
    grpc::ClientContext ctx;
    v1::CreateTreeRequest req;
    req.mutable_prompt()->set_text("Once upon a time");
    v1::CreateTreeResponse tree;
    ASSERT_TRUE(stub->CreateTree(&ctx, req, &tree).ok());
    v1::TreeSearchRequest start;
    start.mutable_start()->set_tree_id(tree.tree_id());
    start.mutable_start()->set_expand(2);
    start.mutable_start()->set_keep(1);
    start.mutable_start()->set_depth(1);
    start.mutable_start()->mutable_sampling()->set_max_tokens(2);
    start.mutable_start()->set_score_mode(v1::SCORE_CLIENT);
    v1::TreeSearchRequest scores;
    (*scores.mutable_scores()->mutable_scores())["@BAD@"] = 1.0f;
    RawResult r = raw_call(server_->channel(), std::string(kMethod) + "TreeSearch",
                           {start.SerializeAsString(), with_bad_utf8(scores)});
    expect_invalid(r, "scores.scores[0].key");
    EXPECT_EQ(r.responses.size(), 1u);  // the first level came before the scores
    grpc::ClientContext del_ctx;
    v1::DeleteTreeRequest del;
    del.set_tree_id(tree.tree_id());
    v1::DeleteTreeResponse freed;
    EXPECT_TRUE(stub->DeleteTree(&del_ctx, del, &freed).ok());
  }

  // Bytes that are no message at all, and a field cut short.
  r = raw_call(server_->channel(), std::string(kMethod) + "Tokenize", {std::string("\xff\xff")});
  expect_invalid(r, "request");
  r = raw_call(server_->channel(), std::string(kMethod) + "Tokenize",
               {std::string("\x0a\x05"
                            "ab")});
  expect_invalid(r, "text");
  EXPECT_NE(r.status.error_message().find("truncated"), std::string::npos);

  // The server still serves.
  EXPECT_TRUE(server_info(server_->channel()).ok());
}

TEST_F(EdgeE2E, EmptyIdsAreInvalidArgumentNamingTheField) {
  v1::BranchRequest branch;
  branch.set_n(1);
  branch.set_branch_id("b");
  v1::BranchRequest branch_no_branch = branch;
  branch_no_branch.set_tree_id("t");
  branch_no_branch.clear_branch_id();
  v1::GenerateRequest generate;
  generate.set_tree_id("t");
  generate.add_branch_ids("b");
  generate.add_branch_ids("");
  v1::PruneRequest prune;
  prune.add_branch_ids("b");
  v1::PruneRequest prune_empty_entry;
  prune_empty_entry.set_tree_id("t");
  prune_empty_entry.add_branch_ids("");
  v1::VerifyRequest verify;
  verify.add_tokens(5);
  verify.add_parents(-1);
  verify.set_branch_id("b");
  v1::VerifyRequest verify_no_branch = verify;
  verify_no_branch.set_tree_id("t");
  verify_no_branch.clear_branch_id();
  const v1::GetTreeRequest get_tree;
  const v1::DeleteTreeRequest delete_tree;
  struct Case {
    const char* method;
    const google::protobuf::Message& request;
    const char* field;
  };
  for (const Case& c :
       {Case{"Branch", branch, "tree_id"}, Case{"Branch", branch_no_branch, "branch_id"},
        Case{"Generate", generate, "branch_ids[1]"}, Case{"Prune", prune, "tree_id"},
        Case{"Prune", prune_empty_entry, "branch_ids[0]"}, Case{"Verify", verify, "tree_id"},
        Case{"Verify", verify_no_branch, "branch_id"}, Case{"GetTree", get_tree, "tree_id"},
        Case{"DeleteTree", delete_tree, "tree_id"}}) {
    RawResult r = raw_call(server_->channel(), std::string(kMethod) + c.method,
                           {c.request.SerializeAsString()});
    expect_invalid(r, c.field);
    EXPECT_NE(r.status.error_message().find("must not be empty"), std::string::npos)
        << c.method << ": " << r.status.error_message();
  }
  // A well-formed id that names nothing is still NOT_FOUND.
  v1::GetTreeRequest unknown;
  unknown.set_tree_id("no-such-tree");
  EXPECT_EQ(
      raw_call(server_->channel(), std::string(kMethod) + "GetTree", {unknown.SerializeAsString()})
          .status.error_code(),
      grpc::StatusCode::NOT_FOUND);
}

// ---- byte bounds on text ----

TEST_F(EdgeE2E, FifteenMegabyteTextIsRefusedFastWithoutGrowingTheServer) {
  ASSERT_TRUE(server_info(server_->channel()).ok());  // connected and warm
  // Each kind of text field, 15 MB: a prompt, an append, a stop string, Tokenize's text. The
  // requests are serialized before the clock starts: the time is the call's.
  const std::string huge(15'000'000, 'a');
  v1::CreateTreeRequest create;
  create.mutable_prompt()->set_text(huge);
  v1::GenerateRequest append;
  append.set_tree_id("t");
  append.add_branch_ids("b");
  append.mutable_append()->set_text(huge);
  v1::GenerateRequest stop;
  stop.mutable_prompt()->set_text("Once upon a time");
  stop.mutable_sampling()->add_stop(huge);
  v1::TokenizeRequest tokenize;
  tokenize.set_text(huge);
  struct Call {
    std::string what, method;
    grpc::Slice request;
  };
  const std::vector<Call> calls = {
      {"CreateTree prompt.text", "CreateTree", grpc::Slice(create.SerializeAsString())},
      {"Generate append.text", "Generate", grpc::Slice(append.SerializeAsString())},
      {"Generate sampling.stop[0]", "Generate", grpc::Slice(stop.SerializeAsString())},
      {"Tokenize text", "Tokenize", grpc::Slice(tokenize.SerializeAsString())}};
  const int64_t rss_before = rss_kib(server_->pid());
  ASSERT_GT(rss_before, 0);
  for (const Call& c : calls) {
    // The best of three, so that a busy test machine's scheduling does not decide.
    double best_ms = 1e9;
    for (int i = 0; i < 3; ++i) {
      const auto start = Clock::now();
      RawResult r = raw_call_slices(server_->channel(), kMethod + c.method, {c.request});
      best_ms = std::min(best_ms,
                         std::chrono::duration<double, std::milli>(Clock::now() - start).count());
      // Refused by the transport's receive limit (derived from the limits) before any parse.
      EXPECT_EQ(r.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
          << c.what << ": " << r.status.error_message();
      EXPECT_NE(r.status.error_message().find("larger than max"), std::string::npos)
          << c.what << ": " << r.status.error_message();
    }
    EXPECT_LT(best_ms, 50.0) << c.what;
    std::printf("%s: refused in %.1f ms (best of 3); server RSS %+.1f MiB so far\n", c.what.c_str(),
                best_ms, double(rss_kib(server_->pid()) - rss_before) / 1024);
  }
  std::this_thread::sleep_for(milliseconds(200));
  const int64_t rss_after = rss_kib(server_->pid());
  EXPECT_LT(rss_after - rss_before, 20 * 1024)
      << "RSS " << rss_before << " KiB -> " << rss_after << " KiB";
  EXPECT_TRUE(server_info(server_->channel()).ok());
}

TEST(Bounds, TextOverTheByteBoundIsInvalidArgumentBeforeTokenizing) {
  // 64 tokens: the text bound is 64 x the tiny tokenizer's longest piece (a few hundred
  // bytes); the request bound derives from it.
  const std::string config = write_temp(
      "bounds.json", R"({"limits": {"max_prompt_tokens": 64}, "engine": {"backend": "cpu"}})");
  ServerProcess server({"--config", config});
  ASSERT_TRUE(server.wait_ready()) << server.output();
  EXPECT_NE(server.output().find("(server.max_request_bytes, derived)"), std::string::npos)
      << server.output();
  auto stub = v1::TreeServe::NewStub(server.channel());
  const std::string long_text(4000, 'a');
  auto over = [](const grpc::Status& s, const std::string& field) {
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << field;
    EXPECT_EQ(s.error_message().rfind(field + ": 4000 bytes is over the limit of ", 0), 0u)
        << field << ": " << s.error_message();
  };
  {
    grpc::ClientContext ctx;
    v1::CreateTreeRequest req;
    req.mutable_prompt()->set_text(long_text);
    v1::CreateTreeResponse resp;
    over(stub->CreateTree(&ctx, req, &resp), "prompt.text");
  }
  {
    grpc::ClientContext ctx;
    v1::TokenizeRequest req;
    req.set_text(long_text);
    v1::TokenizeResponse resp;
    over(stub->Tokenize(&ctx, req, &resp), "text");
  }
  v1::CreateTreeResponse tree;
  {
    grpc::ClientContext ctx;
    v1::CreateTreeRequest req;
    req.mutable_prompt()->set_text("Once upon a time");
    ASSERT_TRUE(stub->CreateTree(&ctx, req, &tree).ok());
  }
  auto generate = [&](bool stop) {
    grpc::ClientContext ctx;
    v1::GenerateRequest req;
    req.set_tree_id(tree.tree_id());
    req.add_branch_ids(tree.root_branch_id());
    req.mutable_sampling()->set_max_tokens(1);
    if (stop) {
      req.mutable_sampling()->add_stop(long_text);
    } else {
      req.mutable_append()->set_text(long_text);
    }
    auto reader = stub->Generate(&ctx, req);
    v1::GenerateResponse resp;
    while (reader->Read(&resp)) {
    }
    return reader->Finish();
  };
  over(generate(false), "append.text");
  over(generate(true), "sampling.stop[0]");
  {
    // Over the derived request bound: the service's INVALID_ARGUMENT ("request: ...").
    grpc::ClientContext ctx;
    v1::TokenizeRequest req;
    req.set_text(std::string(200'000, 'a'));
    v1::TokenizeResponse resp;
    grpc::Status s = stub->Tokenize(&ctx, req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(s.error_message().find("over server.max_request_bytes"), std::string::npos)
        << s.error_message();
  }
  {
    grpc::ClientContext ctx;
    v1::DeleteTreeRequest req;
    req.set_tree_id(tree.tree_id());
    v1::DeleteTreeResponse resp;
    EXPECT_TRUE(stub->DeleteTree(&ctx, req, &resp).ok());
  }
  EXPECT_EQ(server.terminate(), 0) << server.output();
}

}  // namespace
}  // namespace treeserve::testing
