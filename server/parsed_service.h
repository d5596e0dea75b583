// The base of the TreeServe service: it reads every request itself, through
// proto/request_parsing.h, so that
//   - a request that does not parse (a string field that is not valid UTF-8, truncated bytes)
//     gets INVALID_ARGUMENT naming the field, and
//   - after a request the transport refused (over the receive limit) or that did not parse,
//     the memory its bytes held goes back to the operating system at once.
//
// Why a base class: the generated service parses unary requests as protobuf::MessageLite,
// through gRPC's generic SerializationTraits, before any handler runs, and answers a failure
// with INTERNAL and an empty message; a request refused for its size never reaches a handler.
// Specializing the traits of MessageLite would change every protobuf message of the process
// (health, reflection) and break the one-definition rule. So this base installs gRPC's
// streamed-unary handler for each unary method (one read, one write) and its split-streaming
// handler for Generate (one read, many writes): the same bytes on the wire, but the read is the
// handler's, with the request type's own traits. TreeSearch reads its own messages already.
#pragma once

#include <string>
#include <vector>

#include "proto/treeserve.grpc.pb.h"

namespace treeserve {

class ParsedRequestsService : public v1::TreeServe::Service {
 public:
  // The methods whose handler this base replaced (for tests: every method of
  // treeserve.v1.TreeServe but TreeSearch).
  const std::vector<std::string>& parsed_methods() const { return parsed_; }

 protected:
  ParsedRequestsService();

  // Generate's body: the request parsed, its responses written to `writer`.
  virtual grpc::Status generate_stream(
      grpc::ServerContext* ctx, const v1::GenerateRequest* request,
      grpc::internal::WriterInterface<v1::GenerateResponse>* writer) = 0;

  // Before a Read of a request message: forgets an earlier failure of this thread.
  static void before_read();
  // After that Read failed: gives the memory freed by the failure back to the operating system
  // (malloc_trim: a refused request may have held up to the receive limit), and returns the
  // status to end the call with: INVALID_ARGUMENT naming the field when the message did not
  // parse, else CANCELLED with `otherwise` (the client went away, or the transport refused
  // the message and has told the client so).
  static grpc::Status failed_read(const std::string& otherwise);

 private:
  template <typename Request, typename Response>
  void parse_unary(const char* name,
                   grpc::Status (v1::TreeServe::Service::*method)(grpc::ServerContext*,
                                                                  const Request*, Response*));
  void parse_generate();
  std::vector<std::string> parsed_;
};

}  // namespace treeserve
