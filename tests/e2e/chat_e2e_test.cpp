// End-to-end: `messages` prompts over gRPC.
//  - A Llama-3-style model directory (Meta's Llama 3 tokenizer.json, built from npm data by
//    tests/tokenizer_ref at test time; random weights) with the Llama 3.1 Instruct chat
//    template in its tokenizer_config.json: CreateTree, one-shot Generate and append take
//    messages; the prompt's ids are those of the rendered template (one <|begin_of_text|>),
//    as Tokenize of the rendered text gives them (the radix cache matches them id for id);
//    appended messages add the template's continuation; stop_token_ids end a chat generation.
//  - The tiny model (sentencepiece, no chat template): messages are a clear
//    FAILED_PRECONDITION naming --chat-template; with --chat-template a Mistral template
//    renders, and its refusals (roles must alternate) come back as INVALID_ARGUMENT; a template
//    that cannot be rendered stops the server at start.
// The Llama 3 directory comes from the tokenizer_reference test (a CTest fixture); without it
// (no npm) the Llama 3 tests skip, unless TREESERVE_REQUIRE_TOKENIZER_REF=1.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "proto/treeserve.grpc.pb.h"
#include "tests/common/temp_dir.h"
#include "tests/e2e/server_process.h"

namespace treeserve::testing {
namespace {

namespace v1 = ::treeserve::v1;
namespace fs = std::filesystem;

constexpr int32_t kBeginOfText = 128000;
constexpr int32_t kPageSize = 16;

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

std::string templates_dir() { return TREESERVE_CHAT_TEMPLATES_DIR; }

using Turns = std::vector<std::pair<std::string, std::string>>;

v1::Prompt chat(const Turns& turns, std::optional<bool> add_generation_prompt = std::nullopt) {
  v1::Prompt p;
  v1::ChatMessages* m = p.mutable_messages();
  for (const auto& [role, content] : turns) {
    v1::ChatMessage* msg = m->add_messages();
    msg->set_role(role);
    msg->set_content(content);
  }
  if (add_generation_prompt) m->set_add_generation_prompt(*add_generation_prompt);
  return p;
}

struct Generated {
  std::vector<int32_t> tokens;
  v1::FinishReason finish = v1::FINISH_NONE;
  grpc::Status status;
};

class ChatClient {
 public:
  explicit ChatClient(std::shared_ptr<grpc::Channel> channel)
      : stub_(v1::TreeServe::NewStub(std::move(channel))) {}

  std::vector<int32_t> tokenize(const std::string& text) {
    grpc::ClientContext ctx;
    v1::TokenizeRequest req;
    req.set_text(text);
    v1::TokenizeResponse resp;
    const grpc::Status s = stub_->Tokenize(&ctx, req, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return {resp.ids().begin(), resp.ids().end()};
  }

  grpc::Status create(const v1::Prompt& prompt, v1::CreateTreeResponse* out) {
    grpc::ClientContext ctx;
    v1::CreateTreeRequest req;
    *req.mutable_prompt() = prompt;
    return stub_->CreateTree(&ctx, req, out);
  }

  Generated generate(const v1::GenerateRequest& req) {
    grpc::ClientContext ctx;
    auto reader = stub_->Generate(&ctx, req);
    Generated g;
    v1::GenerateResponse r;
    while (reader->Read(&r)) {
      if (r.token_id() >= 0 && r.finish_reason() != v1::FINISH_CANCELLED) {
        g.tokens.push_back(r.token_id());
      }
      if (r.finish_reason() != v1::FINISH_NONE) g.finish = r.finish_reason();
    }
    g.status = reader->Finish();
    return g;
  }

  int32_t length(const std::string& tree, const std::string& branch) {
    grpc::ClientContext ctx;
    v1::GetTreeRequest req;
    req.set_tree_id(tree);
    v1::TreeInfo info;
    const grpc::Status s = stub_->GetTree(&ctx, req, &info);
    EXPECT_TRUE(s.ok()) << s.error_message();
    for (const v1::BranchInfo& b : info.branches()) {
      if (b.branch_id() == branch) return b.length();
    }
    ADD_FAILURE() << "branch " << branch << " not in tree " << tree;
    return -1;
  }

  void remove(const std::string& tree) {
    grpc::ClientContext ctx;
    v1::DeleteTreeRequest req;
    req.set_tree_id(tree);
    v1::DeleteTreeResponse resp;
    EXPECT_TRUE(stub_->DeleteTree(&ctx, req, &resp).ok());
  }

 private:
  std::unique_ptr<v1::TreeServe::Stub> stub_;
};

// ---- the Llama 3 directory ----------------------------------------------------------------

// The Llama 3.1 Instruct template's rendering of [system, user] (its default date, no tools).
const char* const kRendered =
    "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
    "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
    "You are terse.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n"
    "Name three colours.<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n";
const Turns kConversation = {{"system", "  You are terse.\n"}, {"user", "Name three colours."}};

class Llama3Chat : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const fs::path source = TREESERVE_LLAMA3_MODEL_DIR;
    missing_ = !fs::exists(source / "tokenizer.json");
    if (missing_) return;
    // The npm-built directory with the Llama 3.1 template in its tokenizer_config.json, where
    // Meta's checkpoints carry it; one per process (CTest runs each test in its own).
    dir_ = fs::path(treeserve::testing_support::test_temp_dir()) /
           ("llama3-chat-model-" + std::to_string(getpid()));
    const fs::path& dir = dir_;
    fs::remove_all(dir);
    fs::create_directories(dir);
    for (const char* name : {"config.json", "generation_config.json", "tokenizer.json"}) {
      fs::copy_file(source / name, dir / name);
    }
    nlohmann::ordered_json config =
        nlohmann::ordered_json::parse(read_text(source / "tokenizer_config.json"));
    config["chat_template"] = read_text(fs::path(templates_dir()) / "llama3.1.jinja");
    std::ofstream(dir / "tokenizer_config.json") << config.dump(2);
    server_ = new ServerProcess({"--model", dir.string(), "--random-weights", "1", "--backend",
                                 "cpu", "--page-size", std::to_string(kPageSize)});
    ASSERT_TRUE(server_->wait_ready(120)) << server_->output();
  }
  static void TearDownTestSuite() {
    if (server_ != nullptr) {
      EXPECT_EQ(server_->terminate(), 0) << server_->output();
      delete server_;
      server_ = nullptr;
    }
    if (!dir_.empty()) fs::remove_all(dir_);
  }
  void SetUp() override {
    if (missing_) {
      const char* required = std::getenv("TREESERVE_REQUIRE_TOKENIZER_REF");
      if (required != nullptr && std::string(required) == "1") {
        FAIL() << TREESERVE_LLAMA3_MODEL_DIR
               << " is missing (the tokenizer_reference test makes it)";
      }
      GTEST_SKIP() << TREESERVE_LLAMA3_MODEL_DIR
                   << " is missing (made by the tokenizer_reference test, which needs npm)";
    }
    ASSERT_NE(server_, nullptr) << "the Llama 3 server did not start";
    client_ = std::make_unique<ChatClient>(server_->channel());
  }

  static inline bool missing_ = false;
  static inline fs::path dir_;
  static inline ServerProcess* server_ = nullptr;
  std::unique_ptr<ChatClient> client_;
};

TEST_F(Llama3Chat, PromptIsTheRenderedTemplatesTokens) {
  EXPECT_NE(server_->output().find("chat template: "), std::string::npos) << server_->output();
  const std::vector<int32_t> expected = client_->tokenize(kRendered);
  ASSERT_GT(expected.size(), 30u);
  EXPECT_EQ(expected[0], kBeginOfText);
  EXPECT_EQ(std::count(expected.begin(), expected.end(), kBeginOfText), 1);
  EXPECT_EQ(std::count(expected.begin(), expected.end(), 128009), 2);  // <|eot_id|>

  v1::CreateTreeResponse tree;
  grpc::Status s = client_->create(chat(kConversation), &tree);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(tree.prompt_tokens(), int32_t(expected.size()));
  // The same ids as tokens: the radix cache reuses the chat tree's prompt id for id (all but
  // the last page, which is recomputed for its logits).
  v1::CreateTreeResponse same;
  v1::Prompt ids;
  for (int32_t id : expected) ids.mutable_tokens()->add_ids(id);
  s = client_->create(ids, &same);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(same.prompt_tokens(), tree.prompt_tokens());
  EXPECT_GE(same.cached_tokens(), int32_t(expected.size()) - kPageSize) << "ids differ";
  // Without the assistant header.
  v1::CreateTreeResponse bare;
  s = client_->create(chat(kConversation, false), &bare);
  ASSERT_TRUE(s.ok()) << s.error_message();
  const std::string without =
      std::string(kRendered).substr(0, std::string(kRendered).rfind("<|start_header_id|>"));
  EXPECT_EQ(bare.prompt_tokens(), int32_t(client_->tokenize(without).size()));
  for (const auto* t : {&tree, &same, &bare}) client_->remove(t->tree_id());
}

TEST_F(Llama3Chat, AppendedMessagesContinueTheConversation) {
  v1::CreateTreeResponse tree;
  ASSERT_TRUE(client_->create(chat(kConversation), &tree).ok());
  v1::GenerateRequest req;
  req.set_tree_id(tree.tree_id());
  req.add_branch_ids(tree.root_branch_id());
  req.mutable_sampling()->set_max_tokens(3);
  Generated first = client_->generate(req);
  ASSERT_TRUE(first.status.ok()) << first.status.error_message();
  const int32_t before = client_->length(tree.tree_id(), tree.root_branch_id());

  *req.mutable_append() = chat({{"user", "And one more?"}});
  req.mutable_sampling()->set_max_tokens(1);
  Generated second = client_->generate(req);
  ASSERT_TRUE(second.status.ok()) << second.status.error_message();
  const std::vector<int32_t> turn = client_->tokenize(
      "<|start_header_id|>user<|end_header_id|>\n\nAnd one more?<|eot_id|>"
      "<|start_header_id|>assistant<|end_header_id|>\n\n");
  EXPECT_EQ(client_->length(tree.tree_id(), tree.root_branch_id()),
            before + int32_t(turn.size()) + int32_t(second.tokens.size()));
  client_->remove(tree.tree_id());
}

// Random weights never choose <|eot_id|> on purpose: the stop-id path a chat generation ends
// by is driven with stop_token_ids (the EOS list is tests/models/eos_list_test.cpp's).
TEST_F(Llama3Chat, StopTokenIdsEndAOneShotChat) {
  v1::GenerateRequest req;
  *req.mutable_prompt() = chat(kConversation);
  req.mutable_sampling()->set_max_tokens(8);
  Generated free_run = client_->generate(req);
  ASSERT_TRUE(free_run.status.ok()) << free_run.status.error_message();
  ASSERT_EQ(free_run.tokens.size(), 8u);
  ASSERT_EQ(free_run.finish, v1::FINISH_LENGTH);
  size_t k = 1;  // the first token not seen before it
  while (k < free_run.tokens.size() &&
         std::find(free_run.tokens.begin(), free_run.tokens.begin() + std::ptrdiff_t(k),
                   free_run.tokens[k]) != free_run.tokens.begin() + std::ptrdiff_t(k)) {
    ++k;
  }
  ASSERT_LT(k, free_run.tokens.size());
  req.mutable_sampling()->add_stop_token_ids(free_run.tokens[k]);
  Generated stopped = client_->generate(req);
  ASSERT_TRUE(stopped.status.ok()) << stopped.status.error_message();
  EXPECT_EQ(stopped.finish, v1::FINISH_STOP);
  ASSERT_GE(stopped.tokens.size(), k);
  EXPECT_LE(stopped.tokens.size(), k + 1);
  EXPECT_TRUE(std::equal(stopped.tokens.begin(), stopped.tokens.begin() + std::ptrdiff_t(k),
                         free_run.tokens.begin()));
}

TEST_F(Llama3Chat, BadMessagesNameTheField) {
  v1::CreateTreeResponse tree;
  grpc::Status s = client_->create(chat({}), &tree);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("prompt.messages.messages: must not be empty"),
            std::string::npos)
      << s.error_message();
  s = client_->create(chat({{"user", "a"}, {"", "b"}}), &tree);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("prompt.messages.messages[1].role"), std::string::npos)
      << s.error_message();
}

// ---- the tiny model -------------------------------------------------------------------------

TEST(TinyChat, WithoutAChatTemplateMessagesNameTheFlag) {
  ServerProcess server({"--backend", "cpu"});
  ASSERT_TRUE(server.wait_ready()) << server.output();
  ChatClient client(server.channel());
  v1::CreateTreeResponse tree;
  const grpc::Status s = client.create(chat({{"user", "hi"}}), &tree);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(s.error_message().find("prompt.messages: the model has no chat template"),
            std::string::npos)
      << s.error_message();
  EXPECT_NE(s.error_message().find("--chat-template"), std::string::npos);
  EXPECT_NE(server.output().find("chat template: none"), std::string::npos) << server.output();
  EXPECT_EQ(server.terminate(), 0);
}

TEST(TinyChat, ChatTemplateFlagRendersAndTheTemplatesRefusalsComeBack) {
  const std::string file = templates_dir() + "/mistral-instruct-v0.2.jinja";
  ServerProcess server({"--backend", "cpu", "--chat-template", file});
  ASSERT_TRUE(server.wait_ready()) << server.output();
  EXPECT_NE(server.output().find("chat template: " + file), std::string::npos) << server.output();
  ChatClient client(server.channel());
  // "<s>[INST] the cat [/INST]a dog</s>[INST] hi [/INST]": <s> and </s> are the ids 1 and 2
  // (sentencepiece does not match them in text; the template's are split out).
  std::vector<int32_t> expected = {1};
  for (int32_t id : client.tokenize("[INST] the cat [/INST]a dog")) expected.push_back(id);
  expected.push_back(2);
  for (int32_t id : client.tokenize("[INST] hi [/INST]")) expected.push_back(id);
  v1::CreateTreeResponse tree, same;
  grpc::Status s =
      client.create(chat({{"user", "the cat"}, {"assistant", "a dog"}, {"user", "hi"}}), &tree);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(tree.prompt_tokens(), int32_t(expected.size()));
  v1::Prompt ids;
  for (int32_t id : expected) ids.mutable_tokens()->add_ids(id);
  ASSERT_TRUE(client.create(ids, &same).ok());
  EXPECT_GE(same.cached_tokens(), int32_t(expected.size()) - kPageSize) << "ids differ";

  s = client.create(chat({{"user", "a"}, {"user", "b"}}), &tree);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find(
                "prompt.messages: the model's chat template: Conversation roles must alternate"),
            std::string::npos)
      << s.error_message();
  EXPECT_EQ(server.terminate(), 0);
}

TEST(TinyChat, ConfigKeyNamesTheTemplateFile) {
  const std::string file = templates_dir() + "/chatml.jinja";
  const fs::path config =
      fs::path(treeserve::testing_support::test_temp_dir()) / "chat-config.json";
  std::ofstream(config) << nlohmann::json{{"model", {{"chat_template", file}}}}.dump();
  RunResult printed = run_treeserve_to_exit({"--config", config.string(), "--print-config"});
  EXPECT_EQ(printed.exit_code, 0) << printed.output;
  EXPECT_NE(printed.output.find("\"chat_template\":\"" + file + "\""), std::string::npos)
      << printed.output;
  ServerProcess server({"--backend", "cpu", "--config", config.string()});
  ASSERT_TRUE(server.wait_ready()) << server.output();
  EXPECT_NE(server.output().find("chat template: " + file), std::string::npos) << server.output();
  ChatClient client(server.channel());
  v1::CreateTreeResponse tree;
  const grpc::Status s = client.create(chat({{"user", "hi"}}), &tree);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(
      tree.prompt_tokens(),
      int32_t(client.tokenize("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n").size()));
  EXPECT_EQ(server.terminate(), 0);
}

TEST(TinyChat, TemplatesThatCannotRenderStopTheServer) {
  const fs::path bad = fs::path(treeserve::testing_support::test_temp_dir()) / "bad-template.jinja";
  std::ofstream(bad) << "{% for m in messages %}{{ m.content | no_such_filter }}{% endfor %}";
  RunResult r = run_treeserve_to_exit({"--backend", "cpu", "--chat-template", bad.string()});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("no filter named 'no_such_filter'"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("--chat-template"), std::string::npos) << r.output;
  r = run_treeserve_to_exit({"--backend", "cpu", "--chat-template", bad.string() + ".missing"});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("no such file"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace treeserve::testing
