// Fuzzes the safetensors reader (models/safetensors.h) and the Llama weight map on top of it.
//
// Input: one mode byte, then the files. Layout (mode % 3) 0: the rest is one
// model.safetensors, opened with open_files. 1: the rest, split at "\n#SHARD#\n", is
// s0.safetensors, s1.safetensors, ..., opened with open_dir (every *.safetensors). 2: the first
// part is model.safetensors.index.json and the others are the shards s0.safetensors, ...
// Framed shards (mode / 3 odd): each shard is its JSON header, "\n#DATA#\n", then its data, and
// the harness writes the 8-byte header length, so that mutations of the header keep the file's
// framing.
//
// Whatever the reader accepts must hold together: every tensor's bytes are numel x dtype size
// and lie inside its shard, and reading them all (to_float) stays in bounds. A checkpoint of
// the small model shape below is also mapped to LlamaWeights.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

#include "models/llama_weights.h"
#include "models/model_config.h"
#include "models/safetensors.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

namespace fs = std::filesystem;
using treeserve::fuzz::check;

// Every file this process writes lives here; emptied before each input.
const std::string& work_dir() {
  static const std::string dir = treeserve::fuzz::make_temp_dir("fuzz_safetensors");
  return dir;
}

void write(const std::string& path, std::string_view bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), std::streamsize(bytes.size()));
}

std::vector<std::string_view> split(std::string_view rest, std::string_view sep, size_t max) {
  std::vector<std::string_view> parts;
  for (;;) {
    const size_t at = rest.find(sep);
    if (at == std::string_view::npos || parts.size() + 1 == max) {
      parts.push_back(rest);
      return parts;
    }
    parts.push_back(rest.substr(0, at));
    rest.remove_prefix(at + sep.size());
  }
}

// A framed shard (header "\n#DATA#\n" data) as a safetensors file.
std::string unframe(std::string_view framed) {
  const std::vector<std::string_view> parts = split(framed, "\n#DATA#\n", 2);
  const std::string_view header = parts[0];
  const std::string_view data = parts.size() > 1 ? parts[1] : std::string_view();
  std::string out(8, '\0');
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[size_t(i)] = char(n >> (8 * i));  // little-endian
  out.append(header);
  out.append(data);
  return out;
}

// A one-layer model small enough that a fuzzed checkpoint can match its shapes.
const treeserve::ModelConfig& small_config() {
  static const treeserve::ModelConfig config = [] {
    auto c = treeserve::parse_model_config(
        R"({"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 4,
            "intermediate_size": 6, "num_hidden_layers": 1, "num_attention_heads": 2,
            "num_key_value_heads": 1, "tie_word_embeddings": true})",
        "small_config");
    check(c.ok(), "the small model config parses");
    return *c;
  }();
  return config;
}

void check_reader(const treeserve::SafetensorsReader& reader) {
  uintmax_t shard_bytes = 0;
  for (const std::string& f : reader.files()) {
    std::error_code ec;
    shard_bytes = std::max(shard_bytes, fs::file_size(f, ec));
  }
  for (const std::string& name : reader.tensor_names()) {
    check(reader.contains(name), "tensor_names() lists only tensors contains() knows");
    auto view = reader.tensor(name);
    if (!view.ok()) {
      check(!view.status().message().empty(), "a refused tensor says why");
      continue;
    }
    check(view->name == name, "the view carries its name");
    // numel without overflow, as every consumer (to_float, the weight shape checks) needs it.
    uint64_t numel = 1;
    for (int64_t d : view->shape) {
      check(d >= 0, "no negative dimension");
      check(!__builtin_mul_overflow(numel, uint64_t(d), &numel), "numel fits in 64 bits");
    }
    check(numel <= uint64_t(INT64_MAX), "numel fits in int64");
    check(view->numel() == int64_t(numel), "numel() is the product of the shape");
    check(numel * treeserve::dtype_size(view->dtype) == view->nbytes,
          "a tensor's bytes are numel x dtype size");
    check(view->nbytes <= shard_bytes, "a tensor's bytes lie inside its shard");
    check(view->nbytes == 0 || view->data != nullptr, "a non-empty tensor has data");
    (void)view->shape_string();
    if (numel <= (1u << 16)) {
      std::vector<float> out(numel + 1, 0.0f);
      treeserve::to_float(*view, out.data());
    }
  }
  check(!reader.tensor("no such tensor (fuzz)").ok(), "an absent tensor is not found");
  auto weights = treeserve::load_llama_weights(small_config(), reader);
  if (weights.ok()) {
    check(weights->layers.size() == 1, "one layer");
    check(weights->embed_tokens.numel() == 8 * 4, "embed_tokens is [vocab, hidden]");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const int layout = data[0] % 3;
  const bool framed = (data[0] / 3) % 2 == 1;
  const std::string_view rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  const std::string& dir = work_dir();
  treeserve::fuzz::empty_dir(dir);
  auto write_shard = [&](const std::string& path, std::string_view bytes) {
    write(path, framed ? std::string_view(unframe(bytes)) : bytes);
  };

  treeserve::SafetensorsOptions options;
  options.progress = false;
  treeserve::StatusOr<treeserve::SafetensorsReader> reader =
      treeserve::InvalidArgument("not opened");
  if (layout == 0) {
    write_shard(dir + "/model.safetensors", rest);
    reader = treeserve::SafetensorsReader::open_files({dir + "/model.safetensors"}, options);
  } else {
    const std::vector<std::string_view> parts = split(rest, "\n#SHARD#\n", 8);
    size_t first_shard = 0;
    if (layout == 2) {
      write(dir + "/model.safetensors.index.json", parts[0]);
      first_shard = 1;
    }
    for (size_t i = first_shard; i < parts.size(); ++i) {
      write_shard(dir + "/s" + std::to_string(i - first_shard) + ".safetensors", parts[i]);
    }
    reader = treeserve::SafetensorsReader::open_dir(dir, options);
  }
  if (!reader.ok()) {
    check(!reader.status().message().empty(), "a refused checkpoint says why");
    return 0;
  }
  check_reader(*reader);
  return 0;
}
