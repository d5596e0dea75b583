// The HTTP API's pieces without a server: JSON fields read with errors naming the field,
// gRPC statuses as OpenAI-shaped errors under the fields' HTTP names, the prompt forms, and
// the viewer's files compiled in exactly as they are in the source tree.
#include "server/http_call.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "server/viewer_assets.h"

namespace treeserve::http {
namespace {

std::string param_of(const HttpError& e) {
  return e.body["error"]["param"].is_null() ? "<null>"
                                            : e.body["error"]["param"].get<std::string>();
}
std::string message_of(const HttpError& e) { return e.body["error"]["message"]; }

TEST(HttpErrors, StatusesFollowTheGrpcCodes) {
  const std::vector<std::pair<grpc::StatusCode, int>> table = {
      {grpc::StatusCode::INVALID_ARGUMENT, 400},    {grpc::StatusCode::UNAUTHENTICATED, 401},
      {grpc::StatusCode::PERMISSION_DENIED, 403},   {grpc::StatusCode::NOT_FOUND, 404},
      {grpc::StatusCode::FAILED_PRECONDITION, 409}, {grpc::StatusCode::RESOURCE_EXHAUSTED, 429},
      {grpc::StatusCode::CANCELLED, 499},           {grpc::StatusCode::INTERNAL, 500},
      {grpc::StatusCode::UNAVAILABLE, 503},         {grpc::StatusCode::DEADLINE_EXCEEDED, 504},
  };
  for (auto [code, status] : table) {
    const HttpError e = make_error(code, "x: y");
    EXPECT_EQ(e.status, status) << int(code);
    EXPECT_TRUE(e.body["error"]["type"].is_string());
    EXPECT_TRUE(e.body["error"]["code"].is_string());
  }
  EXPECT_EQ(make_error(grpc::StatusCode::NOT_FOUND, "x").body["error"]["code"], "NOT_FOUND");
  EXPECT_EQ(make_error(grpc::StatusCode::INVALID_ARGUMENT, "x").body["error"]["type"],
            "invalid_request_error");
}

TEST(HttpErrors, FieldsGetTheirHttpNames) {
  const auto e = [](const std::string& m) {
    return make_error(grpc::StatusCode::INVALID_ARGUMENT, m);
  };
  EXPECT_EQ(param_of(e("sampling.max_tokens: 9999 is outside [0, 4096]")), "max_tokens");
  EXPECT_EQ(message_of(e("sampling.max_tokens: 9999 is outside [0, 4096]")),
            "max_tokens: 9999 is outside [0, 4096]");
  EXPECT_EQ(param_of(e("sampling.stop[2]: must not be empty")), "stop[2]");
  EXPECT_EQ(param_of(e("prompt.tokens.ids[3]: token id 600 is outside the vocabulary")),
            "prompt[3]");
  EXPECT_EQ(param_of(e("prompt.text: 9 bytes is over the limit")), "prompt");
  EXPECT_EQ(param_of(e("prompt: must not be empty")), "prompt");
  EXPECT_EQ(param_of(e("append.text: not valid UTF-8")), "append");
  EXPECT_EQ(param_of(e("prompt.messages.messages[1].role: must not be empty")), "messages[1].role");
  EXPECT_EQ(param_of(e("prompt.messages.messages: must not be empty")), "messages");
  EXPECT_EQ(param_of(e("append.messages.messages[0].role: must not be empty")), "messages[0].role");
  EXPECT_EQ(param_of(e("branch_ids[0]: must not be empty")), "branch_ids[0]");
  EXPECT_EQ(param_of(e("sampling.temperature = -1.000000 must be a finite number >= 0")),
            "temperature");
  EXPECT_EQ(message_of(e("sampling.temperature = -1.000000 must be a finite number >= 0")),
            "temperature = -1.000000 must be a finite number >= 0");
  // Not a field: no param, the message as it was.
  EXPECT_EQ(param_of(e("the model is loading; try again")), "<null>");
  EXPECT_EQ(param_of(e("tenant 'a': 3 live trees is its quota")), "<null>");
  EXPECT_EQ(message_of(e("tenant 'a': 3 live trees is its quota")),
            "tenant 'a': 3 live trees is its quota");
}

TEST(JsonRequest, TypesAreCheckedAndNamed) {
  EXPECT_TRUE(JsonRequest::parse("").ok());
  EXPECT_TRUE(JsonRequest::parse(" \n").ok());
  for (const char* bad : {"[1]", "3", "\"x\"", "{\"a\":", "{\"a\": 1}}", "nul"}) {
    StatusOr<JsonRequest> r = JsonRequest::parse(bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(r.status().message().rfind("request body: ", 0), 0u) << r.status().message();
  }
  // Invalid UTF-8 inside a string is refused by the parser.
  EXPECT_FALSE(JsonRequest::parse("{\"a\": \"\xff\"}").ok());

  auto body = JsonRequest::parse(R"({"n": 3, "f": 2.0, "g": 2.5, "s": "x", "b": true,
      "big": 3000000000, "list": ["a", "b"], "mixed": ["a", 1], "ids": [1, -2, 3.0],
      "bad_ids": [1, "x"], "none": null})");
  ASSERT_TRUE(body.ok());
  int32_t i = 7;
  EXPECT_TRUE(body->get_int32("n", &i).ok());
  EXPECT_EQ(i, 3);
  EXPECT_TRUE(body->get_int32("f", &i).ok());
  EXPECT_EQ(i, 2);
  Status s = body->get_int32("g", &i);
  EXPECT_EQ(s.message().rfind("g: must be an integer", 0), 0u) << s.message();
  s = body->get_int32("big", &i);
  EXPECT_EQ(s.message().rfind("big: must be an integer in [-2147483648, 2147483647]", 0), 0u)
      << s.message();
  s = body->get_int32("s", &i);
  EXPECT_NE(s.message().find("got \"x\""), std::string::npos) << s.message();
  // Absent and null keep the default.
  i = 5;
  EXPECT_TRUE(body->get_int32("none", &i).ok());
  EXPECT_TRUE(body->get_int32("absent", &i).ok());
  EXPECT_EQ(i, 5);
  EXPECT_FALSE(body->has("none"));

  std::string str;
  EXPECT_TRUE(body->get("s", &str).ok());
  EXPECT_EQ(str, "x");
  EXPECT_EQ(body->get("n", &str).message().rfind("n: must be a string", 0), 0u);
  bool flag = false;
  EXPECT_TRUE(body->get("b", &flag).ok());
  EXPECT_TRUE(flag);
  EXPECT_FALSE(body->get("n", &flag).ok());
  double d = 0;
  EXPECT_TRUE(body->get("g", &d).ok());
  EXPECT_EQ(d, 2.5);
  EXPECT_FALSE(body->get("s", &d).ok());

  std::vector<std::string> strings;
  EXPECT_TRUE(body->get_strings("s", &strings).ok());
  EXPECT_EQ(strings, std::vector<std::string>{"x"});
  EXPECT_TRUE(body->get_strings("list", &strings).ok());
  EXPECT_EQ(strings, (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(body->get_strings("mixed", &strings).message().rfind("mixed[1]: must be a string", 0),
            0u);
  EXPECT_FALSE(body->get_string_list("s", &strings).ok());

  std::vector<int32_t> ids;
  EXPECT_TRUE(body->get_ids("ids", &ids).ok());
  EXPECT_EQ(ids, (std::vector<int32_t>{1, -2, 3}));
  EXPECT_EQ(body->get_ids("bad_ids", &ids).message().rfind("bad_ids[1]: must be a 32-bit", 0), 0u);
  EXPECT_EQ(body->get_ids("s", &ids).message().rfind("s: must be a list of integers", 0), 0u);
}

TEST(JsonRequest, PromptForms) {
  v1::Prompt p;
  ASSERT_TRUE(prompt_from_json("hello", "prompt", &p).ok());
  EXPECT_EQ(p.text(), "hello");
  p.Clear();
  ASSERT_TRUE(prompt_from_json(json::array({1, 2, 3}), "prompt", &p).ok());
  EXPECT_EQ(p.tokens().ids_size(), 3);
  p.Clear();
  ASSERT_TRUE(prompt_from_json(json::array({"hi"}), "prompt", &p).ok());
  EXPECT_EQ(p.text(), "hi");
  p.Clear();
  ASSERT_TRUE(prompt_from_json(json::parse("[[4, 5]]"), "prompt", &p).ok());
  EXPECT_EQ(p.tokens().ids_size(), 2);
  // An empty list is an empty token prompt (the service says it must not be empty).
  p.Clear();
  ASSERT_TRUE(prompt_from_json(json::array(), "prompt", &p).ok());
  EXPECT_TRUE(p.has_tokens());
  EXPECT_EQ(prompt_from_json(json::array({"a", "b"}), "prompt", &p)
                .message()
                .rfind("prompt: a batch of 2 prompts", 0),
            0u);
  EXPECT_EQ(prompt_from_json(json(3), "append", &p).message().rfind("append: must be a string", 0),
            0u);
  EXPECT_EQ(prompt_from_json(json::parse("[1, 2.5]"), "prompt", &p)
                .message()
                .rfind("prompt[1]: must be a 32-bit integer", 0),
            0u);
}

TEST(JsonRequest, MessagesForms) {
  v1::ChatMessages m;
  ASSERT_TRUE(messages_from_json(json::parse(R"([
      {"role": "system", "content": "Be brief."},
      {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
      {"role": "assistant", "content": null, "name": "x"}])"),
                                 "messages", &m)
                  .ok());
  ASSERT_EQ(m.messages_size(), 3);
  EXPECT_EQ(m.messages(0).role(), "system");
  EXPECT_EQ(m.messages(1).content(), "a\nb");
  EXPECT_EQ(m.messages(2).content(), "");
  const auto error = [](const char* text) {
    v1::ChatMessages out;
    return messages_from_json(json::parse(text), "messages", &out).message();
  };
  EXPECT_EQ(error(R"("hi")").rfind("messages: must be a list of messages", 0), 0u);
  EXPECT_EQ(error(R"([{"content": "x"}])").rfind("messages[0].role: must be a string", 0), 0u);
  EXPECT_EQ(error(R"([{"role": "user", "content": 3}])").rfind("messages[0].content: must be", 0),
            0u);
  EXPECT_EQ(error(R"([{"role": "user", "content": [{"type": "image_url"}]}])")
                .rfind("messages[0].content[0]: only", 0),
            0u);
}

TEST(ViewerAssets, TheSourceTreesFilesAreCompiledIn) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::path(TREESERVE_SOURCE_DIR) / "server" / "viewer";
  size_t on_disk = 0;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (!entry.is_regular_file()) continue;
    ++on_disk;
    std::ifstream in(entry.path(), std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    const std::string name = entry.path().filename().string();
    bool found = false;
    for (const EmbeddedFile& f : viewer_files()) {
      if (f.name != name) continue;
      found = true;
      EXPECT_EQ(f.data, ss.str()) << name << ": rebuild to embed the current file";
    }
    EXPECT_TRUE(found) << name;
  }
  EXPECT_EQ(viewer_files().size(), on_disk);
  EXPECT_GE(on_disk, 1u);
}

}  // namespace
}  // namespace treeserve::http
