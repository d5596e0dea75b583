// ProtoMutator: structure-aware mutation of a protobuf message through reflection, so that a
// fuzzer whose input is a serialized message (fuzz_service) changes one field, element or
// oneof choice at a time instead of breaking the wire format with byte flips. It knows
// nothing of the message types: values come from lists of boundary numbers and short texts;
// string fields named *_id or *_ids (and map keys) get "$N" id references (fuzz_service.proto).
#pragma once

#include <google/protobuf/message.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace treeserve::fuzz {

class ProtoMutator {
 public:
  explicit ProtoMutator(uint32_t seed) : rng_(seed) {}

  // One random change somewhere in *message: a scalar set to a new value, a repeated field
  // grown, shrunk or reordered, a sub-message set or cleared (a oneof switches member).
  void mutate(google::protobuf::Message* message);

 private:
  struct Site {
    google::protobuf::Message* message;
    const google::protobuf::FieldDescriptor* field;
    int index;  // element of a repeated field; -1: the field itself
  };

  void collect(google::protobuf::Message* message, int depth, std::vector<Site>* sites);
  void mutate_site(const Site& site);
  void set_scalar(google::protobuf::Message* message, const google::protobuf::FieldDescriptor* f,
                  int index);
  void add_element(google::protobuf::Message* message, const google::protobuf::FieldDescriptor* f);

  int64_t pick_int(int64_t current, int64_t lo, int64_t hi);
  double pick_float(double current);
  std::string pick_text(const std::string& current);
  // libFuzzer's byte-level mutation of current; with utf8, mapped back to valid UTF-8.
  std::string mutate_bytes(const std::string& current, bool utf8);
  std::string pick_id();
  uint32_t below(uint32_t n) { return n == 0 ? 0 : uint32_t(rng_() % n); }

  std::mt19937 rng_;
};

// True for the string fields that carry tree or branch ids (see fuzz_service.proto).
bool is_id_field(const google::protobuf::FieldDescriptor* field);

}  // namespace treeserve::fuzz
