// Request parsing with field-naming errors (proto/request_parsing.h).
#include "proto/request_parsing.h"

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/stubs/common.h>
#include <google/protobuf/wire_format_lite.h>

#include <map>

namespace treeserve::v1 {
namespace {

using google::protobuf::Descriptor;
using google::protobuf::FieldDescriptor;
using google::protobuf::internal::WireFormatLite;
using google::protobuf::io::CodedInputStream;

// Nesting deeper than this is reported rather than followed (protobuf's own limit is 100).
constexpr int kMaxDepth = 64;

thread_local std::string t_last_error;

// Walks one message's wire format against its descriptor; true (with *why) at the first field
// that makes it unparsable: a string that is not valid UTF-8, a truncated or malformed field.
bool find_fault(const Descriptor* d, CodedInputStream* in, const std::string& prefix, int depth,
                std::string* why) {
  std::map<int, int> seen;  // occurrences per field number: the index of a repeated field
  for (;;) {
    const uint32_t tag = in->ReadTag();
    if (tag == 0) {
      if (in->ConsumedEntireMessage()) return false;
      *why = (prefix.empty() ? "request" : prefix.substr(0, prefix.size() - 1)) +
             ": malformed field tag";
      return true;
    }
    const int number = WireFormatLite::GetTagFieldNumber(tag);
    const FieldDescriptor* f = d->FindFieldByNumber(number);
    std::string path = prefix;
    if (f != nullptr) {
      path += f->name();
    } else {
      path += "field ";
      path += std::to_string(number);
    }
    const int index = seen[number]++;
    if (f && f->is_repeated()) {
      path += '[';
      path += std::to_string(index);
      path += ']';
    }
    if (WireFormatLite::GetTagWireType(tag) != WireFormatLite::WIRETYPE_LENGTH_DELIMITED) {
      if (!WireFormatLite::SkipField(in, tag)) {
        *why = path + ": malformed or truncated";
        return true;
      }
      continue;
    }
    uint32_t length = 0;
    std::string data;
    if (!in->ReadVarint32(&length) || !in->ReadString(&data, int(length))) {
      *why = path + ": truncated (the request ends inside the field)";
      return true;
    }
    if (f == nullptr) continue;
    if (f->type() == FieldDescriptor::TYPE_STRING &&
        !google::protobuf::internal::IsStructurallyValidUTF8(data.data(), int(data.size()))) {
      *why = path + ": not valid UTF-8 (string fields are UTF-8 text; send raw bytes as token ids)";
      return true;
    }
    if (f->type() == FieldDescriptor::TYPE_MESSAGE) {
      if (depth >= kMaxDepth) {
        *why = path + ": nested too deeply";
        return true;
      }
      CodedInputStream sub(reinterpret_cast<const uint8_t*>(data.data()), int(data.size()));
      if (find_fault(f->message_type(), &sub, path + ".", depth + 1, why)) return true;
    }
  }
}

}  // namespace

std::string describe_parse_failure(const Descriptor* descriptor, std::string_view bytes) {
  CodedInputStream in(reinterpret_cast<const uint8_t*>(bytes.data()), int(bytes.size()));
  std::string why;
  if (find_fault(descriptor, &in, "", 0, &why)) return why;
  return "request: not a valid " + descriptor->full_name() + " message (" +
         std::to_string(bytes.size()) + " bytes)";
}

grpc::Status parse_request(grpc::ByteBuffer* buffer, google::protobuf::Message* message) {
  if (buffer == nullptr) return grpc::Status(grpc::StatusCode::INTERNAL, "No payload");
  {
    grpc::ProtoBufferReader reader(buffer);
    if (!reader.status().ok()) return reader.status();
    if (message->ParseFromZeroCopyStream(&reader) && reader.status().ok()) {
      buffer->Clear();
      return grpc::Status::OK;
    }
  }
  // The slow path, for requests that fail: the bytes again, walked field by field.
  std::string bytes;
  std::vector<grpc::Slice> slices;
  if (buffer->Dump(&slices).ok()) {
    for (const grpc::Slice& s : slices) {
      bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
    }
  }
  buffer->Clear();
  t_last_error = describe_parse_failure(message->GetDescriptor(), bytes);
  return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, t_last_error);
}

std::string take_request_parse_error() {
  std::string out;
  out.swap(t_last_error);
  return out;
}

}  // namespace treeserve::v1
