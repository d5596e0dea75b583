// TreeServe's request reads (server/parsed_service.h).
#include "server/parsed_service.h"

#include <google/protobuf/descriptor.h>
#include <malloc.h>

namespace treeserve {
namespace {

// The method's index in the generated service: the proto's declaration order, which is the
// order the generated constructor adds them in; -1 when the service has no such method.
int method_index(const char* name, bool server_streaming) {
  const google::protobuf::ServiceDescriptor* service =
      v1::CreateTreeRequest::descriptor()->file()->FindServiceByName("TreeServe");
  for (int i = 0; service != nullptr && i < service->method_count(); ++i) {
    const google::protobuf::MethodDescriptor* m = service->method(i);
    if (m->name() != name) continue;
    return !m->client_streaming() && m->server_streaming() == server_streaming ? i : -1;
  }
  return -1;
}

}  // namespace

void ParsedRequestsService::before_read() { v1::take_request_parse_error(); }

grpc::Status ParsedRequestsService::failed_read(const std::string& otherwise) {
  const std::string bad = v1::take_request_parse_error();
  malloc_trim(0);
  if (!bad.empty()) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, bad);
  return grpc::Status(grpc::StatusCode::CANCELLED, otherwise);
}

template <typename Request, typename Response>
void ParsedRequestsService::parse_unary(
    const char* name, grpc::Status (v1::TreeServe::Service::*method)(grpc::ServerContext*,
                                                                     const Request*, Response*)) {
  const int index = method_index(name, /*server_streaming=*/false);
  if (index < 0) return;
  MarkMethodStreamed(index,
                     new grpc::internal::StreamedUnaryHandler<Request, Response>(
                         [this, method](grpc::ServerContext* ctx,
                                        grpc::ServerUnaryStreamer<Request, Response>* stream) {
                           Request request;
                           before_read();
                           if (!stream->Read(&request)) {
                             return failed_read("the call ended before its request arrived");
                           }
                           Response response;
                           grpc::Status status = (this->*method)(ctx, &request, &response);
                           if (status.ok()) stream->Write(response);
                           return status;
                         }));
  parsed_.push_back(name);
}

void ParsedRequestsService::parse_generate() {
  using Request = v1::GenerateRequest;
  using Response = v1::GenerateResponse;
  const int index = method_index("Generate", /*server_streaming=*/true);
  if (index < 0) return;
  MarkMethodStreamed(index, new grpc::internal::SplitServerStreamingHandler<Request, Response>(
                                [this](grpc::ServerContext* ctx,
                                       grpc::ServerSplitStreamer<Request, Response>* stream) {
                                  Request request;
                                  before_read();
                                  if (!stream->Read(&request)) {
                                    return failed_read("the call ended before its request arrived");
                                  }
                                  return generate_stream(ctx, &request, stream);
                                }));
  parsed_.push_back("Generate");
}

ParsedRequestsService::ParsedRequestsService() {
  using S = v1::TreeServe::Service;
  parse_unary("CreateTree", &S::CreateTree);
  parse_unary("Branch", &S::Branch);
  parse_generate();
  parse_unary("Prune", &S::Prune);
  parse_unary("Verify", &S::Verify);
  parse_unary("GetTree", &S::GetTree);
  parse_unary("DeleteTree", &S::DeleteTree);
  parse_unary("Tokenize", &S::Tokenize);
  parse_unary("Detokenize", &S::Detokenize);
  parse_unary("GetServerInfo", &S::GetServerInfo);
  parse_unary("ListTrees", &S::ListTrees);
}

}  // namespace treeserve
