// ChatTemplate: a conversation (role, content messages) to the prompt text and token ids a
// chat model expects, with the checkpoint's own Jinja chat template, rendered as Hugging Face
// transformers' apply_chat_template renders it (models/detail/jinja.h holds the interpreter).
// An interpreter rather than a renderer per recognised family: checkpoints' templates differ
// in details (families revise them, as Mistral's [INST] templates did; fine-tunes edit them),
// and a recogniser would render a near-miss as the family it resembles, where an interpreter
// renders the text it is given and refuses at load what it cannot run.
//
// Which template: --chat-template FILE (model.chat_template) when given, else the model
// directory's chat_template.jinja, else tokenizer_config.json's "chat_template" (a string,
// or a list of {name, template} of which "default" is used). The template sees `messages`,
// `add_generation_prompt`, `tools` and `documents` (none), and the special tokens of
// tokenizer_config.json (else special_tokens_map.json): bos_token, eos_token, unk_token,
// pad_token, additional_special_tokens.
//
// Token ids: the rendered text is tokenized with special tokens recognised and no BOS added,
// as apply_chat_template(tokenize=True) does: templates that want a BOS write it themselves
// (Llama 3.x's <|begin_of_text|>, Mistral's <s>), so it is never doubled, and ChatML templates
// get none. Tokenizers that do not match special tokens in text (sentencepiece) have the
// rendered text split at them first.
//
// Immutable after loading; every method may be called from several threads at once.
#pragma once

#include <cstdint>
#include <ctime>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"

namespace treeserve {

class Tokenizer;

namespace jinja {
class Template;
}

struct ChatMessage {
  std::string role;  // "system", "user", "assistant", ... as the template knows them
  std::string content;
};

struct ChatRenderOptions {
  // End with the header of the assistant's turn, so the model writes the answer.
  bool add_generation_prompt = true;
  // The messages continue a conversation already in the sequence (appended to a branch):
  // render only the text the template writes for them after earlier turns, not the start
  // of a conversation (BOS, a default system message). It is the difference between the
  // template's output for [user, assistant, messages...] and for [user, assistant];
  // FAILED_PRECONDITION for a template whose output for earlier turns changes when turns
  // follow (it cannot render a continuation).
  bool continuation = false;
  std::time_t now = 0;   // strftime_now's clock; 0 = the current time
  size_t max_bytes = 0;  // the longest rendered text; 0 = 64 MiB
};

class ChatTemplate {
 public:
  // The model's template, found as the header says; nullptr (and OK) when the model has
  // none. NOT_FOUND when `override_file` is given but missing; INVALID_ARGUMENT naming the
  // file, the line and --chat-template when a template does not parse or fails to render a
  // one-message conversation.
  static StatusOr<std::unique_ptr<ChatTemplate>> load(const std::string& model_dir,
                                                      const std::string& override_file,
                                                      const Tokenizer& tokenizer);
  // A template from its text; `origin` names it in messages. Special tokens are read from
  // `model_dir` as load() reads them ("" = the tokenizer's BOS and EOS pieces only).
  static StatusOr<std::unique_ptr<ChatTemplate>> create(const std::string& source,
                                                        const std::string& origin,
                                                        const std::string& model_dir,
                                                        const Tokenizer& tokenizer);
  ~ChatTemplate();
  ChatTemplate(const ChatTemplate&) = delete;
  ChatTemplate& operator=(const ChatTemplate&) = delete;

  // INVALID_ARGUMENT for no messages, or with the template's own message when it refuses the
  // conversation (raise_exception: "Conversation roles must alternate ...") or fails on it.
  StatusOr<std::string> render(const std::vector<ChatMessage>& messages,
                               const ChatRenderOptions& options) const;
  // render(), then the text's token ids (see the header).
  StatusOr<std::vector<int32_t>> encode(const std::vector<ChatMessage>& messages,
                                        const ChatRenderOptions& options) const;
  // The rendered text's token ids.
  StatusOr<std::vector<int32_t>> encode_text(const std::string& text) const;

  // Where the template came from: "<dir>/tokenizer_config.json", "<dir>/chat_template.jinja"
  // or the --chat-template file.
  const std::string& origin() const { return origin_; }

 private:
  struct SpecialPiece {
    std::string text;
    int32_t id;
  };
  ChatTemplate() = default;
  StatusOr<std::string> render_once(const std::vector<ChatMessage>& messages,
                                    bool add_generation_prompt, std::time_t now,
                                    size_t max_bytes) const;

  std::shared_ptr<const jinja::Template> template_;
  std::string origin_;
  const Tokenizer* tokenizer_ = nullptr;
  // Special tokens as the template sees them: (bos_token, "<s>"), ...
  std::vector<std::pair<std::string, std::string>> special_tokens_;
  std::vector<std::string> additional_special_tokens_;
  // Special tokens the tokenizer does not match in text itself, longest first.
  std::vector<SpecialPiece> split_pieces_;
};

}  // namespace treeserve
