// How the gRPC server turns the bytes of a treeserve.v1 request into its message. gRPC's
// default parse answers a request it cannot parse (proto3 `string` fields must be valid UTF-8)
// with INTERNAL and an empty message. These SerializationTraits of the request types answer
// INVALID_ARGUMENT naming the field instead ("prompt.text: not valid UTF-8 ..."). The build
// has grpc_cpp_plugin include this header into treeserve.grpc.pb.h
// (additional_header_includes), so every use of the traits of a request type sees them. The
// generated code parses unary requests through the traits of protobuf::MessageLite instead;
// the server's TreeServe service reads those itself (server/parsed_service.h).
#pragma once

#include <grpcpp/impl/codegen/proto_utils.h>

#include <string>
#include <string_view>

#include "proto/treeserve.pb.h"

namespace treeserve::v1 {

// Why `bytes` do not parse as a `descriptor` message, naming the first field at fault:
// "prompt.text: not valid UTF-8 ...", "sampling.stop[1]: ...", "field 9: truncated"; a
// message with no such field gets "request: not a valid <type> message".
std::string describe_parse_failure(const google::protobuf::Descriptor* descriptor,
                                   std::string_view bytes);

// Parses `buffer` into `message` (and clears the buffer); INVALID_ARGUMENT from
// describe_parse_failure when it does not parse. The failure's message is also kept for the
// calling thread (take_request_parse_error), since a failed read of a streamed request reaches
// its handler only as a false Read().
grpc::Status parse_request(grpc::ByteBuffer* buffer, google::protobuf::Message* message);

// The message of the calling thread's last failed parse_request, "" if none; clears it. A
// handler calls it before a Read (to drop an earlier call's failure) and after a failed one.
std::string take_request_parse_error();

}  // namespace treeserve::v1

// Full specializations for the request types: gRPC's generic one covers every other message.
#define TREESERVE_PARSED_REQUEST(Type)                                                      \
  template <>                                                                               \
  class SerializationTraits<treeserve::v1::Type, void> {                                    \
   public:                                                                                  \
    static grpc::Status Serialize(const grpc::protobuf::MessageLite& msg, ByteBuffer* bb,   \
                                  bool* own_buffer) {                                       \
      return GenericSerialize<ProtoBufferWriter, treeserve::v1::Type>(msg, bb, own_buffer); \
    }                                                                                       \
    static grpc::Status Deserialize(ByteBuffer* buffer, grpc::protobuf::MessageLite* msg) { \
      return treeserve::v1::parse_request(buffer, static_cast<treeserve::v1::Type*>(msg));  \
    }                                                                                       \
  }

namespace grpc {
TREESERVE_PARSED_REQUEST(CreateTreeRequest);
TREESERVE_PARSED_REQUEST(BranchRequest);
TREESERVE_PARSED_REQUEST(GenerateRequest);
TREESERVE_PARSED_REQUEST(PruneRequest);
TREESERVE_PARSED_REQUEST(VerifyRequest);
TREESERVE_PARSED_REQUEST(GetTreeRequest);
TREESERVE_PARSED_REQUEST(DeleteTreeRequest);
TREESERVE_PARSED_REQUEST(TokenizeRequest);
TREESERVE_PARSED_REQUEST(DetokenizeRequest);
TREESERVE_PARSED_REQUEST(GetServerInfoRequest);
TREESERVE_PARSED_REQUEST(TreeSearchRequest);
TREESERVE_PARSED_REQUEST(ListTreesRequest);
}  // namespace grpc

#undef TREESERVE_PARSED_REQUEST
