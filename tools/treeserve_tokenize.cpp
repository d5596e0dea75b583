// treeserve_tokenize: runs treeserve's tokenizer over strings read from a file, for the
// reference comparison of tests/tokenizer_ref/ (against @huggingface/tokenizers).
//
//   treeserve_tokenize --model DIR|FILE --input STRINGS.jsonl [--output OUT.jsonl]
//
// --model is a checkpoint directory (tokenizer picked as the server picks it) or a
// tokenizer.json / tokenizer.model file. Each input line is one JSON string; each output
// line is a JSON object:
//   ids             encode(text), no BOS
//   decoded         decode_with_special(ids): the text back, special tokens written out
//   decoded_skip    decode(ids): special tokens left out (what the server streams)
//   stream          the IncrementalDetokenizer's deltas over ids, joined, then its flush
//   stream_partial  how many deltas ended inside a UTF-8 character (must be 0)
// The first line of the output is {"bos_id": N, "eos_id": N, "vocab_size": N}.
#include <sys/stat.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "models/detokenizer.h"
#include "models/tokenizer.h"

namespace treeserve {
namespace {

bool is_dir(const std::string& path) {
  struct stat st {};
  return stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

// Whether text ends inside a UTF-8 sequence (a lead byte without all its continuations).
bool ends_mid_character(const std::string& text) {
  for (size_t back = 1; back <= 4 && back <= text.size(); ++back) {
    const unsigned char c = static_cast<unsigned char>(text[text.size() - back]);
    if ((c & 0xC0) == 0x80) continue;
    const size_t need = c < 0x80 ? 1 : (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : 4;
    return need > back;
  }
  return false;
}

int run(int argc, char** argv) {
  CLI::App app{"treeserve_tokenize: treeserve's tokenizer over strings from a file"};
  std::string model, input, output;
  app.add_option("--model", model, "checkpoint directory, tokenizer.json or tokenizer.model")
      ->required();
  app.add_option("--input", input, "one JSON string per line")->required();
  app.add_option("--output", output, "JSON lines out (default stdout)");
  CLI11_PARSE(app, argc, argv);

  auto tokenizer = is_dir(model) ? Tokenizer::load_model_dir(model) : Tokenizer::load(model);
  if (!tokenizer.ok()) {
    std::fprintf(stderr, "%s\n", tokenizer.status().ToString().c_str());
    return 1;
  }
  const Tokenizer& tok = **tokenizer;
  const DetokenizerVocab vocab(tok);
  std::ifstream in(input, std::ios::binary);
  if (!in) {
    std::fprintf(stderr, "cannot read %s\n", input.c_str());
    return 1;
  }
  std::ofstream file_out;
  if (!output.empty()) file_out.open(output, std::ios::binary | std::ios::trunc);
  std::ostream& out = output.empty() ? std::cout : file_out;
  out << nlohmann::json{{"bos_id", tok.bos_id()},
                        {"eos_id", tok.eos_id()},
                        {"vocab_size", tok.vocab_size()}}
             .dump()
      << "\n";
  std::string line;
  size_t line_number = 0;
  while (std::getline(in, line)) {
    ++line_number;
    std::string text;
    try {
      text = nlohmann::json::parse(line).get<std::string>();
    } catch (const nlohmann::json::exception& e) {
      std::fprintf(stderr, "%s:%zu: not a JSON string: %s\n", input.c_str(), line_number, e.what());
      return 1;
    }
    auto ids = tok.encode(text);
    if (!ids.ok()) {
      std::fprintf(stderr, "%s:%zu: %s\n", input.c_str(), line_number,
                   ids.status().ToString().c_str());
      return 1;
    }
    auto decoded = tok.decode_with_special(*ids);
    auto skipped = tok.decode(*ids);
    if (!decoded.ok() || !skipped.ok()) {
      std::fprintf(stderr, "%s:%zu: decode failed\n", input.c_str(), line_number);
      return 1;
    }
    IncrementalDetokenizer detok(tok, &vocab);
    std::string stream;
    int partial = 0;
    for (int32_t id : *ids) {
      auto delta = detok.push(id);
      if (!delta.ok()) {
        std::fprintf(stderr, "%s:%zu: %s\n", input.c_str(), line_number,
                     delta.status().ToString().c_str());
        return 1;
      }
      partial += ends_mid_character(*delta);
      stream += *delta;
    }
    auto rest = detok.flush();
    if (rest.ok()) stream += *rest;
    out << nlohmann::json{{"ids", *ids},
                          {"decoded", *decoded},
                          {"decoded_skip", *skipped},
                          {"stream", stream},
                          {"stream_partial", partial}}
               .dump()
        << "\n";
  }
  return 0;
}

}  // namespace
}  // namespace treeserve

int main(int argc, char** argv) { return treeserve::run(argc, argv); }
