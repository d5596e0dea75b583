// Routing across replicas, the server's side (server/routing.h).
#include "server/routing.h"

#include <spdlog/spdlog.h>

#include <span>
#include <vector>

#include "common/metrics.h"
#include "common/route_key.h"
#include "proto/treeserve.pb.h"

namespace treeserve {
namespace {

class ReplicaInterceptor final : public grpc::experimental::Interceptor {
 public:
  explicit ReplicaInterceptor(const std::string* replica_id) : replica_id_(replica_id) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    using grpc::experimental::InterceptionHookPoints;
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_INITIAL_METADATA)) {
      methods->GetSendInitialMetadata()->emplace(kReplicaHeader, *replica_id_);
    }
    methods->Proceed();
  }

 private:
  const std::string* replica_id_;  // the factory's, which the server keeps
};

class ReplicaInterceptorFactory final
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit ReplicaInterceptorFactory(std::string replica_id) : replica_id_(std::move(replica_id)) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo*) override {
    return new ReplicaInterceptor(&replica_id_);
  }

 private:
  const std::string replica_id_;
};

}  // namespace

StatusOr<std::string> route_header(const grpc::ServerContextBase& ctx) {
  const auto& md = ctx.client_metadata();
  const auto [first, last] = md.equal_range(kRouteHeader);
  if (first == last) return std::string();
  if (std::next(first) != last) {
    return InvalidArgument(std::string(kRouteHeader) + ": given " +
                           std::to_string(std::distance(first, last)) +
                           " times; send it once (a proxy hashes one value)");
  }
  std::string value(first->second.data(), first->second.size());
  TS_RETURN_IF_ERROR(check_route_key(value));
  return value;
}

std::string prompt_route_key(const v1::Prompt& prompt) {
  if (prompt.has_tokens()) {
    const auto& ids = prompt.tokens().ids();
    return route_key_ids(std::span<const int32_t>(ids.data(), size_t(ids.size())));
  }
  if (prompt.has_messages()) {
    std::vector<RouteMessage> messages;
    for (const v1::ChatMessage& m : prompt.messages().messages()) {
      messages.emplace_back(m.role(), m.content());
    }
    return route_key_messages(messages);
  }
  return route_key_text(prompt.text());
}

Status check_tree_replica(const std::string& tree_id, const ReplicaIdentity& me,
                          Counter* misrouted) {
  std::optional<TreeIdParts> parts = parse_tree_id(tree_id);
  if (!parts) return Status::Ok();
  if (parts->replica != me.replica_id) {
    if (misrouted != nullptr) misrouted->inc();
    spdlog::debug("tree={} misrouted: it lives on replica {}", tree_id, parts->replica);
    return FailedPrecondition("tree " + tree_id + " lives on replica '" + parts->replica +
                              "', not on this replica '" + me.replica_id +
                              "': send its calls with the header " + kRouteHeader + ": " +
                              parts->route + " so the proxy routes them to '" + parts->replica +
                              "' (if '" + parts->replica + "' has stopped, its trees are gone)");
  }
  if (parts->incarnation != me.incarnation) {
    return NotFound("tree " + tree_id + " was made by an earlier run of replica '" + me.replica_id +
                    "', which restarted: its trees were lost");
  }
  return Status::Ok();
}

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
make_replica_interceptor_factory(std::string replica_id) {
  return std::make_unique<ReplicaInterceptorFactory>(std::move(replica_id));
}

}  // namespace treeserve
