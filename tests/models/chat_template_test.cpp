// ChatTemplate (models/chat_template.h): which template a model directory uses, the
// variables it sees, the errors at load, continuation rendering for appended messages, and
// the token ids: special tokens the template writes become their ids (one BOS, never two),
// with a sentencepiece tokenizer (the tiny model's) and a byte-level tokenizer.json.
#include "models/chat_template.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "models/detail/unicode.h"
#include "models/tokenizer.h"
#include "tests/models/test_util.h"

namespace treeserve {
namespace {

using nlohmann::json;
using testing::TempDir;
using testing::write_file;
using Ids = std::vector<int32_t>;

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

std::string family_template(const std::string& name) {
  return read_text(std::string(TREESERVE_CHAT_TEMPLATES_DIR) + "/" + name);
}

// A model directory holding the tiny model's sentencepiece tokenizer (<s> = 1, </s> = 2)
// and, when given, a tokenizer_config.json.
void tiny_tokenizer_dir(const TempDir& dir, const json& tokenizer_config) {
  std::filesystem::copy_file(std::string(TREESERVE_TINY_MODEL_DIR) + "/tokenizer.model",
                             dir.file("tokenizer.model"));
  if (!tokenizer_config.is_null())
    write_file(dir.file("tokenizer_config.json"), tokenizer_config.dump());
}

std::unique_ptr<Tokenizer> load_tokenizer(const TempDir& dir) {
  auto t = Tokenizer::load_model_dir(dir.path());
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return t.ok() ? std::move(*t) : nullptr;
}

std::string byte_level(const std::string& bytes) {
  std::string out;
  for (unsigned char b : bytes) detail::append_utf8(detail::byte_to_char()[b], &out);
  return out;
}

// A byte-level BPE tokenizer.json in Llama 3's layout: bytes are ids 0..255, the special
// tokens <|begin_of_text|> 256, <|start_header_id|> 257, <|end_header_id|> 258, <|eot_id|> 259.
json byte_level_tokenizer() {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[byte_level(std::string(1, char(b)))] = b;
  json added = json::array();
  int32_t id = 256;
  for (const char* t :
       {"<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"}) {
    added.push_back({{"id", id++},
                     {"content", t},
                     {"single_word", false},
                     {"lstrip", false},
                     {"rstrip", false},
                     {"normalized", false},
                     {"special", true}});
  }
  return {
      {"version", "1.0"},
      {"added_tokens", added},
      {"normalizer", nullptr},
      {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
      {"post_processor", nullptr},
      {"decoder", {{"type", "ByteLevel"}}},
      {"model",
       {{"type", "BPE"}, {"vocab", vocab}, {"merges", json::array()}, {"ignore_merges", true}}}};
}

TEST(ChatTemplateTest, NoTemplateIsNoErrorButNone) {
  TempDir dir;
  tiny_tokenizer_dir(dir, json{{"bos_token", "<s>"}});
  auto tokenizer = load_tokenizer(dir);
  auto t = ChatTemplate::load(dir.path(), "", *tokenizer);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ(*t, nullptr);
}

TEST(ChatTemplateTest, OverrideThenJinjaFileThenTokenizerConfig) {
  TempDir dir;
  tiny_tokenizer_dir(dir, json{{"chat_template", "config:{{ messages[0].content }}"}});
  auto tokenizer = load_tokenizer(dir);
  const std::vector<ChatMessage> hi = {{"user", "hi"}};

  auto t = ChatTemplate::load(dir.path(), "", *tokenizer);
  ASSERT_TRUE(t.ok() && *t) << t.status().ToString();
  EXPECT_EQ((*t)->origin(), dir.file("tokenizer_config.json"));
  EXPECT_EQ(*(*t)->render(hi, {}), "config:hi");

  write_file(dir.file("chat_template.jinja"), "file:{{ messages[0].content }}\n");
  t = ChatTemplate::load(dir.path(), "", *tokenizer);
  ASSERT_TRUE(t.ok() && *t) << t.status().ToString();
  EXPECT_EQ((*t)->origin(), dir.file("chat_template.jinja"));
  EXPECT_EQ(*(*t)->render(hi, {}), "file:hi");  // one trailing newline dropped, as Jinja does

  TempDir other;
  write_file(other.file("mine.jinja"), "override:{{ messages[0].content }}");
  t = ChatTemplate::load(dir.path(), other.file("mine.jinja"), *tokenizer);
  ASSERT_TRUE(t.ok() && *t) << t.status().ToString();
  EXPECT_EQ((*t)->origin(), other.file("mine.jinja"));
  EXPECT_EQ(*(*t)->render(hi, {}), "override:hi");

  t = ChatTemplate::load(dir.path(), other.file("missing.jinja"), *tokenizer);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kNotFound);
  EXPECT_NE(t.status().message().find("--chat-template"), std::string::npos);
}

TEST(ChatTemplateTest, NamedTemplatesUseTheDefault) {
  TempDir dir;
  tiny_tokenizer_dir(dir, json{{"chat_template",
                                {{{"name", "tool_use"}, {"template", "tools"}},
                                 {{"name", "default"}, {"template", "plain"}}}}});
  auto tokenizer = load_tokenizer(dir);
  auto t = ChatTemplate::load(dir.path(), "", *tokenizer);
  ASSERT_TRUE(t.ok() && *t) << t.status().ToString();
  EXPECT_EQ(*(*t)->render({{"user", "x"}}, {}), "plain");

  write_file(dir.file("tokenizer_config.json"),
             json{{"chat_template", {{{"name", "tool_use"}, {"template", "tools"}}}}}.dump());
  t = ChatTemplate::load(dir.path(), "", *tokenizer);
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("no \"default\" template (it has tool_use)"),
            std::string::npos)
      << t.status().message();
}

TEST(ChatTemplateTest, UnsupportedTemplatesAreRefusedAtLoadNamingTheOverride) {
  TempDir dir;
  tiny_tokenizer_dir(dir, json::object());
  auto tokenizer = load_tokenizer(dir);
  for (const std::string& source :
       {std::string("{% for m in messages %}\n{{ m | frobnicate }}{% endfor %}"),
        std::string("{% include 'x.jinja' %}"), std::string("{{ messages[0].content.nosuch() }}"),
        std::string("{{ raise_exception('a system message is required') }}")}) {
    write_file(dir.file("chat_template.jinja"), source);
    auto t = ChatTemplate::load(dir.path(), "", *tokenizer);
    ASSERT_FALSE(t.ok()) << source;
    EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(t.status().message().find(dir.file("chat_template.jinja")), std::string::npos)
        << t.status().message();
    EXPECT_NE(t.status().message().find("--chat-template"), std::string::npos)
        << t.status().message();
  }
}

TEST(ChatTemplateTest, SeesTheSpecialTokensOfTheTokenizerConfig) {
  TempDir dir;
  tiny_tokenizer_dir(dir, json{{"bos_token", {{"content", "<s>"}, {"lstrip", false}}},
                               {"eos_token", "</s>"},
                               {"unk_token", "<unk>"},
                               {"pad_token", nullptr},
                               {"additional_special_tokens", {"<extra>"}}});
  auto tokenizer = load_tokenizer(dir);
  write_file(dir.file("chat_template.jinja"),
             "{{ bos_token }}|{{ eos_token }}|{{ unk_token }}|{{ pad_token is defined }}|"
             "{{ additional_special_tokens | join(',') }}|{{ tools is none }}|"
             "{{ documents is none }}|{{ add_generation_prompt }}");
  auto t = ChatTemplate::load(dir.path(), "", *tokenizer);
  ASSERT_TRUE(t.ok() && *t) << t.status().ToString();
  EXPECT_EQ(*(*t)->render({{"user", "x"}}, {}), "<s>|</s>|<unk>|False|<extra>|True|True|True");
  ChatRenderOptions no_prompt;
  no_prompt.add_generation_prompt = false;
  EXPECT_EQ(*(*t)->render({{"user", "x"}}, no_prompt),
            "<s>|</s>|<unk>|False|<extra>|True|True|False");
}

TEST(ChatTemplateTest, RefusalsCarryTheTemplatesMessage) {
  TempDir dir;
  tiny_tokenizer_dir(dir, json{{"bos_token", "<s>"}, {"eos_token", "</s>"}});
  auto tokenizer = load_tokenizer(dir);
  auto t = ChatTemplate::create(family_template("mistral-instruct-v0.2.jinja"), "mistral",
                                dir.path(), *tokenizer);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  auto out = (*t)->render({{"user", "a"}, {"user", "b"}}, {});
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(out.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(out.status().message(),
            "Conversation roles must alternate user/assistant/user/assistant/...");
  out = (*t)->render({}, {});
  ASSERT_FALSE(out.ok());
  EXPECT_NE(out.status().message().find("at least one message"), std::string::npos);
  ChatRenderOptions small;
  small.max_bytes = 64;
  out = (*t)->render({{"user", std::string(100, 'x')}}, small);
  ASSERT_FALSE(out.ok());
  EXPECT_NE(out.status().message().find("over 64 bytes"), std::string::npos);
}

// Sentencepiece does not match "<s>" or "</s>" written in text: the rendered text is split at
// them, so the prompt holds one BOS id (1) and the EOS id (2) where the template wrote them.
TEST(ChatTemplateTest, SentencepieceGetsTheSpecialTokensTheTemplateWrites) {
  TempDir dir;
  tiny_tokenizer_dir(dir, json{{"bos_token", "<s>"}, {"eos_token", "</s>"}});
  auto tokenizer = load_tokenizer(dir);
  ASSERT_EQ(tokenizer->bos_id(), 1);
  auto t = ChatTemplate::create(family_template("mistral-instruct-v0.2.jinja"), "mistral",
                                dir.path(), *tokenizer);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  const std::vector<ChatMessage> chat = {
      {"user", "the cat"}, {"assistant", "a dog"}, {"user", "hi"}};
  auto text = (*t)->render(chat, {});
  ASSERT_TRUE(text.ok());
  EXPECT_EQ(*text, "<s>[INST] the cat [/INST]a dog</s>[INST] hi [/INST]");
  auto ids = (*t)->encode(chat, {});
  ASSERT_TRUE(ids.ok()) << ids.status().ToString();
  Ids expected = {1};
  for (const char* part : {"[INST] the cat [/INST]a dog"}) {
    auto p = tokenizer->encode(part);
    expected.insert(expected.end(), p->begin(), p->end());
  }
  expected.push_back(2);
  auto tail = tokenizer->encode("[INST] hi [/INST]");
  expected.insert(expected.end(), tail->begin(), tail->end());
  EXPECT_EQ(*ids, expected);
  EXPECT_EQ(std::count(ids->begin(), ids->end(), 1), 1) << "one BOS";
}

// tokenizer.json matches the added tokens itself: the ids are encode(rendered text), with
// the template's <|begin_of_text|> the only BOS.
TEST(ChatTemplateTest, TokenizerJsonEncodesTheRenderedTextWithItsSpecialTokens) {
  TempDir dir;
  write_file(dir.file("tokenizer.json"), byte_level_tokenizer().dump());
  write_file(dir.file("tokenizer_config.json"),
             json{{"bos_token", "<|begin_of_text|>"}, {"eos_token", "<|eot_id|>"}}.dump());
  auto tokenizer = load_tokenizer(dir);
  ASSERT_EQ(tokenizer->piece_to_id("<|begin_of_text|>"), 256);
  auto t = ChatTemplate::create(family_template("llama3.jinja"), "llama3", dir.path(), *tokenizer);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  const std::vector<ChatMessage> chat = {{"user", " Hi! "}};
  auto text = (*t)->render(chat, {});
  ASSERT_TRUE(text.ok());
  EXPECT_EQ(*text,
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n");
  auto ids = (*t)->encode(chat, {});
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ(*ids, *tokenizer->encode(*text));
  const Ids expected = {256, 257, 'u', 's', 'e', 'r', 258, '\n', '\n', 'H', 'i', '!',  259,
                        257, 'a', 's', 's', 'i', 's', 't', 'a',  'n',  't', 258, '\n', '\n'};
  EXPECT_EQ(*ids, expected);
}

TEST(ChatTemplateTest, ContinuationRendersOnlyTheAppendedTurns) {
  TempDir dir;
  tiny_tokenizer_dir(dir, json{{"bos_token", "<s>"}, {"eos_token", "</s>"}});
  auto tokenizer = load_tokenizer(dir);
  ChatRenderOptions continuation;
  continuation.continuation = true;
  const std::vector<ChatMessage> next = {{"user", "And now?"}};

  auto llama =
      ChatTemplate::create(family_template("llama3.1.jinja"), "llama3.1", dir.path(), *tokenizer);
  ASSERT_TRUE(llama.ok()) << llama.status().ToString();
  EXPECT_EQ(*(*llama)->render(next, continuation),
            "<|start_header_id|>user<|end_header_id|>\n\nAnd now?<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n");
  auto mistral = ChatTemplate::create(family_template("mistral-instruct-v0.2.jinja"), "mistral",
                                      dir.path(), *tokenizer);
  ASSERT_TRUE(mistral.ok());
  EXPECT_EQ(*(*mistral)->render(next, continuation), "[INST] And now? [/INST]");
  auto chatml =
      ChatTemplate::create(family_template("qwen2.5.jinja"), "qwen", dir.path(), *tokenizer);
  ASSERT_TRUE(chatml.ok());
  continuation.add_generation_prompt = false;
  EXPECT_EQ(*(*chatml)->render(next, continuation), "<|im_start|>user\nAnd now?<|im_end|>\n");

  // A template whose earlier output depends on what follows cannot continue.
  auto counting = ChatTemplate::create("{{ messages | length }}:{{ messages[-1].content }}",
                                       "count", dir.path(), *tokenizer);
  ASSERT_TRUE(counting.ok());
  auto out = (*counting)->render(next, continuation);
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(out.status().code(), StatusCode::kFailedPrecondition);
}

TEST(ChatTemplateTest, DefaultDateIsTheRenderClocks) {
  TempDir dir;
  tiny_tokenizer_dir(dir, json::object());
  auto tokenizer = load_tokenizer(dir);
  auto t =
      ChatTemplate::create(family_template("llama3.2.jinja"), "llama3.2", dir.path(), *tokenizer);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  ChatRenderOptions options;
  options.now = 1721995200;  // 2024-07-26 12:00 UTC
  std::tm tm{};
  localtime_r(&options.now, &tm);
  char date[32];
  std::strftime(date, sizeof(date), "%d %b %Y", &tm);
  auto text = (*t)->render({{"user", "x"}}, options);
  ASSERT_TRUE(text.ok());
  EXPECT_NE(text->find(std::string("Today Date: ") + date + "\n"), std::string::npos) << *text;
}

}  // namespace
}  // namespace treeserve
