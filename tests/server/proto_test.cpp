// The generated API messages round-trip through the wire format with every field intact.
#include <gtest/gtest.h>

#include "proto/treeserve.pb.h"

namespace treeserve::v1 {
namespace {

TEST(Proto, GenerateRequestRoundTrip) {
  GenerateRequest req;
  req.set_tree_id("t1");
  req.add_branch_ids("b1");
  req.add_branch_ids("b2");
  req.mutable_append()->mutable_tokens()->add_ids(7);
  req.set_n(4);
  auto* s = req.mutable_sampling();
  s->set_temperature(0.7f);
  s->set_top_p(0.9f);
  s->set_top_k(40);
  s->set_seed(1234567890123ull);
  s->set_max_tokens(32);
  s->add_stop("\n\n");
  s->add_stop_token_ids(2);
  s->set_logprobs(5);

  std::string wire = req.SerializeAsString();
  GenerateRequest back;
  ASSERT_TRUE(back.ParseFromString(wire));
  EXPECT_EQ(back.SerializeAsString(), wire);
  EXPECT_EQ(back.branch_ids(1), "b2");
  EXPECT_EQ(back.append().content_case(), Prompt::kTokens);
  EXPECT_EQ(back.append().tokens().ids(0), 7);
  EXPECT_FLOAT_EQ(back.sampling().top_p(), 0.9f);
  EXPECT_EQ(back.sampling().seed(), 1234567890123ull);
  EXPECT_EQ(back.sampling().stop(0), "\n\n");
}

TEST(Proto, PromptOneofKeepsTheLastSet) {
  Prompt p;
  p.mutable_tokens()->add_ids(1);
  p.set_text("hello");
  EXPECT_EQ(p.content_case(), Prompt::kText);
  Prompt back;
  ASSERT_TRUE(back.ParseFromString(p.SerializeAsString()));
  EXPECT_EQ(back.text(), "hello");
  EXPECT_FALSE(back.has_tokens());
}

TEST(Proto, ResponsesAndEnumsRoundTrip) {
  GenerateResponse r;
  r.set_branch_id("b");
  r.set_token_id(42);
  r.set_text(" tree");
  r.set_logprob(-0.25f);
  auto* t = r.add_top_logprobs();
  t->set_token_id(43);
  t->set_logprob(-1.5f);
  r.set_finish_reason(FINISH_CANCELLED);
  GenerateResponse back;
  ASSERT_TRUE(back.ParseFromString(r.SerializeAsString()));
  EXPECT_EQ(back.finish_reason(), FINISH_CANCELLED);
  EXPECT_EQ(back.top_logprobs(0).token_id(), 43);

  VerifyRequest v;
  for (int i = 0; i < 4; ++i) {
    v.add_tokens(100 + i);
    v.add_parents(i - 1);
  }
  VerifyRequest vb;
  ASSERT_TRUE(vb.ParseFromString(v.SerializeAsString()));
  EXPECT_EQ(vb.parents(0), -1);
  EXPECT_EQ(vb.tokens(3), 103);

  ServerInfo info;
  info.set_kv_pages_total(1ll << 40);
  ServerInfo ib;
  ASSERT_TRUE(ib.ParseFromString(info.SerializeAsString()));
  EXPECT_EQ(ib.kv_pages_total(), 1ll << 40);
}

TEST(Proto, ServiceHasEveryContractMethod) {
  const auto* service = google::protobuf::DescriptorPool::generated_pool()->FindServiceByName(
      "treeserve.v1.TreeServe");
  ASSERT_NE(service, nullptr);
  for (const char* m : {"CreateTree", "Branch", "Generate", "Prune", "Verify", "GetTree",
                        "DeleteTree", "Tokenize", "Detokenize", "GetServerInfo"}) {
    EXPECT_NE(service->FindMethodByName(m), nullptr) << m;
  }
  EXPECT_TRUE(service->FindMethodByName("Generate")->server_streaming());
}

}  // namespace
}  // namespace treeserve::v1
