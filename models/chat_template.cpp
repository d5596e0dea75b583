// ChatTemplate (models/chat_template.h): finding the model's chat template, rendering a
// conversation with it and tokenizing the result.
#include "models/chat_template.h"

#include <spdlog/spdlog.h>
#include <sys/stat.h>

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "models/detail/jinja.h"
#include "models/tokenizer.h"

namespace treeserve {
namespace {

using Json = nlohmann::ordered_json;

constexpr size_t kDefaultMaxBytes = size_t(64) << 20;
constexpr const char* kOverrideHint =
    "; pass --chat-template FILE (model.chat_template) with a template treeserve can render";

bool is_file(const std::string& path) {
  struct stat st {};
  return stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

StatusOr<std::string> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return NotFound(path + ": cannot be read");
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// A JSON object file, or null when the file is absent.
StatusOr<Json> read_json_object(const std::string& path) {
  if (!is_file(path)) return Json(nullptr);
  StatusOr<std::string> text = read_file(path);
  if (!text.ok()) return text.status();
  Json j;
  try {
    j = Json::parse(*text);
  } catch (const Json::exception& e) {
    return InvalidArgument(path + ": invalid JSON: " + e.what());
  }
  if (!j.is_object()) return InvalidArgument(path + ": expected a JSON object");
  return j;
}

// A special-token field: "<s>" or {"content": "<s>", ...}; "" when absent or null.
std::string token_text(const Json& config, const char* field) {
  if (!config.is_object()) return "";
  auto it = config.find(field);
  if (it == config.end() || it->is_null()) return "";
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object() && it->contains("content") && (*it)["content"].is_string()) {
    return (*it)["content"].get<std::string>();
  }
  return "";
}

// tokenizer_config.json's chat_template: a string, or [{"name", "template"}, ...].
StatusOr<std::string> config_template(const Json& config, const std::string& file) {
  const Json& t = config["chat_template"];
  if (t.is_string()) return t.get<std::string>();
  if (t.is_array()) {
    std::string names;
    for (const Json& entry : t) {
      if (!entry.is_object() || !entry.contains("name") || !entry.contains("template") ||
          !entry["name"].is_string() || !entry["template"].is_string()) {
        return InvalidArgument(file + ": chat_template entries must be {\"name\", \"template\"}");
      }
      if (entry["name"] == "default") return entry["template"].get<std::string>();
      names += (names.empty() ? "" : ", ") + entry["name"].get<std::string>();
    }
    return InvalidArgument(file + ": chat_template names no \"default\" template (it has " + names +
                           ")" + kOverrideHint);
  }
  return InvalidArgument(file + ": chat_template must be a string or a list of named templates");
}

jinja::Value messages_value(const std::vector<ChatMessage>& messages) {
  jinja::List list;
  for (const ChatMessage& m : messages) {
    auto d = std::make_shared<jinja::Dict>();
    d->set("role", jinja::Value::string(m.role));
    d->set("content", jinja::Value::string(m.content));
    list.push_back(jinja::Value::dict(std::move(d)));
  }
  return jinja::Value::list(std::move(list));
}

}  // namespace

ChatTemplate::~ChatTemplate() = default;

StatusOr<std::unique_ptr<ChatTemplate>> ChatTemplate::load(const std::string& model_dir,
                                                           const std::string& override_file,
                                                           const Tokenizer& tokenizer) {
  std::string source, origin;
  if (!override_file.empty()) {
    if (!is_file(override_file)) {
      return NotFound("--chat-template (model.chat_template) " + override_file + ": no such file");
    }
    StatusOr<std::string> text = read_file(override_file);
    if (!text.ok()) return text.status();
    source = std::move(*text);
    origin = override_file;
  } else if (is_file(model_dir + "/chat_template.jinja")) {
    origin = model_dir + "/chat_template.jinja";
    StatusOr<std::string> text = read_file(origin);
    if (!text.ok()) return text.status();
    source = std::move(*text);
  } else {
    const std::string file = model_dir + "/tokenizer_config.json";
    StatusOr<Json> config = read_json_object(file);
    if (!config.ok()) return config.status();
    if (config->is_null() || !config->contains("chat_template") ||
        (*config)["chat_template"].is_null()) {
      spdlog::info(
          "chat template: none ({} has no chat_template and there is no chat_template.jinja): "
          "messages prompts are refused; pass --chat-template FILE to serve chat",
          model_dir);
      return std::unique_ptr<ChatTemplate>();
    }
    StatusOr<std::string> text = config_template(*config, file);
    if (!text.ok()) return text.status();
    source = std::move(*text);
    origin = file;
  }
  auto t = create(source, origin, model_dir, tokenizer);
  if (t.ok()) spdlog::info("chat template: {}", origin);
  return t;
}

StatusOr<std::unique_ptr<ChatTemplate>> ChatTemplate::create(const std::string& source,
                                                             const std::string& origin,
                                                             const std::string& model_dir,
                                                             const Tokenizer& tokenizer) {
  auto parsed = jinja::Template::parse(source);
  if (!parsed.ok()) {
    return InvalidArgument("chat template " + origin + ": " + parsed.status().message() +
                           kOverrideHint);
  }
  std::unique_ptr<ChatTemplate> t(new ChatTemplate());
  t->template_ = std::move(*parsed);
  t->origin_ = origin;
  t->tokenizer_ = &tokenizer;

  // Special tokens: tokenizer_config.json, then special_tokens_map.json, then the
  // tokenizer's own BOS and EOS.
  Json config, map;
  if (!model_dir.empty()) {
    StatusOr<Json> c = read_json_object(model_dir + "/tokenizer_config.json");
    if (!c.ok()) return c.status();
    config = std::move(*c);
    StatusOr<Json> m = read_json_object(model_dir + "/special_tokens_map.json");
    if (!m.ok()) return m.status();
    map = std::move(*m);
  }
  for (const char* name : {"bos_token", "eos_token", "unk_token", "pad_token"}) {
    std::string text = token_text(config, name);
    if (text.empty()) text = token_text(map, name);
    if (text.empty() && std::string(name) == "bos_token" && tokenizer.bos_id() >= 0) {
      text = tokenizer.id_to_piece(tokenizer.bos_id());
    }
    if (text.empty() && std::string(name) == "eos_token" && tokenizer.eos_id() >= 0) {
      text = tokenizer.id_to_piece(tokenizer.eos_id());
    }
    if (!text.empty()) t->special_tokens_.emplace_back(name, std::move(text));
  }
  for (const Json* source_json : {&config, &map}) {
    if (!t->additional_special_tokens_.empty() || !source_json->is_object()) continue;
    auto it = source_json->find("additional_special_tokens");
    if (it == source_json->end() || !it->is_array()) continue;
    for (const Json& e : *it) {
      const std::string text = e.is_string() ? e.get<std::string>() : token_text(e, "content");
      if (!text.empty()) t->additional_special_tokens_.push_back(text);
    }
  }

  // Control tokens written as text ("<s>", "[INST]") that encode() does not turn into their
  // ids (sentencepiece): the rendered text is split at them.
  for (int32_t id = 0; id < tokenizer.vocab_size(); ++id) {
    const std::string piece = tokenizer.id_to_piece(id);
    if (piece.size() < 3 || !((piece.front() == '<' && piece.back() == '>') ||
                              (piece.front() == '[' && piece.back() == ']'))) {
      continue;
    }
    auto decoded = tokenizer.decode({id});
    if (!decoded.ok() || !decoded->empty()) continue;  // not a special token
    auto ids = tokenizer.encode(piece);
    if (ids.ok() && ids->size() == 1 && (*ids)[0] == id) continue;  // matched as it is
    t->split_pieces_.push_back({piece, id});
  }
  std::sort(
      t->split_pieces_.begin(), t->split_pieces_.end(),
      [](const SpecialPiece& a, const SpecialPiece& b) { return a.text.size() > b.text.size(); });

  // A template that cannot render the plainest conversation is refused now, not at the
  // first request.
  auto probe = t->render({{"user", "Hello"}}, ChatRenderOptions{});
  if (!probe.ok()) {
    return InvalidArgument("chat template " + origin +
                           " does not render a one-message "
                           "conversation: " +
                           probe.status().message() + kOverrideHint);
  }
  return t;
}

StatusOr<std::string> ChatTemplate::render_once(const std::vector<ChatMessage>& messages,
                                                bool add_generation_prompt, std::time_t now,
                                                size_t max_bytes) const {
  auto context = jinja::Value::dict();
  jinja::Dict& d = context.mutable_dict();
  d.set("messages", messages_value(messages));
  d.set("tools", jinja::Value::none());
  d.set("documents", jinja::Value::none());
  d.set("add_generation_prompt", jinja::Value::boolean(add_generation_prompt));
  for (const auto& [name, text] : special_tokens_) d.set(name, jinja::Value::string(text));
  if (!additional_special_tokens_.empty()) {
    jinja::List list;
    for (const std::string& s : additional_special_tokens_) list.push_back(jinja::Value::string(s));
    d.set("additional_special_tokens", jinja::Value::list(std::move(list)));
  }
  jinja::RenderOptions options;
  options.now = now;
  options.max_output_bytes = max_bytes;
  return template_->render(context, options);
}

StatusOr<std::string> ChatTemplate::render(const std::vector<ChatMessage>& messages,
                                           const ChatRenderOptions& options) const {
  if (messages.empty()) return InvalidArgument("a conversation needs at least one message");
  const std::time_t now = options.now != 0 ? options.now : std::time(nullptr);
  const size_t max_bytes = options.max_bytes != 0 ? options.max_bytes : kDefaultMaxBytes;
  if (!options.continuation) {
    return render_once(messages, options.add_generation_prompt, now, max_bytes);
  }
  // The earlier turns stand in for what the sequence already holds.
  std::vector<ChatMessage> earlier = {{"user", "Hi"}, {"assistant", "Hello"}};
  StatusOr<std::string> base = render_once(earlier, false, now, max_bytes);
  if (!base.ok()) return base.status();
  earlier.insert(earlier.end(), messages.begin(), messages.end());
  StatusOr<std::string> full = render_once(earlier, options.add_generation_prompt, now, max_bytes);
  if (!full.ok()) return full.status();
  if (full->compare(0, base->size(), *base) != 0) {
    return FailedPrecondition(
        "the chat template renders earlier turns differently once more "
        "turns follow, so "
        "messages cannot be appended as a continuation; append text "
        "instead");
  }
  return full->substr(base->size());
}

StatusOr<std::vector<int32_t>> ChatTemplate::encode_text(const std::string& text) const {
  std::vector<int32_t> ids;
  // next[i]: where split_pieces_[i] next occurs at or after pos (npos: nowhere).
  std::vector<size_t> next;
  for (const SpecialPiece& p : split_pieces_) next.push_back(text.find(p.text));
  size_t pos = 0;
  while (pos <= text.size()) {
    // The earliest special piece from pos (the longest one where several start there).
    size_t hit = std::string::npos;
    const SpecialPiece* piece = nullptr;
    for (size_t i = 0; i < split_pieces_.size(); ++i) {
      if (next[i] != std::string::npos && next[i] < pos) {
        next[i] = text.find(split_pieces_[i].text, pos);
      }
      if (next[i] != std::string::npos && (hit == std::string::npos || next[i] < hit)) {
        hit = next[i];
        piece = &split_pieces_[i];
      }
    }
    const size_t end = hit == std::string::npos ? text.size() : hit;
    if (end > pos) {
      auto part = tokenizer_->encode(std::string_view(text).substr(pos, end - pos));
      if (!part.ok()) return part.status();
      ids.insert(ids.end(), part->begin(), part->end());
    }
    if (piece == nullptr) break;
    ids.push_back(piece->id);
    pos = hit + piece->text.size();
  }
  return ids;
}

StatusOr<std::vector<int32_t>> ChatTemplate::encode(const std::vector<ChatMessage>& messages,
                                                    const ChatRenderOptions& options) const {
  StatusOr<std::string> text = render(messages, options);
  if (!text.ok()) return text.status();
  return encode_text(*text);
}

}  // namespace treeserve
