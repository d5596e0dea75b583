// Request parsing: the field a request that does not parse is blamed on, parse_request's
// status and the per-thread failure message, and the service base that reads every request.
#include "proto/request_parsing.h"

#include <gtest/gtest.h>

#include <algorithm>

#include "server/parsed_service.h"

namespace treeserve {
namespace {

// The serialized message with every "@BAD@" replaced by 5 bytes that are not UTF-8.
std::string with_bad_utf8(const google::protobuf::Message& message) {
  std::string bytes = message.SerializeAsString();
  for (size_t at = bytes.find("@BAD@"); at != std::string::npos; at = bytes.find("@BAD@", at)) {
    bytes.replace(at, 5, "\xff\xfe\xc3\x28\x80");
  }
  return bytes;
}

template <typename T>
std::string fault(const T& message) {
  return v1::describe_parse_failure(T::descriptor(), with_bad_utf8(message));
}

TEST(RequestParsing, NamesTheStringThatIsNotUtf8) {
  v1::CreateTreeRequest create;
  create.mutable_prompt()->set_text("ok @BAD@");
  EXPECT_EQ(fault(create).rfind("prompt.text: not valid UTF-8", 0), 0u) << fault(create);

  v1::GenerateRequest generate;
  generate.set_tree_id("t");
  generate.add_branch_ids("a");
  generate.add_branch_ids("b");
  generate.add_branch_ids("@BAD@");
  EXPECT_EQ(fault(generate).rfind("branch_ids[2]: ", 0), 0u) << fault(generate);
  generate.clear_branch_ids();
  generate.mutable_sampling()->add_stop("fine");
  generate.mutable_sampling()->add_stop("@BAD@");
  EXPECT_EQ(fault(generate).rfind("sampling.stop[1]: ", 0), 0u) << fault(generate);
  generate.mutable_append()->set_text("@BAD@");  // the first fault in wire order is named
  EXPECT_EQ(fault(generate).rfind("append.text: ", 0), 0u) << fault(generate);

  v1::TreeSearchRequest search;
  (*search.mutable_scores()->mutable_scores())["@BAD@"] = 1.0f;
  EXPECT_EQ(fault(search).rfind("scores.scores[0].key: ", 0), 0u) << fault(search);
  search.mutable_start()->set_branch_id("@BAD@");
  EXPECT_EQ(fault(search).rfind("start.branch_id: ", 0), 0u) << fault(search);
}

TEST(RequestParsing, TruncatedAndMalformedBytes) {
  const auto* d = v1::TokenizeRequest::descriptor();
  EXPECT_EQ(v1::describe_parse_failure(d, std::string("\x0a\x05"
                                                      "ab",
                                                      4))
                .rfind("text: truncated", 0),
            0u);
  EXPECT_EQ(v1::describe_parse_failure(d, "\xff\xff").rfind("request: ", 0), 0u);
  // A varint field cut short.
  const auto* b = v1::BranchRequest::descriptor();
  EXPECT_EQ(v1::describe_parse_failure(b, "\x18\xff").rfind("n: malformed or truncated", 0), 0u)
      << v1::describe_parse_failure(b, "\x18\xff");
  // Bytes that parse name no field.
  v1::TokenizeRequest fine;
  fine.set_text("hello");
  EXPECT_EQ(v1::describe_parse_failure(d, fine.SerializeAsString()),
            "request: not a valid treeserve.v1.TokenizeRequest message (7 bytes)");
}

TEST(RequestParsing, ParseRequestReportsAndRemembersTheFailure) {
  v1::TokenizeRequest bad;
  bad.set_text("@BAD@");
  grpc::Slice slice(with_bad_utf8(bad));
  grpc::ByteBuffer buffer(&slice, 1);
  v1::TokenizeRequest out;
  v1::take_request_parse_error();
  grpc::Status s = v1::parse_request(&buffer, &out);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(s.error_message().rfind("text: not valid UTF-8", 0), 0u) << s.error_message();
  EXPECT_EQ(v1::take_request_parse_error(), s.error_message());
  EXPECT_EQ(v1::take_request_parse_error(), "");  // taken once

  v1::TokenizeRequest good;
  good.set_text("héllo");
  grpc::Slice good_slice(good.SerializeAsString());
  grpc::ByteBuffer good_buffer(&good_slice, 1);
  ASSERT_TRUE(v1::parse_request(&good_buffer, &out).ok());
  EXPECT_EQ(out.text(), "héllo");
  EXPECT_EQ(v1::take_request_parse_error(), "");
}

// Every method of treeserve.v1.TreeServe but TreeSearch (which reads its own messages) gets
// the base's reading handler: a method added to the proto must be added there too.
TEST(RequestParsing, TheServiceBaseReadsEveryRequest) {
  struct Probe : ParsedRequestsService {
    grpc::Status generate_stream(grpc::ServerContext*, const v1::GenerateRequest*,
                                 grpc::internal::WriterInterface<v1::GenerateResponse>*) override {
      return grpc::Status::OK;
    }
  } probe;
  std::vector<std::string> expected;
  const auto* service = v1::CreateTreeRequest::descriptor()->file()->FindServiceByName("TreeServe");
  ASSERT_NE(service, nullptr);
  for (int i = 0; i < service->method_count(); ++i) {
    if (service->method(i)->name() != "TreeSearch") expected.push_back(service->method(i)->name());
  }
  std::vector<std::string> got = probe.parsed_methods();
  std::sort(expected.begin(), expected.end());
  std::sort(got.begin(), got.end());
  EXPECT_EQ(got, expected);
}

}  // namespace
}  // namespace treeserve
