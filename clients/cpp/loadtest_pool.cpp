// The pool checks of treeserve_loadtest (loadtest.h): GetServerInfo of one server, or summed
// over replicas read directly, and the thread that samples it during a run.
#include <chrono>

#include "clients/cpp/loadtest.h"

namespace treeserve::loadtest {

Pool::Pool(const std::vector<std::string>& targets, const std::string& auth, double timeout_s) {
  for (const std::string& t : targets) {
    clients_.emplace_back(grpc::CreateChannel(t, grpc::InsecureChannelCredentials()), auth,
                          timeout_s);
  }
}

pb::ServerInfo Pool::server_info() {
  pb::ServerInfo out = clients_.front().server_info();
  for (size_t i = 1; i < clients_.size(); ++i) {
    const pb::ServerInfo s = clients_[i].server_info();
    out.set_kv_pages_total(out.kv_pages_total() + s.kv_pages_total());
    out.set_kv_pages_free(out.kv_pages_free() + s.kv_pages_free());
    out.set_kv_pages_evictable(out.kv_pages_evictable() + s.kv_pages_evictable());
    out.set_radix_cached_tokens(out.radix_cached_tokens() + s.radix_cached_tokens());
    out.set_live_trees(out.live_trees() + s.live_trees());
    out.set_live_branches(out.live_branches() + s.live_branches());
    out.set_decode_steps(out.decode_steps() + s.decode_steps());
    out.set_replica_id(out.replica_id() + "," + s.replica_id());
  }
  return out;
}

pb::ServerInfo Pool::wait_idle(double timeout_s, double interval_s) {
  const double end = now_s() + timeout_s;
  while (true) {
    pb::ServerInfo info = server_info();
    if (is_idle(info) || now_s() >= end) return info;
    std::this_thread::sleep_for(std::chrono::duration<double>(interval_s));
  }
}

void KvMonitor::start() {
  thread_ = std::thread([this] {
    std::unique_lock<std::mutex> l(mu_);
    while (!stop_) {
      l.unlock();
      try {
        sample();
      } catch (const RpcError&) {  // a failed poll must not stop the load test
      }
      l.lock();
      cv_.wait_for(l, std::chrono::duration<double>(interval_), [this] { return stop_; });
    }
  });
}

void KvMonitor::stop() {
  {
    std::lock_guard<std::mutex> l(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  try {
    sample();
  } catch (const RpcError&) {
  }
}

void KvMonitor::sample() {
  pb::ServerInfo i = pool_.server_info();
  Sample s{now_s() - t0_,  kv_pages_in_use(i), i.kv_pages_evictable(), i.kv_pages_free(),
           i.live_trees(), i.live_branches(),  i.decode_steps()};
  std::lock_guard<std::mutex> l(samples_mu_);
  samples.push_back(s);
}

}  // namespace treeserve::loadtest
