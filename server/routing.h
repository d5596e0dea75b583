// Routing across replicas, the server's side (common/route_key.h; docs/api.md, "Routing across
// replicas"): the x-treeserve-route header read and checked, the route of a new tree, the
// check that a tree id names this replica and this run of it, and x-treeserve-replica on every
// response.
#pragma once

#include <grpcpp/grpcpp.h>
#include <grpcpp/support/server_interceptor.h>

#include <memory>
#include <string>

#include "common/status.h"

namespace treeserve {

class Counter;
namespace v1 {
class Prompt;
}

// Who tree ids name: this replica (server.replica_id) and its run (drawn at start).
struct ReplicaIdentity {
  std::string replica_id;
  std::string incarnation;
};

// The call's x-treeserve-route: "" when it carries none; INVALID_ARGUMENT naming the header
// when the value is not a routing key or the header comes more than once.
StatusOr<std::string> route_header(const grpc::ServerContextBase& ctx);

// The routing key of a prompt as the request gives it (text, token ids or messages, before
// tokenizing; N = 256 bytes, M = 64 ids): what a client computes without the tokenizer.
std::string prompt_route_key(const v1::Prompt& prompt);

// OK unless `tree_id` names another replica (FAILED_PRECONDITION naming it and the tree's
// route, counted in `misrouted`, which may be null) or an earlier run of this one (NOT_FOUND:
// its trees were lost). An id of another form passes: the scheduler answers NOT_FOUND for it,
// as for any unknown tree.
Status check_tree_replica(const std::string& tree_id, const ReplicaIdentity& me,
                          Counter* misrouted);

// A server interceptor that adds x-treeserve-replica: <replica_id> to the initial metadata of
// every call that sends any (a reply, or an error the handler returned; not a call the
// transport or the auth interceptor ended first).
std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
make_replica_interceptor_factory(std::string replica_id);

}  // namespace treeserve
