// The Jinja interpreter (models/detail/jinja.h) against strings transformers renders:
// tests/models/chat_templates/jinja_cases.json (one small template per feature) and
// conversations.json (the Llama 3.x, Mistral, ChatML/Qwen2.5 and Zephyr templates on
// conversations). Their expected strings are Jinja2's in transformers' environment;
// check_with_transformers.py there re-renders every case with transformers itself.
#include "models/detail/jinja.h"

#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

namespace treeserve::jinja {
namespace {

using Json = nlohmann::ordered_json;

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

Json read_cases(const std::string& name) {
  const std::string text = read_text(std::string(TREESERVE_CHAT_TEMPLATES_DIR) + "/" + name);
  EXPECT_FALSE(text.empty()) << name;
  return Json::parse(text)["cases"];
}

// The variables transformers renders with: messages, tools and documents (None unless the
// case gives them), add_generation_prompt, then the case's own variables.
Value context_for(const Json& c, const Json& messages, bool add_generation_prompt) {
  Json context = Json::object();
  context["messages"] = messages;
  context["tools"] = c.contains("tools") ? c["tools"] : Json(nullptr);
  context["documents"] = nullptr;
  context["add_generation_prompt"] = add_generation_prompt;
  if (c.contains("variables")) {
    for (const auto& [k, v] : c["variables"].items()) {
      if (k != "messages") context[k] = v;
    }
  }
  return Value::from_json(context);
}

void check_case(const Json& c, const std::string& name, const std::string& source,
                const Value& context) {
  RenderOptions options;
  options.now = c.value("now", int64_t(1721995200));
  auto t = Template::parse(source);
  StatusOr<std::string> out =
      t.ok() ? (*t)->render(context, options) : StatusOr<std::string>(t.status());
  if (c.contains("error")) {
    ASSERT_FALSE(out.ok()) << name << " rendered " << testing::PrintToString(*out);
    EXPECT_NE(out.status().message().find(c["error"].get<std::string>()), std::string::npos)
        << name << ": " << out.status().message();
    return;
  }
  ASSERT_TRUE(out.ok()) << name << ": " << out.status().ToString();
  EXPECT_EQ(*out, c["expected"].get<std::string>()) << name;
}

TEST(JinjaTest, RendersEveryFeatureCaseAsTransformersDoes) {
  const Json cases = read_cases("jinja_cases.json");
  ASSERT_GT(cases.size(), 50u);
  for (size_t i = 0; i < cases.size(); ++i) {
    const Json& c = cases[i];
    const std::string source = c["template"].get<std::string>();
    Json messages = Json::array({{{"role", "user"}, {"content", "hi"}}});
    if (c.contains("variables") && c["variables"].contains("messages")) {
      messages = c["variables"]["messages"];
    }
    check_case(c, "jinja case " + std::to_string(i) + " " + testing::PrintToString(source), source,
               context_for(c, messages, false));
  }
}

TEST(JinjaTest, RendersTheFamilyTemplatesAsTransformersDoes) {
  const Json cases = read_cases("conversations.json");
  ASSERT_GT(cases.size(), 40u);
  for (const Json& c : cases) {
    const std::string source = read_text(std::string(TREESERVE_CHAT_TEMPLATES_DIR) + "/" +
                                         c["template"].get<std::string>());
    ASSERT_FALSE(source.empty()) << c["template"];
    check_case(c, c["name"].get<std::string>(), source,
               context_for(c, c["messages"], c.value("add_generation_prompt", true)));
  }
}

TEST(JinjaTest, ParseErrorsNameTheLine) {
  auto t = Template::parse("a\nb\n{% if x %}\n{{ y | nosuch }}\n{% endif %}");
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(t.status().message().find("line 4"), std::string::npos) << t.status().message();
  EXPECT_NE(t.status().message().find("no filter named 'nosuch'"), std::string::npos);

  t = Template::parse("{% if x %}open");
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("missing {% endif %}"), std::string::npos)
      << t.status().message();
  t = Template::parse("ok {{ 'caf\xC3' }}");
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("not valid UTF-8 (at byte 10)"), std::string::npos)
      << t.status().message();
  t = Template::parse("x\n{% include 'a' %}");
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("line 2: tag 'include' is not supported"), std::string::npos)
      << t.status().message();
}

TEST(JinjaTest, NestingIsBounded) {
  auto t = Template::parse("{{ " + std::string(100, '(') + "1" + std::string(100, ')') + " }}");
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ(*(*t)->render(Value::dict()), "1");
  std::string chain = "{{ 0";
  for (int i = 0; i < 100; ++i) chain += " + 1";
  t = Template::parse(chain + " }}");
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ(*(*t)->render(Value::dict()), "100");
  // Deeper nesting is refused before anything recurses that deep.
  std::string blocks;
  for (int i = 0; i < 5000; ++i) blocks += "{% if true %}";
  for (const std::string& source :
       {"{{ " + std::string(100000, '(') + "1" + std::string(100000, ')') + " }}",
        "{{ " + std::string(100000, '-') + "1 }}", blocks}) {
    t = Template::parse(source);
    EXPECT_FALSE(t.ok());
  }
  std::string long_chain = "{{ 0";
  for (int i = 0; i < 100000; ++i) long_chain += "+1";
  std::string nots = "{{ ";
  for (int i = 0; i < 100000; ++i) nots += "not ";
  std::string attrs = "{{ x";
  for (int i = 0; i < 100000; ++i) attrs += ".a";
  std::string filters = "{{ x";
  for (int i = 0; i < 100000; ++i) filters += "|trim";
  for (const std::string& source :
       {long_chain + " }}", nots + "1 }}", attrs + " }}", filters + " }}"}) {
    t = Template::parse(source);
    ASSERT_FALSE(t.ok());
    EXPECT_NE(t.status().message().find("nested deeper than 512"), std::string::npos)
        << t.status().message();
  }
}

TEST(JinjaTest, RuntimeErrorsNameTheLineAndRaiseExceptionKeepsItsMessage) {
  auto t = Template::parse("ok\n{{ messages.nope.deeper }}");
  ASSERT_TRUE(t.ok());
  auto context = Value::dict();
  context.mutable_dict().set("messages", Value::dict());
  bool raised = true;
  auto out = (*t)->render(context, RenderOptions{}, &raised);
  ASSERT_FALSE(out.ok());
  EXPECT_FALSE(raised);
  EXPECT_EQ(out.status().message(), "line 2: 'dict object' has no attribute 'nope'");

  t = Template::parse(
      "{% for m in [1] %}\n{{ raise_exception('roles must alternate') }}{% endfor %}");
  ASSERT_TRUE(t.ok());
  out = (*t)->render(Value::dict(), RenderOptions{}, &raised);
  ASSERT_FALSE(out.ok());
  EXPECT_TRUE(raised);
  EXPECT_EQ(out.status().message(), "roles must alternate");
}

TEST(JinjaTest, StrftimeNowReadsTheRenderClock) {
  auto t = Template::parse("{{ strftime_now('%Y-%m-%d') }}");
  ASSERT_TRUE(t.ok());
  RenderOptions options;
  options.now = 1721995200;  // 2024-07-26 12:00 UTC
  std::tm tm{};
  localtime_r(&options.now, &tm);
  char expected[32];
  std::strftime(expected, sizeof(expected), "%Y-%m-%d", &tm);
  auto out = (*t)->render(Value::dict(), options);
  ASSERT_TRUE(out.ok());
  EXPECT_EQ(*out, expected);
}

TEST(JinjaTest, OutputIsBounded) {
  auto t = Template::parse("{% for i in range(1000) %}{{ x }}{% endfor %}");
  ASSERT_TRUE(t.ok());
  auto context = Value::dict();
  context.mutable_dict().set("x", Value::string(std::string(100, 'a')));
  RenderOptions options;
  options.max_output_bytes = 10000;
  auto out = (*t)->render(context, options);
  ASSERT_FALSE(out.ok());
  EXPECT_NE(out.status().message().find("over 10000 bytes"), std::string::npos)
      << out.status().message();
  t = Template::parse("{{ 'ab' * 100000 }}");
  ASSERT_TRUE(t.ok());
  EXPECT_FALSE((*t)->render(Value::dict(), options).ok());
  t = Template::parse("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}");
  ASSERT_TRUE(t.ok());
  out = (*t)->render(Value::dict(), options);
  ASSERT_FALSE(out.ok());
  EXPECT_NE(out.status().message().find("nest deeper"), std::string::npos);
  t = Template::parse("{{ range(200000) | length }}");
  ASSERT_TRUE(t.ok());
  EXPECT_FALSE((*t)->render(Value::dict(), options).ok());
}

TEST(JinjaTest, FloatReprIsPythons) {
  EXPECT_EQ(float_repr(1.0), "1.0");
  EXPECT_EQ(float_repr(0.1 + 0.2), "0.30000000000000004");
  EXPECT_EQ(float_repr(1e-5), "1e-05");
  EXPECT_EQ(float_repr(0.0001), "0.0001");
  EXPECT_EQ(float_repr(1e16), "1e+16");
  EXPECT_EQ(float_repr(123456789012345678.0), "1.2345678901234568e+17");
  EXPECT_EQ(float_repr(1e15), "1000000000000000.0");
  EXPECT_EQ(float_repr(-2.5), "-2.5");
  EXPECT_EQ(float_repr(5e-324), "5e-324");
}

}  // namespace
}  // namespace treeserve::jinja
