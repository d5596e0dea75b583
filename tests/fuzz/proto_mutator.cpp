// ProtoMutator (proto_mutator.h): collect every mutable place of a message tree, pick one,
// change it. Strings stay valid UTF-8: proto3 refuses to parse anything else, and an input
// that does not parse reaches no handler.
#include "tests/fuzz/proto_mutator.h"

#include <google/protobuf/descriptor.pb.h>

#include <cmath>
#include <limits>
#include <vector>

#include "tests/fuzz/fuzz_util.h"

extern "C" size_t LLVMFuzzerMutate(uint8_t* data, size_t size, size_t max_size);

namespace treeserve::fuzz {

namespace {

using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;

constexpr int kMaxDepth = 8;
constexpr int kMaxRepeated = 24;

// Numbers near the limits the fuzzed server is configured with, and the type's extremes.
constexpr int64_t kInts[] = {
    0,    1,    2,    3,     4,  5,  7,    8,    9,       15,        16,          17,  31,
    32,   33,   48,   49,    63, 64, 100,  255,  256,     511,       512,         513, 1000,
    2047, 2048, 4096, 65535, -1, -2, -100, -512, 1 << 20, 1ll << 31, -(1ll << 31)};

// Short texts: words of the tiny model's corpus, whitespace, multi-byte characters, control
// pieces spelled out, and text that decodes to stop strings.
const char* const kTexts[] = {"",
                              " ",
                              "\n",
                              "\t",
                              "the",
                              " the",
                              "The old oak",
                              "hello world",
                              "0123456789",
                              "caf\xC3\xA9",
                              "\xE6\x97\xA5\xE6\x9C\xAC",
                              "\xF0\x9F\x98\x80",
                              "<s>",
                              "</s>",
                              "<unk>",
                              "<0x0A>",
                              "\xE2\x96\x81",
                              ".",
                              ",",
                              "a",
                              "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
                              "The creek flooded the lower meadow, and Tom watched it."};

// Replaces every byte that is not part of a well-formed UTF-8 sequence with '?'.
std::string to_utf8(const std::string& s) {
  std::string out;
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    const size_t len = c < 0x80           ? 1
                       : (c >> 5) == 0x6  ? 2
                       : (c >> 4) == 0xE  ? 3
                       : (c >> 3) == 0x1E ? 4
                                          : 0;
    if (len > 0 && i + len <= s.size() && is_valid_utf8(std::string_view(s).substr(i, len))) {
      out.append(s, i, len);
      i += len;
    } else {
      out += '?';
      ++i;
    }
  }
  return out;
}

}  // namespace

bool is_id_field(const FieldDescriptor* field) {
  if (field->cpp_type() != FieldDescriptor::CPPTYPE_STRING) return false;
  const std::string& name = field->name();
  auto ends_with = [&](const char* suffix) {
    const std::string s = suffix;
    return name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0;
  };
  return ends_with("_id") || ends_with("_ids") ||
         (field->containing_type()->options().map_entry() && name == "key");
}

void ProtoMutator::mutate(Message* message) {
  std::vector<Site> sites;
  collect(message, 0, &sites);
  if (sites.empty()) return;
  mutate_site(sites[below(uint32_t(sites.size()))]);
}

void ProtoMutator::collect(Message* message, int depth, std::vector<Site>* sites) {
  const auto* d = message->GetDescriptor();
  const Reflection* r = message->GetReflection();
  for (int i = 0; i < d->field_count(); ++i) {
    const FieldDescriptor* f = d->field(i);
    sites->push_back({message, f, -1});
    const bool is_message = f->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE;
    if (f->is_repeated()) {
      const int n = r->FieldSize(*message, f);
      for (int j = 0; j < n; ++j) {
        if (!is_message) {
          sites->push_back({message, f, j});
        } else if (depth < kMaxDepth) {
          collect(r->MutableRepeatedMessage(message, f, j), depth + 1, sites);
        }
      }
    } else if (is_message && depth < kMaxDepth && r->HasField(*message, f)) {
      collect(r->MutableMessage(message, f), depth + 1, sites);
    }
  }
}

void ProtoMutator::mutate_site(const Site& site) {
  Message* m = site.message;
  const FieldDescriptor* f = site.field;
  const Reflection* r = m->GetReflection();
  if (site.index >= 0) {
    set_scalar(m, f, site.index);
    return;
  }
  if (f->is_repeated()) {
    const int n = r->FieldSize(*m, f);
    switch (n == 0 ? 0 : below(4)) {
      case 0:
      case 1:
        if (n < kMaxRepeated) add_element(m, f);
        return;
      case 2:  // drop one element: move it last, then remove the last
        r->SwapElements(m, f, int(below(uint32_t(n))), n - 1);
        r->RemoveLast(m, f);
        return;
      default:
        r->SwapElements(m, f, int(below(uint32_t(n))), int(below(uint32_t(n))));
        return;
    }
  }
  if (f->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
    if (r->HasField(*m, f) && below(3) == 0) {
      r->ClearField(m, f);
    } else {
      Message* sub = r->MutableMessage(m, f);  // sets it (and switches its oneof)
      mutate(sub);
    }
    return;
  }
  set_scalar(m, f, -1);
}

void ProtoMutator::add_element(Message* m, const FieldDescriptor* f) {
  const Reflection* r = m->GetReflection();
  switch (f->cpp_type()) {
    case FieldDescriptor::CPPTYPE_MESSAGE: {
      Message* added = r->AddMessage(m, f);
      for (uint32_t k = 0, n = 1 + below(3); k < n; ++k) mutate(added);
      return;
    }
    case FieldDescriptor::CPPTYPE_INT32:
      r->AddInt32(m, f, 0);
      break;
    case FieldDescriptor::CPPTYPE_INT64:
      r->AddInt64(m, f, 0);
      break;
    case FieldDescriptor::CPPTYPE_UINT32:
      r->AddUInt32(m, f, 0);
      break;
    case FieldDescriptor::CPPTYPE_UINT64:
      r->AddUInt64(m, f, 0);
      break;
    case FieldDescriptor::CPPTYPE_FLOAT:
      r->AddFloat(m, f, 0);
      break;
    case FieldDescriptor::CPPTYPE_DOUBLE:
      r->AddDouble(m, f, 0);
      break;
    case FieldDescriptor::CPPTYPE_BOOL:
      r->AddBool(m, f, false);
      break;
    case FieldDescriptor::CPPTYPE_ENUM:
      r->AddEnumValue(m, f, 0);
      break;
    case FieldDescriptor::CPPTYPE_STRING:
      r->AddString(m, f, "");
      break;
  }
  set_scalar(m, f, r->FieldSize(*m, f) - 1);
}

void ProtoMutator::set_scalar(Message* m, const FieldDescriptor* f, int index) {
  const Reflection* r = m->GetReflection();
  const bool rep = index >= 0;
  switch (f->cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32: {
      const int64_t cur = rep ? r->GetRepeatedInt32(*m, f, index) : r->GetInt32(*m, f);
      const auto v = int32_t(pick_int(cur, INT32_MIN, INT32_MAX));
      rep ? r->SetRepeatedInt32(m, f, index, v) : r->SetInt32(m, f, v);
      return;
    }
    case FieldDescriptor::CPPTYPE_INT64: {
      const int64_t cur = rep ? r->GetRepeatedInt64(*m, f, index) : r->GetInt64(*m, f);
      const int64_t v = pick_int(cur, INT64_MIN, INT64_MAX);
      rep ? r->SetRepeatedInt64(m, f, index, v) : r->SetInt64(m, f, v);
      return;
    }
    case FieldDescriptor::CPPTYPE_UINT32: {
      const int64_t cur = rep ? r->GetRepeatedUInt32(*m, f, index) : r->GetUInt32(*m, f);
      const auto v = uint32_t(pick_int(cur, 0, UINT32_MAX));
      rep ? r->SetRepeatedUInt32(m, f, index, v) : r->SetUInt32(m, f, v);
      return;
    }
    case FieldDescriptor::CPPTYPE_UINT64: {
      const auto cur = int64_t(rep ? r->GetRepeatedUInt64(*m, f, index) : r->GetUInt64(*m, f));
      const auto v =
          below(8) == 0 ? uint64_t(rng_()) << 32 | rng_() : uint64_t(pick_int(cur, 0, INT64_MAX));
      rep ? r->SetRepeatedUInt64(m, f, index, v) : r->SetUInt64(m, f, v);
      return;
    }
    case FieldDescriptor::CPPTYPE_FLOAT: {
      const double cur = rep ? r->GetRepeatedFloat(*m, f, index) : r->GetFloat(*m, f);
      const auto v = float(pick_float(cur));
      rep ? r->SetRepeatedFloat(m, f, index, v) : r->SetFloat(m, f, v);
      return;
    }
    case FieldDescriptor::CPPTYPE_DOUBLE: {
      const double cur = rep ? r->GetRepeatedDouble(*m, f, index) : r->GetDouble(*m, f);
      const double v = pick_float(cur);
      rep ? r->SetRepeatedDouble(m, f, index, v) : r->SetDouble(m, f, v);
      return;
    }
    case FieldDescriptor::CPPTYPE_BOOL: {
      const bool v = !(rep ? r->GetRepeatedBool(*m, f, index) : r->GetBool(*m, f));
      rep ? r->SetRepeatedBool(m, f, index, v) : r->SetBool(m, f, v);
      return;
    }
    case FieldDescriptor::CPPTYPE_ENUM: {
      const auto* e = f->enum_type();
      // proto3 enums are open: an unknown number must be handled too.
      const int v = below(6) == 0 ? int(pick_int(0, -3, 100))
                                  : e->value(int(below(uint32_t(e->value_count()))))->number();
      rep ? r->SetRepeatedEnumValue(m, f, index, v) : r->SetEnumValue(m, f, v);
      return;
    }
    case FieldDescriptor::CPPTYPE_STRING: {
      const std::string cur = rep ? r->GetRepeatedString(*m, f, index) : r->GetString(*m, f);
      const bool bytes = f->type() == FieldDescriptor::TYPE_BYTES;
      const std::string v = is_id_field(f) && below(4) != 0 ? pick_id()
                            : bytes                         ? mutate_bytes(cur, false)
                                                            : pick_text(cur);
      rep ? r->SetRepeatedString(m, f, index, v) : r->SetString(m, f, v);
      return;
    }
    case FieldDescriptor::CPPTYPE_MESSAGE:
      return;
  }
}

int64_t ProtoMutator::pick_int(int64_t current, int64_t lo, int64_t hi) {
  int64_t v = 0;
  switch (below(4)) {
    case 0:
      v = current + int64_t(below(5)) - 2;
      break;
    case 1:
      v = int64_t(below(10));
      break;
    case 2:
      v = int64_t(rng_()) - int64_t(1u << 31);
      break;
    default:
      v = kInts[below(sizeof(kInts) / sizeof(kInts[0]))];
      break;
  }
  if (below(16) == 0) v = below(2) ? lo : hi;
  return v < lo ? lo : v > hi ? hi : v;
}

double ProtoMutator::pick_float(double current) {
  constexpr double kFloats[] = {0.0,  0.1,   0.5,  0.9,  1.0,   1.5,   2.0,
                                10.0, 100.0, -0.5, -1.0, 1e-40, 3.4e38};
  switch (below(8)) {
    case 0:
      return std::numeric_limits<double>::quiet_NaN();
    case 1:
      return below(2) ? std::numeric_limits<double>::infinity()
                      : -std::numeric_limits<double>::infinity();
    case 2:
      return current * 2 + 0.25;
    case 3:
      return double(below(1000)) / 500.0;
    default:
      return kFloats[below(sizeof(kFloats) / sizeof(kFloats[0]))];
  }
}

std::string ProtoMutator::pick_text(const std::string& current) {
  const std::string word = kTexts[below(sizeof(kTexts) / sizeof(kTexts[0]))];
  switch (below(5)) {
    case 0:
      return word;
    case 1:
      return current + word;
    case 2:
      return word + current;
    case 3:
      return mutate_bytes(current, true);
    default:
      return current.substr(0, below(uint32_t(current.size()) + 1));
  }
}

std::string ProtoMutator::mutate_bytes(const std::string& current, bool utf8) {
  std::string bytes = current.empty() ? std::string(1, char(rng_())) : current;
  const size_t size = bytes.size();
  const size_t max = size + 16;
  bytes.resize(max);
  const size_t n = LLVMFuzzerMutate(reinterpret_cast<uint8_t*>(bytes.data()), size, max);
  bytes.resize(n);
  return utf8 ? to_utf8(bytes) : bytes;
}

std::string ProtoMutator::pick_id() {
  switch (below(8)) {
    case 0:
      return "";
    case 1:
      return below(2) ? "t0" : "b0";
    default:
      return "$" + std::to_string(below(8));
  }
}

}  // namespace treeserve::fuzz
