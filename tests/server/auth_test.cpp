// Authenticator: keys -> principals, the failure status and count, the key sources and their
// checks, the loopback test of listen addresses.
#include "server/auth.h"

#include <gtest/gtest.h>

namespace treeserve {
namespace {

std::unique_ptr<Authenticator> make(const std::string& token, const char* env,
                                    MetricsRegistry* registry = nullptr) {
  ServerOptions options;
  options.auth_token = token;
  auto auth = Authenticator::create(options, env, registry);
  EXPECT_TRUE(auth.ok()) << auth.status().message();
  return auth.ok() ? std::move(*auth) : nullptr;
}

StatusOr<Principal> call(Authenticator* auth, const char* authorization) {
  std::string_view value = authorization != nullptr ? authorization : "";
  return auth->authenticate(authorization != nullptr ? &value : nullptr, "ipv4:10.0.0.9:5000",
                            "/treeserve.v1.TreeServe/GetTree");
}

TEST(Auth, WithoutKeysEveryCallIsTheDefaultTenant) {
  auto auth = make("", nullptr);
  EXPECT_FALSE(auth->enabled());
  EXPECT_EQ(auth->source(), "");
  for (const char* header : {static_cast<const char*>(nullptr), "Bearer anything", "junk"}) {
    StatusOr<Principal> who = call(auth.get(), header);
    ASSERT_TRUE(who.ok());
    EXPECT_EQ(who->tenant, "default");
  }
  EXPECT_EQ(auth->failures(), 0);
}

TEST(Auth, TheTokenAuthenticatesAsTheDefaultTenant) {
  MetricsRegistry registry;
  auto auth = make("s3cret", nullptr, &registry);
  EXPECT_TRUE(auth->enabled());
  EXPECT_EQ(auth->source(), "server.auth_token");
  for (const char* ok : {"Bearer s3cret", "bearer s3cret", "BEARER   s3cret"}) {
    StatusOr<Principal> who = call(auth.get(), ok);
    ASSERT_TRUE(who.ok()) << ok;
    EXPECT_EQ(who->tenant, "default");
  }
  struct Case {
    const char* header;
    const char* message;
  };
  for (const Case& c :
       {Case{nullptr, "missing authorization metadata"}, Case{"Bearer wrong", "invalid auth token"},
        Case{"Bearer s3cret2", "invalid auth token"}, Case{"Bearer s3cre", "invalid auth token"},
        Case{"s3cret", "must be 'Bearer <token>'"},
        Case{"Basic s3cret", "must be 'Bearer <token>'"},
        Case{"Bearer ", "must be 'Bearer <token>'"}}) {
    StatusOr<Principal> who = call(auth.get(), c.header);
    ASSERT_FALSE(who.ok()) << (c.header ? c.header : "(none)");
    EXPECT_EQ(who.status().code(), StatusCode::kUnauthenticated);
    EXPECT_NE(who.status().message().find(c.message), std::string::npos) << who.status().message();
  }
  EXPECT_EQ(auth->failures(), 7);
  EXPECT_NE(registry.render().find("treeserve:auth_failures_total 7"), std::string::npos)
      << registry.render();
  auth->record_failure("a client", "the TLS handshake", "peer did not return a certificate");
  EXPECT_EQ(auth->failures(), 8);
}

TEST(Auth, KeyFromTheEnvironment) {
  auto auth = make("", "from-env");
  EXPECT_TRUE(auth->enabled());
  EXPECT_EQ(auth->source(), "$TREESERVE_API_KEY");
  EXPECT_TRUE(call(auth.get(), "Bearer from-env").ok());
  EXPECT_FALSE(call(auth.get(), "Bearer other").ok());
}

TEST(Auth, BadKeySourcesAreStartUpErrors) {
  ServerOptions options;
  options.auth_token = "a";
  auto both = Authenticator::create(options, "b", nullptr);
  ASSERT_FALSE(both.ok());
  EXPECT_NE(both.status().message().find("are both set"), std::string::npos);
  auto empty_env = Authenticator::create(ServerOptions{}, "", nullptr);
  ASSERT_FALSE(empty_env.ok());
  EXPECT_NE(empty_env.status().message().find("$TREESERVE_API_KEY is set but empty"),
            std::string::npos)
      << empty_env.status().message();
  options.auth_token = "two words";
  auto spaced = Authenticator::create(options, nullptr, nullptr);
  ASSERT_FALSE(spaced.ok());
  EXPECT_NE(spaced.status().message().find("server.auth_token must not contain whitespace"),
            std::string::npos)
      << spaced.status().message();
}

TEST(Auth, LoopbackAddresses) {
  for (const char* a : {"127.0.0.1:50051", "127.1.2.3:1", "[::1]:50051", "localhost:9400"}) {
    EXPECT_TRUE(is_loopback_listen_address(a)) << a;
  }
  for (const char* a :
       {"0.0.0.0:50051", "[::]:50051", "10.1.2.3:50051", "example.com:443", "128.0.0.1:1"}) {
    EXPECT_FALSE(is_loopback_listen_address(a)) << a;
  }
}

}  // namespace
}  // namespace treeserve
