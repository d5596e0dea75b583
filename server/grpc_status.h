// Conversions between treeserve::Status and grpc::Status (server/ only: no other component
// sees gRPC types).
#pragma once

#include <grpcpp/grpcpp.h>

#include "common/status.h"

namespace treeserve {

inline grpc::Status to_grpc(const Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(static_cast<int>(s.code())), s.message());
}

inline grpc::Status grpc_invalid(const std::string& message) {
  return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, message);
}

}  // namespace treeserve
