// Safetensors shards: mmap each file read-only, parse the 8-byte little-endian
// header length and the JSON header, bounds-check every tensor against the file,
// and answer by-name lookups with views into the mapping.
#include "models/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "models/detail/load_progress.h"

namespace treeserve {

using nlohmann::json;

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "F32";
    case DType::kF16:
      return "F16";
    case DType::kBF16:
      return "BF16";
    case DType::kF8E4M3:
      return "F8_E4M3";
  }
  return "?";
}

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return 4;
    case DType::kF16:
    case DType::kBF16:
      return 2;
    case DType::kF8E4M3:
      return 1;
  }
  return 0;
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string TensorView::shape_string() const {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

namespace {

constexpr uint64_t kMaxHeaderBytes = 100u << 20;  // the format's own limit

struct Shard {
  std::string path;
  const unsigned char* base = nullptr;
  size_t size = 0;
};

struct Entry {
  std::string dtype_string;
  std::optional<DType> dtype;  // nullopt: a dtype we do not load (I64, F64, F8_E5M2, ...)
  std::vector<int64_t> shape;
  size_t begin = 0;  // absolute byte offsets in the shard
  size_t end = 0;
  size_t shard = 0;
};

std::optional<DType> parse_dtype(const std::string& s) {
  if (s == "F32") return DType::kF32;
  if (s == "F16") return DType::kF16;
  if (s == "BF16") return DType::kBF16;
  if (s == "F8_E4M3") return DType::kF8E4M3;
  return std::nullopt;
}

// Element size of dtypes we do not load, so their offsets can still be checked.
size_t other_dtype_size(const std::string& s) {
  if (s == "F64" || s == "I64" || s == "U64") return 8;
  if (s == "I32" || s == "U32") return 4;
  if (s == "I16" || s == "U16") return 2;
  if (s == "I8" || s == "U8" || s == "BOOL" || s == "F8_E5M2") return 1;
  return 0;  // unknown: only the file bounds are checked
}

}  // namespace

struct SafetensorsReader::Impl {
  std::vector<Shard> shards;
  std::vector<std::string> files;
  std::map<std::string, Entry> tensors;
  std::string source;  // what to name in "not found" messages
  size_t total_bytes = 0;

  ~Impl() {
    for (const Shard& s : shards) munmap(const_cast<unsigned char*>(s.base), s.size);
  }

  Status map_shard(const std::string& path);
  Status parse_header(size_t shard_index);
  Status check_no_overlap(size_t shard_index) const;
};

Status SafetensorsReader::Impl::map_shard(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    if (err == ENOENT) return NotFound(path + ": no such safetensors file");
    return Internal(path + ": cannot open: " + std::strerror(err));
  }
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return InvalidArgument(path + ": not a regular file");
  }
  const size_t size = static_cast<size_t>(st.st_size);
  if (size < 8) {
    ::close(fd);
    return InvalidArgument(path + ": " + std::to_string(size) +
                           " bytes is too small for a safetensors file (truncated?)");
  }
  void* base = mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int err = errno;
  ::close(fd);  // the mapping keeps the file alive
  if (base == MAP_FAILED) return Internal(path + ": mmap failed: " + std::strerror(err));
  shards.push_back({path, static_cast<const unsigned char*>(base), size});
  files.push_back(path);
  total_bytes += size;
  return parse_header(shards.size() - 1);
}

Status SafetensorsReader::Impl::parse_header(size_t shard_index) {
  const Shard& shard = shards[shard_index];
  const std::string& path = shard.path;
  uint64_t header_len = 0;
  std::memcpy(&header_len, shard.base, 8);  // little-endian (static_assert in half_float.cpp)
  if (header_len > kMaxHeaderBytes || header_len > shard.size - 8) {
    return InvalidArgument(path + ": header length " + std::to_string(header_len) +
                           " exceeds the file size " + std::to_string(shard.size) +
                           " (truncated or not a safetensors file)");
  }
  json header;
  try {
    header = json::parse(shard.base + 8, shard.base + 8 + header_len);
  } catch (const json::exception& e) {
    return InvalidArgument(path + ": invalid safetensors JSON header: " + e.what());
  }
  if (!header.is_object()) return InvalidArgument(path + ": safetensors header is not an object");

  const size_t data_start = 8 + header_len;
  const size_t data_bytes = shard.size - data_start;
  for (const auto& [name, info] : header.items()) {
    if (name == "__metadata__") continue;
    const std::string where = path + ": tensor '" + name + "'";
    if (!info.is_object() || !info.contains("dtype") || !info["dtype"].is_string() ||
        !info.contains("shape") || !info["shape"].is_array() || !info.contains("data_offsets") ||
        !info["data_offsets"].is_array() || info["data_offsets"].size() != 2) {
      return InvalidArgument(where +
                             ": header entry needs dtype (string), shape (list) and "
                             "data_offsets ([begin, end]), got " +
                             info.dump());
    }
    Entry e;
    e.shard = shard_index;
    e.dtype_string = info["dtype"].get<std::string>();
    e.dtype = parse_dtype(e.dtype_string);
    constexpr uint64_t kMaxNumel = uint64_t{1} << 48;
    uint64_t numel = 1;
    for (const json& d : info["shape"]) {
      if (!d.is_number_unsigned() || d.get<uint64_t>() > (uint64_t{1} << 40)) {
        return InvalidArgument(where + ": bad shape " + info["shape"].dump());
      }
      e.shape.push_back(d.get<int64_t>());
      // Checked before multiplying: [2^40, 2^40] would wrap to 0 elements and pass.
      const uint64_t dim = d.get<uint64_t>();
      if (dim != 0 && numel > kMaxNumel / dim) {
        return InvalidArgument(where + ": shape " + info["shape"].dump() + " is too large");
      }
      numel *= dim;
    }
    const json& offsets = info["data_offsets"];
    if (!offsets[0].is_number_unsigned() || !offsets[1].is_number_unsigned()) {
      return InvalidArgument(where + ": data_offsets must be non-negative integers, got " +
                             offsets.dump());
    }
    const uint64_t begin = offsets[0].get<uint64_t>(), end = offsets[1].get<uint64_t>();
    if (begin > end || end > data_bytes) {
      return InvalidArgument(where + ": data_offsets " + offsets.dump() +
                             " fall outside the file's " + std::to_string(data_bytes) +
                             " data bytes (truncated or corrupt file)");
    }
    const size_t item = e.dtype ? dtype_size(*e.dtype) : other_dtype_size(e.dtype_string);
    if (item != 0 && end - begin != numel * item) {
      return InvalidArgument(where + ": data_offsets span " + std::to_string(end - begin) +
                             " bytes but " + e.dtype_string + " shape " + info["shape"].dump() +
                             " needs " + std::to_string(numel * item));
    }
    e.begin = data_start + begin;
    e.end = data_start + end;
    if (auto it = tensors.find(name); it != tensors.end()) {
      return InvalidArgument("tensor '" + name + "' appears in both " +
                             shards[it->second.shard].path + " and " + path);
    }
    tensors.emplace(name, std::move(e));
  }
  return check_no_overlap(shard_index);
}

// The format forbids tensors sharing bytes; a writer bug that overlaps them would
// otherwise silently alias two weights.
Status SafetensorsReader::Impl::check_no_overlap(size_t shard_index) const {
  std::vector<std::pair<const std::string*, const Entry*>> in_shard;
  for (const auto& [name, e] : tensors) {
    if (e.shard == shard_index && e.end > e.begin) in_shard.emplace_back(&name, &e);
  }
  std::sort(in_shard.begin(), in_shard.end(),
            [](const auto& a, const auto& b) { return a.second->begin < b.second->begin; });
  for (size_t i = 1; i < in_shard.size(); ++i) {
    const auto& [prev_name, prev] = in_shard[i - 1];
    const auto& [name, e] = in_shard[i];
    if (e->begin < prev->end) {
      auto bytes = [](const Entry* x) {
        return "bytes [" + std::to_string(x->begin) + ", " + std::to_string(x->end) + ")";
      };
      return InvalidArgument(shards[shard_index].path + ": tensor '" + *name + "' (" + bytes(e) +
                             ") overlaps tensor '" + *prev_name + "' (" + bytes(prev) + ")");
    }
  }
  return Status::Ok();
}

namespace {

StatusOr<std::shared_ptr<SafetensorsReader::Impl>> map_all(const std::vector<std::string>& files,
                                                           const SafetensorsOptions& options) {
  if (files.empty()) return InvalidArgument("no safetensors files given");
  auto impl = std::make_shared<SafetensorsReader::Impl>();
  for (const std::string& f : files) TS_RETURN_IF_ERROR(impl->map_shard(f));
  impl->source = files.size() == 1
                     ? files[0]
                     : std::to_string(files.size()) + " shards (" + files[0] + ", ...)";
  if (options.progress) {
    std::vector<detail::MappedRange> ranges;
    for (const Shard& s : impl->shards) ranges.push_back({s.base, s.size});
    detail::touch_pages_with_progress(ranges, options.progress_min_bytes);
  }
  return impl;
}

}  // namespace

StatusOr<SafetensorsReader> SafetensorsReader::open_files(const std::vector<std::string>& files,
                                                          const SafetensorsOptions& options) {
  auto impl = map_all(files, options);
  if (!impl.ok()) return impl.status();
  return SafetensorsReader(std::move(*impl));
}

StatusOr<SafetensorsReader> SafetensorsReader::open_dir(const std::string& model_dir,
                                                        const SafetensorsOptions& options) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_directory(model_dir, ec)) {
    return NotFound("model directory '" + model_dir + "' does not exist or is not a directory");
  }
  const std::string index_path = model_dir + "/model.safetensors.index.json";
  if (fs::exists(index_path, ec)) {
    std::ifstream in(index_path);
    std::stringstream text;
    text << in.rdbuf();
    json index;
    try {
      index = json::parse(text.str());
    } catch (const json::exception& e) {
      return InvalidArgument(index_path + ": invalid JSON: " + e.what());
    }
    if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object()) {
      return InvalidArgument(index_path + ": missing object field 'weight_map'");
    }
    std::map<std::string, std::string> shard_names;  // shard -> first tensor naming it
    for (const auto& [tensor, file] : index["weight_map"].items()) {
      if (!file.is_string() || file.get<std::string>().empty() ||
          file.get<std::string>().find('/') != std::string::npos) {
        return InvalidArgument(index_path + ": weight_map['" + tensor +
                               "'] must be a shard file name, got " + file.dump());
      }
      shard_names.emplace(file.get<std::string>(), tensor);
    }
    if (shard_names.empty()) return InvalidArgument(index_path + ": weight_map is empty");
    std::vector<std::string> paths;
    for (const auto& [shard, tensor] : shard_names) {
      const std::string path = model_dir + "/" + shard;
      if (!fs::exists(path, ec)) {
        return NotFound(index_path + ": weight_map puts tensor '" + tensor + "' in shard " + shard +
                        ", but " + path + " does not exist");
      }
      paths.push_back(path);
    }
    auto mapped = map_all(paths, options);
    if (!mapped.ok()) return mapped.status();
    Impl& impl = **mapped;
    impl.source = index_path;
    for (const auto& [tensor, file] : index["weight_map"].items()) {
      auto it = impl.tensors.find(tensor);
      if (it == impl.tensors.end() ||
          impl.shards[it->second.shard].path != model_dir + "/" + file.get<std::string>()) {
        return InvalidArgument(index_path + ": weight_map puts tensor '" + tensor + "' in " +
                               file.get<std::string>() + " but that shard does not hold it");
      }
    }
    return SafetensorsReader(std::move(*mapped));
  }
  if (fs::exists(model_dir + "/model.safetensors", ec)) {
    return open_files({model_dir + "/model.safetensors"}, options);
  }
  std::vector<std::string> paths;
  for (const auto& entry : fs::directory_iterator(model_dir, ec)) {
    if (entry.path().extension() == ".safetensors") paths.push_back(entry.path().string());
  }
  if (paths.empty()) {
    return NotFound(model_dir + ": no model.safetensors.index.json, model.safetensors or " +
                    "*.safetensors file");
  }
  std::sort(paths.begin(), paths.end());
  return open_files(paths, options);
}

StatusOr<TensorView> SafetensorsReader::tensor(const std::string& name) const {
  auto it = impl_->tensors.find(name);
  if (it == impl_->tensors.end()) {
    return NotFound("tensor '" + name + "' not found in " + impl_->source);
  }
  const Entry& e = it->second;
  const Shard& shard = impl_->shards[e.shard];
  if (!e.dtype) {
    return InvalidArgument(shard.path + ": tensor '" + name + "' has dtype " + e.dtype_string +
                           "; only F32, F16, BF16 and F8_E4M3 are supported");
  }
  TensorView v;
  v.name = name;
  v.dtype = *e.dtype;
  v.shape = e.shape;
  v.data = shard.base + e.begin;
  v.nbytes = e.end - e.begin;
  v.file = shard.path;
  return v;
}

bool SafetensorsReader::contains(const std::string& name) const {
  return impl_->tensors.count(name) != 0;
}

std::vector<std::string> SafetensorsReader::tensor_names() const {
  std::vector<std::string> out;
  out.reserve(impl_->tensors.size());
  for (const auto& [name, entry] : impl_->tensors) out.push_back(name);
  return out;
}

const std::vector<std::string>& SafetensorsReader::files() const { return impl_->files; }

size_t SafetensorsReader::total_bytes() const { return impl_->total_bytes; }

}  // namespace treeserve
