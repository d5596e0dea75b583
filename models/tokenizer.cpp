// Tokenizer: picks the backend by what the checkpoint holds, applies tokenizer_config.json's
// BOS / EOS, and checks ids before decoding.
#include "models/tokenizer.h"

#include <spdlog/spdlog.h>
#include <sys/stat.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>

#include "models/detail/tokenizer_backend.h"

namespace treeserve {
namespace {

bool is_file(const std::string& path) {
  struct stat st {};
  return stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// tiktoken's format (Llama 3's tokenizer.model): lines of "<base64 bytes> <rank>".
// A sentencepiece model is a binary protobuf and never starts like that.
bool is_tiktoken_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::string line;
  if (!std::getline(in, line)) return false;
  static const std::regex kLine("[A-Za-z0-9+/]+=* [0-9]+\r?");
  return std::regex_match(line, kLine);
}

Status tiktoken_error(const std::string& path) {
  return InvalidArgument(path +
                         " is a tiktoken BPE file (as Llama 3 ships), which treeserve does not "
                         "read: put the checkpoint's tokenizer.json (Hugging Face format) beside "
                         "it");
}

// A special-token field of tokenizer_config.json: "<s>", {"content": "<s>", ...} or null.
StatusOr<std::string> token_name(const nlohmann::json& config, const char* field,
                                 const std::string& file) {
  auto it = config.find(field);
  if (it == config.end() || it->is_null()) return std::string();
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object() && it->contains("content") && it->at("content").is_string()) {
    return it->at("content").get<std::string>();
  }
  return InvalidArgument(file + ": field '" + field +
                         "' must be a string or {\"content\": ...}, got " + it->dump());
}

}  // namespace

Tokenizer::Tokenizer(std::unique_ptr<detail::TokenizerBackend> backend)
    : backend_(std::move(backend)),
      vocab_size_(backend_->vocab_size()),
      bos_id_(backend_->bos_id()),
      eos_id_(backend_->eos_id()),
      description_(backend_->description()) {}

Tokenizer::~Tokenizer() = default;

StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::load(const std::string& file) {
  StatusOr<std::unique_ptr<detail::TokenizerBackend>> backend = NotFound("");
  if (ends_with(file, ".json")) {
    backend = detail::load_tokenizer_json(file);
  } else {
    if (is_file(file) && is_tiktoken_file(file)) return tiktoken_error(file);
    backend = detail::load_sentencepiece(file);
  }
  if (!backend.ok()) return backend.status();
  return std::unique_ptr<Tokenizer>(new Tokenizer(std::move(*backend)));
}

StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::load_model_dir(const std::string& dir) {
  const std::string spm_file = dir + "/tokenizer.model";
  const std::string json_file = dir + "/tokenizer.json";
  const bool has_spm = is_file(spm_file), has_json = is_file(json_file);
  const bool tiktoken = has_spm && is_tiktoken_file(spm_file);
  std::string file;
  if (has_spm && !tiktoken) {
    file = spm_file;
  } else if (has_json) {
    file = json_file;
  } else if (tiktoken) {
    return tiktoken_error(spm_file);
  } else {
    return NotFound("model directory " + dir +
                    " holds no tokenizer (neither tokenizer.model nor tokenizer.json)");
  }
  auto tokenizer = load(file);
  if (!tokenizer.ok()) return tokenizer.status();
  Tokenizer& t = **tokenizer;
  if (tiktoken) t.description_ += "; tokenizer.model (tiktoken) not read";

  const std::string config_file = dir + "/tokenizer_config.json";
  if (is_file(config_file)) {
    std::ifstream in(config_file, std::ios::binary);
    std::stringstream text;
    text << in.rdbuf();
    nlohmann::json config;
    try {
      config = nlohmann::json::parse(text.str());
    } catch (const nlohmann::json::exception& e) {
      return InvalidArgument(config_file + ": invalid JSON: " + e.what());
    }
    if (!config.is_object()) return InvalidArgument(config_file + ": expected a JSON object");
    auto resolve = [&](const char* field, int32_t* id) -> Status {
      auto name = token_name(config, field, config_file);
      if (!name.ok()) return name.status();
      if (name->empty()) return Status::Ok();
      const int32_t found = t.piece_to_id(*name);
      if (found < 0) {
        return InvalidArgument(config_file + ": " + field + " '" + *name + "' is not a token of " +
                               file);
      }
      *id = found;
      return Status::Ok();
    };
    int32_t bos = t.bos_id_;
    TS_RETURN_IF_ERROR(resolve("bos_token", &bos));
    TS_RETURN_IF_ERROR(resolve("eos_token", &t.eos_id_));
    auto flag = [&](const char* field) -> StatusOr<int> {  // -1 absent, 0 false, 1 true
      auto it = config.find(field);
      if (it == config.end() || it->is_null()) return -1;
      if (!it->is_boolean())
        return InvalidArgument(config_file + ": " + field + " must be a boolean");
      return it->get<bool>() ? 1 : 0;
    };
    auto add_bos = flag("add_bos_token");
    if (!add_bos.ok()) return add_bos.status();
    // add_bos_token decides when given; otherwise the tokenizer file's own rule stands.
    if (*add_bos == 0) t.bos_id_ = -1;
    if (*add_bos == 1) {
      if (bos < 0) {
        return InvalidArgument(config_file + ": add_bos_token is true but no bos_token is given");
      }
      t.bos_id_ = bos;
    }
    auto add_eos = flag("add_eos_token");
    if (!add_eos.ok()) return add_eos.status();
    if (*add_eos == 1) {
      spdlog::warn("{}: add_eos_token is true; treeserve does not end prompts with EOS",
                   config_file);
    }
  }
  spdlog::info("tokenizer: {}; BOS {} ({}), EOS {} ({})", t.description_, t.bos_id_,
               t.bos_id_ >= 0 ? t.id_to_piece(t.bos_id_) : "none added", t.eos_id_,
               t.eos_id_ >= 0 ? t.id_to_piece(t.eos_id_) : "none");
  return tokenizer;
}

StatusOr<std::vector<int32_t>> Tokenizer::encode(std::string_view text) const {
  return backend_->encode(text);
}

StatusOr<std::string> Tokenizer::checked_decode(const std::vector<int32_t>& ids,
                                                bool skip_special) const {
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= vocab_size_) {
      return InvalidArgument("token id " + std::to_string(ids[i]) + " at position " +
                             std::to_string(i) + " is outside the vocabulary [0, " +
                             std::to_string(vocab_size_) + ")");
    }
  }
  return backend_->decode(ids, skip_special);
}

StatusOr<std::string> Tokenizer::decode(const std::vector<int32_t>& ids) const {
  return checked_decode(ids, true);
}

StatusOr<std::string> Tokenizer::decode_with_special(const std::vector<int32_t>& ids) const {
  return checked_decode(ids, false);
}

std::string Tokenizer::id_to_piece(int32_t id) const { return backend_->id_to_piece(id); }
int32_t Tokenizer::piece_to_id(std::string_view piece) const {
  return backend_->piece_to_id(piece);
}
std::string_view Tokenizer::token_bytes(int32_t id) const { return backend_->token_bytes(id); }
int32_t Tokenizer::vocab_size() const { return vocab_size_; }
int32_t Tokenizer::bos_id() const { return bos_id_; }
int32_t Tokenizer::eos_id() const { return eos_id_; }

}  // namespace treeserve
